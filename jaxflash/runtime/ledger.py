"""The prompt ledger: every prompt taken from the dataset ends in exactly one outcome.

Outcomes are ``types.PromptOutcome`` (trained, filtered, stale, failed), each with
a reason. ``check()`` asserts the books balance: taken == in flight + sum of
outcomes. The ledger is part of the checkpoint, so the counts survive a restart.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jaxflash.types import PromptOutcome

_FAILURE_CATEGORIES = (
    # (substring of the failure detail, reason counted in the ledger); first match wins
    ("malformed row", "malformed_row"),
    ("longer than max_prompt_tokens", "prompt_too_long"),
    ("exceeds max_prefill_length", "prompt_too_long"),
    ("max_target_length", "prompt_too_long"),
    ("reward error", "reward_error"),
    ("not back within", "generation_timeout"),
)


def failure_reason(detail: str) -> str:
    """The ledger reason for a failed prompt, from its human-readable detail.

    Reward errors become "reward_timeout" when the reward worker hit its deadline.
    Unknown details are counted as "other" (the detail itself is still printed).
    """
    for needle, reason in _FAILURE_CATEGORIES:
        if needle in detail:
            if reason == "reward_error" and "timeout" in detail:
                return "reward_timeout"
            return reason
    return "other"


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

    def close(self, prompt_id: int, outcome: PromptOutcome, reason: str) -> None:
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
