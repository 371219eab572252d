"""What a simulated server holds per request, shared prefills, and the Sample it returns.

``SimRequest``: a request queued, in a slot, or waiting for its environment
between turns, with the tokens made so far (in ``token_block`` units) and their
version stamps. ``SharedPrefill``: a prompt's fresh samples queued on one server
share one prefill while any of them still waits (``SlotBatcher``'s prefix
sharing). ``to_sample``: the finished request as the scheduler receives it.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxflash.runtime.simulate.workload import Turn
from jaxflash.types import FinishReason, GenerationRequest, RequestKey, Sample


@dataclasses.dataclass
class SimRequest:
    """A request queued, running or waiting for its environment."""

    request: GenerationRequest
    turns: list[Turn]
    round_id: int = 0  # its RoundBarrier round (no queue scheduling)
    turn: int = 0
    done: int = 0  # tokens (blocks) of the current turn generated so far
    start_version: int | None = None
    versions: list[np.ndarray] = dataclasses.field(default_factory=list)
    fill_step: int = 0  # step count at its last fill
    left: int = 0  # tokens (blocks) of the current turn still to make at its last fill
    heap_seq: int = -1  # identifies its live heap entry
    first_at_fill: int = 0  # tokens produced by the fill itself
    filled_at: float = 0.0  # clock time of its last fill
    in_slot_s: float = 0.0  # clock seconds spent in a slot so far

    @property
    def key(self) -> RequestKey:
        return (int(self.request.prompt_id), int(self.request.sample_index))

    @property
    def fresh(self) -> bool:
        """Nothing generated yet (not a recompute, not a later turn)."""
        return not (self.turn or self.done)


class SharedPrefill:
    """Which prompts' prefills a server shares, and how many fresh samples still need one."""

    def __init__(self) -> None:
        self._queued: collections.Counter = collections.Counter()  # prompt -> fresh queued
        self._have: set[int] = set()  # prompts prefilled under the current weights

    def queued(self, prompt_id: int) -> None:
        """A fresh sample of the prompt joined the queue."""
        self._queued[prompt_id] += 1

    def left_queue(self, prompt_id: int, *, filled: bool) -> bool:
        """A fresh sample left the queue (``filled`` into a slot, or aborted).

        Returns:
          True if a filled sample needs a new prefill (none is shared yet).
        """
        charge = filled and prompt_id not in self._have
        if charge:
            self._have.add(prompt_id)
        self._queued[prompt_id] -= 1
        if not self._queued[prompt_id]:  # no sibling waits for it any more
            del self._queued[prompt_id]
            self._have.discard(prompt_id)
        return charge

    def invalidate(self) -> None:
        """New weights: a prefill is valid only under the weights it ran with."""
        self._have.clear()


def to_sample(item: SimRequest, prompt_tokens: int) -> Sample:
    """The finished request as a Sample (placeholder tokens, real version stamps)."""
    key = item.key
    versions = np.concatenate(item.versions) if item.versions else np.zeros(0, np.int32)
    total = sum(t.response_tokens for t in item.turns)
    truncated = total >= item.request.sampling.max_new_tokens
    return Sample(
        prompt_id=key[0],
        sample_index=key[1],
        prompt_tokens=np.zeros(prompt_tokens, np.int32),
        response_tokens=np.zeros(len(versions), np.int32),
        behaviour_logprobs=np.zeros(len(versions), np.float32),
        token_versions=versions,
        start_version=int(item.start_version),
        finish_reason=FinishReason.LENGTH if truncated else FinishReason.EOS,
    )
