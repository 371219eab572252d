"""Token-in/token-out chat rendering for multi-turn episodes: render only the new message.

A multi-turn context is never re-rendered from text. The first prompt is the chat
template's rendering of ``[system?, user: first observation]`` with the generation
prompt; after that the policy's sampled tokens are appended exactly as sampled, and
each environment message is appended as the *delta* the template adds for it:

    (rest of the closing of the assistant turn the policy just ended)
    + (the new message, with its template glue)
    + (the generation prompt for the next assistant turn)

rendered once, tokenized once. For ChatML (SmolLM2, Qwen) after a turn that ended
with ``<|im_end|>`` this is ``"\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>
assistant\\n"``; the generation prompt therefore appears exactly once per turn.

How the delta is found (any Jinja chat template; the trick of verl and SkyRL):
render a fixed reference conversation ``[system?, user "U", assistant SENTINEL,
new message]`` with the generation prompt; the delta is the text after SENTINEL.
Only the text *after* the last assistant turn is taken, so a template may rewrite
earlier turns once a message follows -- Qwen3 drops the ``<think>`` block of every
assistant turn before the last user message -- without touching the context: the
policy's earlier turns stay as sampled. The delta must start with a stop id (the
end-of-turn token the policy samples, ``eot_id``), after whitespace at most (Llama 2
closes a turn with ``" </s>"``; a turn the policy ended with ``</s>`` stands for it).

At start-up one probe checks that the delta depends on the new message alone: the
same message after two exchanges must render the same delta as after one, and the
next turn must be prompted as the first one was. A template that fails (one that
numbers turns, say) is refused with a ``ValueError`` rather than mis-rendered.

Tokenizers are duck-typed: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``apply_chat_template(messages, add_generation_prompt) -> str``, ``eos_id``, and
optionally ``stop_ids`` (every id that ends a response). Whatever ``encode("")``
returns (a BOS a tokenizer always adds) is stripped from fragments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

_SENTINEL = "JAXFLASH_ASSISTANT_SENTINEL_1f7c"
_EARLIER = "JAXFLASH_EARLIER_TURN_9b2e"  # an earlier assistant turn of the probe
_PROBE = "JAXFLASH_PROBE_MESSAGE_4d0a"


class ChatTokenizer(Protocol):
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


class TurnRenderer:
    """Renders first prompts and between-turn deltas for one tokenizer and template.

    Args:
      tokenizer: see the module docstring.
      system_prompt: optional system message before the first observation.
      stop_ids: ids that end a turn; default ``tokenizer.stop_ids`` if it has them,
        else ``{tokenizer.eos_id}``.

    Attributes:
      eot_id: the template's end-of-turn token id (first token of every delta).
      stop_ids: frozenset of ids that end a turn.

    Raises:
      ValueError: (one line) the template drops the assistant's content, its delta
        does not start with a stop id (generation would never stop where a turn
        ends), or the delta of a message depends on the turns before it (module).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        system_prompt: str | None = None,
        stop_ids: Iterable[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        if stop_ids is None:
            stop_ids = getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,)
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self._bos_prefix = list(tokenizer.encode(""))
        self._head = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        # The probe: the end-of-turn token, then history independence.
        delta = self._delta([{"role": "user", "content": "U"}], _PROBE, "user")
        # Llama 2 writes " </s>": whitespace the policy never samples before its stop id.
        lead = len(delta) - len(delta.lstrip())
        delta_ids = self.encode_fragment(delta[lead:])
        if not delta_ids or delta_ids[0] not in self.stop_ids:
            raise ValueError(
                f"TurnRenderer: the chat template closes an assistant turn with {delta!r}, "
                f"whose first token {delta_ids[:1]} is not a stop id {sorted(self.stop_ids)}"
            )
        self.eot_id = delta_ids[0]
        eot_text = tokenizer.decode([self.eot_id])
        if not delta[lead:].startswith(eot_text):
            raise ValueError(
                f"TurnRenderer: the chat template's delta {delta!r} does not start with the "
                f"text of its end-of-turn token {eot_text!r}"
            )
        # What a turn the policy ended with eot_id already stands for in the context.
        self._eot_text = delta[:lead] + eot_text
        longer = [
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": _EARLIER},
            {"role": "user", "content": "V"},
        ]
        if self._delta(longer, _PROBE, "user") != delta:
            raise ValueError(
                "TurnRenderer: the chat template renders a new message differently after "
                "two exchanges than after one, so it cannot be extended turn by turn "
                "without re-rendering the policy's earlier turns"
            )
        first = tokenizer.apply_chat_template(self.first_messages("U"), add_generation_prompt=True)
        bare = tokenizer.apply_chat_template(self.first_messages("U"), add_generation_prompt=False)
        if first.startswith(bare) and not delta.endswith(first[len(bare) :]):
            raise ValueError(
                f"TurnRenderer: the chat template prompts the first turn with "
                f"{first[len(bare) :]!r} but a later one with the end of {delta!r}"
            )

    def _delta(self, history: list[dict[str, str]], content: str, role: str) -> str:
        """Text after SENTINEL in ``[system?, *history, assistant SENTINEL, (role, content)]``
        rendered with the generation prompt."""
        return self._delta_of(history, [{"role": role, "content": content}])

    def _delta_of(
        self, history: list[dict[str, Any]], new: Sequence[dict[str, Any]], **template_kwargs: Any
    ) -> str:
        """Text after SENTINEL in ``[system?, *history, assistant SENTINEL, *new]`` rendered
        with the generation prompt (and ``template_kwargs``, e.g. ``tools``)."""
        messages = [*self._head, *history, {"role": "assistant", "content": _SENTINEL}, *new]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **template_kwargs
        )
        at = text.find(_SENTINEL)
        if at < 0:
            roles = [m.get("role") for m in new]
            raise ValueError(
                f"TurnRenderer: the chat template drops an assistant turn's content once "
                f"{roles} messages follow"
            )
        return text[at + len(_SENTINEL) :]

    def encode_fragment(self, text: str) -> list[int]:
        """Tokens of a text fragment, without the prefix the tokenizer adds to every text."""
        ids = list(self.tokenizer.encode(text))
        n = len(self._bos_prefix)
        if (
            n
            and ids[:n] == self._bos_prefix
            and not text.startswith(self.tokenizer.decode(ids[:n]))
        ):
            ids = ids[n:]
        return [int(i) for i in ids]

    def first_messages(self, observation: str) -> list[dict[str, str]]:
        """The conversation the first prompt renders: ``[system?, user: observation]``."""
        return [*self._head, {"role": "user", "content": observation}]

    def first_prompt(self, observation: str) -> list[int]:
        """Token ids of the first prompt (template + generation prompt, as ``PromptSource``)."""
        text = self.tokenizer.apply_chat_template(
            self.first_messages(observation), add_generation_prompt=True
        )
        return [int(i) for i in self.tokenizer.encode(text)]

    def message_delta_text(self, content: str, role: str = "user") -> str:
        """Text the template adds for a new message after an assistant turn, with the
        next generation prompt (starts with the closing of the assistant turn).

        Raises:
          ValueError: the template rejects the message (its ``raise_exception``: a role
            it does not know, say) or drops the assistant turn before it.
        """
        return self._delta([{"role": "user", "content": "U"}], content, role)

    def between_turns(self, content: str, *, role: str = "user", ended_with_eot: bool) -> list[int]:
        """Tokens to append after a sampled turn: closing glue, the message, the generation prompt.

        Args:
          content: the environment's observation (or tool output).
          role: its chat role ("user", "tool", ...).
          ended_with_eot: the sampled turn ended with ``eot_id`` (then that token, and
            any whitespace the template writes before it, is not added); False for a
            turn cut off at its token budget or ended by another stop id (the whole
            closing is added).

        Returns:
          token ids (never the policy's; their loss mask is 0).

        Raises:
          ValueError: as ``message_delta_text``.
        """
        return self._after_turn(self.message_delta_text(content, role), ended_with_eot)

    def between_turns_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        ended_with_eot: bool,
        **template_kwargs: Any,
    ) -> list[int]:
        """``between_turns`` for several new messages at once (tool results, then a user
        message), rendered together as the template groups them (Qwen puts consecutive
        tool results in one user turn).

        Args:
          messages: the new chat messages (OpenAI shape; the template reads them).
          ended_with_eot: as ``between_turns``.
          **template_kwargs: extra template variables (``tools``).

        Raises:
          ValueError: as ``between_turns``.
        """
        history = [{"role": "user", "content": "U"}]
        return self._after_turn(
            self._delta_of(history, messages, **template_kwargs), ended_with_eot
        )

    def _after_turn(self, text: str, ended_with_eot: bool) -> list[int]:
        """Tokens of a delta, less the end-of-turn text a turn ended with eot_id holds."""
        if ended_with_eot:  # the sampled end-of-turn token is already in the context
            if not text.startswith(self._eot_text):
                raise ValueError(
                    f"TurnRenderer: the chat template closes an assistant turn before the "
                    f"next message with {text[:40]!r}, not with {self._eot_text!r}"
                )
            text = text[len(self._eot_text) :]
        return self.encode_fragment(text)

    def turn_sampling(self, sampling: Any) -> Any:
        """The sampling parameters of the next turn (here the run's, unchanged; a
        session renderer narrows them to what its agent asked, ``envs.agent_turns``)."""
        return sampling

    def observe_turn(self, sample: Any) -> None:
        """Told every sampled turn before the environment steps (nothing to do here)."""

    def response_text(self, response_ids: Sequence[int]) -> str:
        """The text of one turn up to (not including) its first stop id: what the env parses."""
        ids = [int(i) for i in response_ids]
        cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.tokenizer.decode(ids[:cut])


def renderer_for(env: Any, default: TurnRenderer) -> Any:
    """The renderer of an episode played in ``env``: ``env.turn_renderer(default)`` when
    the environment renders its own turns (an agent session: its messages, tools and
    sampling come from the agent's requests), else ``default``."""
    own = getattr(env, "turn_renderer", None)
    return default if own is None else own(default)
