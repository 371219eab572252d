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

How the pieces are found (any Jinja chat template): render a reference conversation
``[system?, user "U", assistant SENTINEL]`` without the generation prompt; the text
after SENTINEL is the template's *closing* of an assistant turn (``"<|im_end|>\\n"``);
its first token must be a stop id (the end-of-turn token the policy samples). The
delta of a new message m is ``render(reference + [m], gen=True)`` minus the prefix
``render(reference, gen=False)``; a template for which that is not a prefix
(rendering earlier messages differently once a message follows) is refused with a
clear error rather than silently mis-rendered.

Tokenizers are duck-typed: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``apply_chat_template(messages, add_generation_prompt) -> str``, ``eos_id``, and
optionally ``stop_ids`` (every id that ends a response). Whatever ``encode("")``
returns (a BOS a tokenizer always adds) is stripped from fragments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

_SENTINEL = "JAXFLASH_ASSISTANT_SENTINEL_1f7c"


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
      eot_id: the template's end-of-turn token id (first token of the closing).
      stop_ids: frozenset of ids that end a turn.

    Raises:
      ValueError: the template drops the assistant's content, or its closing does not
        start with a stop id (generation would never stop where a turn ends).
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
        reference = [*self._head, {"role": "user", "content": "U"}]
        reference.append({"role": "assistant", "content": _SENTINEL})
        self._reference = reference
        self._reference_text = tokenizer.apply_chat_template(reference, add_generation_prompt=False)
        at = self._reference_text.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("TurnRenderer: the chat template does not render assistant content")
        closing = self._reference_text[at + len(_SENTINEL) :]
        closing_ids = self.encode_fragment(closing)
        if not closing_ids or closing_ids[0] not in self.stop_ids:
            raise ValueError(
                f"TurnRenderer: the template closes an assistant turn with {closing!r}, whose "
                f"first token {closing_ids[:1]} is not a stop id {sorted(self.stop_ids)}"
            )
        self.eot_id = closing_ids[0]
        eot_text = tokenizer.decode([self.eot_id])
        if not closing.startswith(eot_text):
            raise ValueError(
                f"TurnRenderer: closing {closing!r} does not start with the text of its "
                f"end-of-turn token {eot_text!r}"
            )
        self._closing = closing
        self._eot_text = eot_text

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
        next generation prompt (starts where the closing of the assistant turn starts).

        Raises:
          ValueError: the template is not append-only for this message (see module).
        """
        full = self.tokenizer.apply_chat_template(
            [*self._reference, {"role": role, "content": content}], add_generation_prompt=True
        )
        base = self._reference_text
        if not full.startswith(base):
            raise ValueError(
                f"TurnRenderer: rendering a {role!r} message after an assistant turn changes "
                "the text before it; this chat template cannot be extended turn by turn"
            )
        return self._closing + full[len(base) :]

    def between_turns(self, content: str, *, role: str = "user", ended_with_eot: bool) -> list[int]:
        """Tokens to append after a sampled turn: closing glue, the message, the generation prompt.

        Args:
          content: the environment's observation (or tool output).
          role: its chat role ("user", "tool", ...).
          ended_with_eot: the sampled turn ended with ``eot_id`` (then that token is
            already in the context and is not added again); False for a turn cut off
            at its token budget or ended by another stop id (the whole closing is added).

        Returns:
          token ids (never the policy's; their loss mask is 0).
        """
        text = self.message_delta_text(content, role)
        if ended_with_eot:  # the sampled end-of-turn token is already in the context
            text = text[len(self._eot_text) :]
        return self.encode_fragment(text)

    def response_text(self, response_ids: Sequence[int]) -> str:
        """The text of one turn up to (not including) its first stop id: what the env parses."""
        ids = [int(i) for i in response_ids]
        cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.tokenizer.decode(ids[:cut])
