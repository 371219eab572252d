"""One agent session's turns: prompts from the agent's messages, replies from sampled ids.

``SessionTurns`` is the renderer an agent session gives its ``envs.episode.Episode``
(``envs.chat.renderer_for``), so the episode's token bookkeeping stays the one of every
environment (sampled ids kept as sampled, loss mask 1 on them only):

* first prompt: the first request's messages (and tools) rendered by the chat template
  with the generation prompt (``ToolFormat.for_template``);
* a turn: the engine samples; ``reply`` builds the OpenAI response from the sampled ids
  (text up to the stop id, ``<tool_call>`` blocks parsed, behaviour logprobs);
* the next request: ``extend`` checks that its messages repeat the conversation so far
  and takes the new ones; the next prompt is the context (every earlier prompt and
  sampled id, exactly) + ``TurnRenderer.between_turns_messages`` of the new messages.

How an echo that differs from what was sampled is handled (``extend``):

* the echoed assistant message's text or tool calls differ from the reply: counted
  ``agent_echo_mismatch``; the recorded ids stay in the context (the model sees what it
  sampled, the agent's edit is dropped) -- the trajectory is still exactly on-policy;
* the text matches but the template's rendering of the echoed message tokenises
  differently from the sampled ids (BPE merges, a tool call's JSON re-serialised):
  counted ``agent_retokenized_differently``; the recorded ids stay. Re-rendering the
  history from text would have trained on ids the model never sampled;
* any other earlier message changed, removed, or the tools changed: ``RequestError``
  (``history_rewritten``); the session fails (an agent that edits its context is not
  one trajectory).

Temperature and top-p are the run's (the learner scores under the run's sampling
distribution): a request asking for others is served with the run's and counted
``agent_sampling_overridden``. ``stop`` strings cut the returned text; the recorded ids
are the whole sampled turn (the engine stops on ids). Not thread-safe: the episode's
driver and the session's environment calls take turns (the runtime orders them).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxflash.envs.agent_chat import (
    ChatRequest,
    RequestError,
    ToolFormat,
    same_assistant_message,
    same_message,
)
from jaxflash.envs.chat import TurnRenderer
from jaxflash.types import FinishReason, Sample, SamplingParams

TURN_COUNTERS = (
    "agent_echo_mismatch",
    "agent_retokenized_differently",
    "agent_tool_calls",
    "agent_tool_call_parse_errors",
    "agent_sampling_overridden",
)
"""What a session counts (summed over sessions into the step's ``agent`` metrics)."""


class SessionTurns:
    """The renderer and recorder of one agent session (see module).

    Args:
      base: the run's ``TurnRenderer`` (tokenizer, end-of-turn id, stop ids).
      tools: the tokenizer's ``ToolFormat``.
      session_id: names tool-call ids and the completion ids.
      model_name: the model name written in replies.

    Attributes:
      counters: ``TURN_COUNTERS``.
      num_turns: replies sent.
    """

    def __init__(self, base: TurnRenderer, tools: ToolFormat, *, session_id: str, model_name: str):
        self.base, self.tool_format = base, tools
        self.eot_id, self.stop_ids = base.eot_id, base.stop_ids
        self.session_id, self.model_name = session_id, model_name
        self.counters: collections.Counter = collections.Counter()
        self.num_turns = 0
        self._sent: list[dict[str, Any]] = []  # the conversation as the agent must echo it
        self._sampled: list[list[int] | None] = []  # per message: the sampled ids (assistant)
        self._tools: tuple[dict[str, Any], ...] | None = None
        self._new: list[dict[str, Any]] = []  # messages of the next delta
        self._request: ChatRequest | None = None
        self._sample: Sample | None = None

    # ------------------------------------------------------------------ requests in

    def begin(self, request: ChatRequest) -> str:
        """The session's first request; returns its last message (for the episode's log)."""
        self._request, self._tools = request, request.tools
        self._sent = [dict(m) for m in request.messages]
        self._sampled = [None] * len(self._sent)
        return str(self._sent[-1].get("content", ""))

    def extend(self, request: ChatRequest) -> str:
        """A later request: check its history, keep its new messages (module docstring).

        Returns:
          the new messages' text (for the episode's log).

        Raises:
          RequestError: the history or the tools were rewritten, or nothing is new.
        """
        got = request.messages
        if _tools_key(request.tools) != _tools_key(self._tools):
            raise _rewritten("tools differ from the session's first request", "tools")
        if len(got) <= len(self._sent):
            raise _rewritten(
                f"{len(got)} messages, but the session already holds {len(self._sent)}: "
                "send the whole conversation plus new messages",
                "messages",
            )
        for i, (sent, echoed) in enumerate(zip(self._sent, got, strict=False)):
            ids = self._sampled[i]
            if ids is None:
                if not same_message(sent, echoed):
                    raise _rewritten(f"messages[{i}] differs from the session's", f"messages[{i}]")
            elif echoed.get("role") != "assistant":
                raise _rewritten(f"messages[{i}] must be the assistant reply", f"messages[{i}]")
            elif not same_assistant_message(sent, echoed):
                self.counters["agent_echo_mismatch"] += 1
            elif self._round_trip(echoed)[: len(ids)] != ids:
                self.counters["agent_retokenized_differently"] += 1
        self._request = request
        self._new = [dict(m) for m in got[len(self._sent) :]]
        self._sent += self._new
        self._sampled += [None] * len(self._new)
        return "\n".join(str(m.get("content", "")) for m in self._new)

    def _round_trip(self, echoed: dict[str, Any]) -> list[int]:
        """The ids the template gives the echoed assistant message, as long as the sampled
        ones (what a re-render of the history would have put in the context)."""
        head = [{"role": "user", "content": "U"}]
        fmt, kw = self.tool_format, self.tool_format.template_kwargs(self._tools)
        tok = self.base.tokenizer
        before = tok.apply_chat_template(
            fmt.for_template(head, None), add_generation_prompt=True, **kw
        )
        full = tok.apply_chat_template(
            fmt.for_template([*head, echoed], None), add_generation_prompt=False, **kw
        )
        if not full.startswith(before):
            return []
        return self.base.encode_fragment(full[len(before) :])

    # ------------------------------------------------------------------ the episode's renderer

    def first_messages(self, observation: str) -> list[dict[str, str]]:
        """The first request's messages (the episode's log)."""
        del observation
        return [{"role": m["role"], "content": str(m.get("content", ""))} for m in self._sent]

    def first_prompt(self, observation: str) -> list[int]:
        """Ids of the first request rendered with the generation prompt."""
        del observation
        fmt = self.tool_format
        text = self.base.tokenizer.apply_chat_template(
            fmt.for_template(self._sent, self._tools),
            add_generation_prompt=True,
            **fmt.template_kwargs(self._tools),
        )
        return [int(i) for i in self.base.tokenizer.encode(text)]

    def between_turns(self, content: str, *, role: str = "user", ended_with_eot: bool) -> list[int]:
        """Ids after a sampled turn: closing glue, the new messages, the generation prompt."""
        del content, role
        fmt = self.tool_format
        return self.base.between_turns_messages(
            fmt.for_template(self._new, None),
            ended_with_eot=ended_with_eot,
            **fmt.template_kwargs(self._tools),
        )

    def turn_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The run's sampling, the budget narrowed to the request's ``max_tokens``."""
        req = self._request
        asked = (req.temperature, sampling.temperature), (req.top_p, sampling.top_p)
        if any(a is not None and a != run for a, run in asked):
            self.counters["agent_sampling_overridden"] += 1
        budget = min(sampling.max_new_tokens, req.max_tokens or sampling.max_new_tokens)
        return dataclasses.replace(sampling, max_new_tokens=budget)

    def observe_turn(self, sample: Sample) -> None:
        """Keep the sampled turn for ``reply``."""
        self._sample = sample

    def response_text(self, response_ids: Sequence[int]) -> str:
        """The turn's text up to its stop id."""
        return self.base.response_text(response_ids)

    # ------------------------------------------------------------------ replies out

    def reply(self, action_text: str) -> dict[str, Any]:
        """The OpenAI chat completion of the turn just sampled (and recorded).

        ``choices[0]`` carries ``token_ids`` (the sampled ids, stop id included) and,
        with ``logprobs=true``, each sampled token's behaviour logprob.
        """
        sample, req = self._sample, self._request
        ids = [int(t) for t in np.asarray(sample.response_tokens).reshape(-1)]
        logp = np.asarray(sample.behaviour_logprobs, np.float32).reshape(-1)
        text = action_text
        cut = [text.find(s) for s in req.stop if s in text]
        if cut:
            text = text[: min(cut)]
        content, calls, errors = self.tool_format.parse(
            text, f"call_{self.session_id}_{self.num_turns}"
        )
        self.counters["agent_tool_calls"] += len(calls)
        self.counters["agent_tool_call_parse_errors"] += errors
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = "stop"
        if calls:
            finish = "tool_calls"
        elif sample.finish_reason == FinishReason.LENGTH and not cut:
            finish = "length"
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": None,
            "token_ids": ids,
        }
        if req.logprobs:
            shown = [i for i, t in enumerate(ids) if t not in self.stop_ids]
            tok = self.base.tokenizer
            choice["logprobs"] = {
                "content": [
                    {
                        "token": tok.decode([ids[i]]),
                        "logprob": float(logp[i]),
                        "bytes": list(tok.decode([ids[i]]).encode()),
                        "top_logprobs": [],
                    }
                    for i in shown
                ]
            }
        self._sent.append(message)
        self._sampled.append(ids)
        self.num_turns += 1
        return {
            "id": f"chatcmpl-{self.session_id}-{self.num_turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": int(np.asarray(sample.prompt_tokens).size),
                "completion_tokens": len(ids),
                "total_tokens": int(np.asarray(sample.prompt_tokens).size) + len(ids),
            },
        }


def _tools_key(tools: Any) -> str:
    return json.dumps(tools, sort_keys=True)


def _rewritten(message: str, param: str) -> RequestError:
    return RequestError(
        f"session history rewritten: {message}", param=param, code="history_rewritten"
    )
