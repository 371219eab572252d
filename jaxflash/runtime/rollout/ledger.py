"""The prompt ledger: every prompt taken from the dataset ends in exactly one outcome.

Outcomes are ``types.PromptOutcome`` (trained, filtered, stale, failed), each with
a reason; a failed prompt's reason is the ``types.FailureReason`` set where the
failure happened (carried, never recovered from message text). ``check()``
asserts the books balance: taken == in flight + sum of outcomes. The ledger is
part of the checkpoint, so the counts survive a restart.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxflash.types import FailureReason, PromptOutcome


class LedgerError(RuntimeError):
    """A prompt was closed twice, or closed without being taken."""


@dataclasses.dataclass
class PromptLedger:
    """Counts prompts by outcome and reason.

    Attributes:
      taken: prompts taken from the dataset so far.
      outcomes: outcome -> reason -> count.
      open_ids: prompt ids taken but not yet closed (in flight).
    """

    taken: int = 0
    outcomes: dict[str, dict[str, int]] = dataclasses.field(
        default_factory=lambda: {o.value: {} for o in PromptOutcome}
    )
    open_ids: set[int] = dataclasses.field(default_factory=set)

    def take(self, prompt_id: int) -> None:
        if prompt_id in self.open_ids:
            raise LedgerError(f"prompt {prompt_id} taken twice while still in flight")
        self.open_ids.add(prompt_id)
        self.taken += 1

    def close(self, prompt_id: int, outcome: PromptOutcome, reason: str | FailureReason) -> None:
        """Close an open prompt with its outcome and reason.

        Raises:
          TypeError: a FAILED prompt whose reason is not a FailureReason.
          LedgerError: the prompt is not open.
        """
        if PromptOutcome(outcome) == PromptOutcome.FAILED and not isinstance(reason, FailureReason):
            raise TypeError(
                f"prompt {prompt_id} closed as failed with reason {reason!r}: a failure "
                "reason must be a FailureReason"
            )
        reason = str(reason)
        if prompt_id not in self.open_ids:
            raise LedgerError(f"prompt {prompt_id} closed as {outcome} but it is not in flight")
        self.open_ids.remove(prompt_id)
        by_reason = self.outcomes[PromptOutcome(outcome).value]
        by_reason[reason] = by_reason.get(reason, 0) + 1

    def count(self, outcome: PromptOutcome) -> int:
        return sum(self.outcomes[PromptOutcome(outcome).value].values())

    def check(self) -> None:
        """Raises LedgerError unless taken == in flight + trained + filtered + stale + failed."""
        closed = sum(self.count(o) for o in PromptOutcome)
        if self.taken != closed + len(self.open_ids):
            raise LedgerError(
                f"ledger does not add up: taken={self.taken} closed={closed} "
                f"in_flight={len(self.open_ids)}"
            )

    def metrics(self) -> dict[str, int]:
        """Flat counters for metrics.jsonl: prompts_taken, prompts_<outcome>, ..."""
        out = {"prompts_taken": self.taken, "prompts_in_flight": len(self.open_ids)}
        for o in PromptOutcome:
            out[f"prompts_{o.value}"] = self.count(o)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "taken": self.taken,
            "outcomes": {k: dict(v) for k, v in self.outcomes.items()},
            "open_ids": sorted(self.open_ids),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PromptLedger:
        outcomes = collections.defaultdict(dict, {k: dict(v) for k, v in state["outcomes"].items()})
        for o in PromptOutcome:
            outcomes.setdefault(o.value, {})
        return cls(taken=state["taken"], outcomes=dict(outcomes), open_ids=set(state["open_ids"]))

    @classmethod
    def restore(cls, extra: Mapping[str, Any]) -> PromptLedger:
        """The run's ledger from a checkpoint's metadata ``extra`` (its ``"ledger"``,
        written from ``RolloutScheduler.snapshot``); a fresh one when there is none."""
        state = extra.get("ledger")
        return cls() if state is None else cls.from_state_dict(state)
