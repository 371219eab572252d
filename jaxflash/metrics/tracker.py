"""One record per learner step, and the cadences that act on it.

The parts of a run report their metrics where they arise -- the rollout scheduler its
counters and the servers' generation, the workload its batch, the learner its update,
the control room its plan -- each as a named section of the step's record
(``StepTracker.report``). The record (``take``) merges the sections in the fixed
order of ``SECTIONS``, whatever order they arrived in, so metrics.jsonl's rows keep
one layout (docs/METRICS.md). What a run does with a record on a cadence (evaluate,
write the row and its console line, check it, checkpoint) is a ``Hook`` with
``every=``, as levanter's trainer hooks and big_vision's periodic actions.

    tracker = StepTracker()
    tracker.report("learner", {"loss": 0.3})   # where the update ran
    tracker.report("batch", {"reward_mean": 0.5})
    record = tracker.take()                    # {"reward_mean": 0.5, "loss": 0.3}
    run_hooks(hooks, StepInfo(step=1, record=record, last=False))

Host-side, thread-free: the loop's thread reports and takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

SECTIONS = (
    "batch",  # the step's groups: counts, rewards, accuracy, lengths
    "episodes",  # an agentic workload's episodes (none for a task's samples)
    "learner",  # the update's metrics, or why the step was skipped
    "staleness",  # of the samples that carried loss
    "replay",  # the replay cycle's mix
    "generation",  # the servers' gen* metrics over the step
    "time",  # the step's times, rates and weight sync
    "version",  # policy_version after the step
    "rollout",  # the scheduler's counters and queues, the ledger's prompts_*
    "outcomes",  # prompt_outcomes
    "control",  # the step controller's ctl_* decision
    "elastic",  # the elastic pool's moves
)
"""A step record's sections, in the order its row lists them (a later section's name
wins a clash, as in one dict written in this order)."""


class StepTracker:
    """Collects one step's metrics by section; ``take`` gives the record and starts anew."""

    def __init__(self) -> None:
        self._sections: dict[str, Mapping[str, Any]] = {}

    def report(self, section: str, metrics: Mapping[str, Any] | None = None, **named: Any) -> None:
        """Put ``metrics`` (and the ``named`` values after them) as this step's ``section``
        (one report per section and step).

        Raises:
          ValueError: ``section`` is not one of ``SECTIONS``, or was reported already
            this step.
        """
        if section not in SECTIONS:
            raise ValueError(f"unknown metrics section {section!r}; sections: {SECTIONS}")
        if section in self._sections:
            raise ValueError(f"metrics section {section!r} reported twice in one step")
        self._sections[section] = {**(metrics or {}), **named} if named else (metrics or {})

    def take(self) -> dict[str, Any]:
        """The step's record: every reported section merged in ``SECTIONS`` order (a new
        dict; values are kept as reported, not copied). The next report starts a step."""
        record: dict[str, Any] = {}
        for section in SECTIONS:
            record.update(self._sections.get(section, {}))
        self._sections = {}
        return record


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step.

    Attributes:
      step: the policy version after the step (0: before training).
      record: the step's record; a hook may add to it (the evaluation does).
      last: the run ends after this step (a hook may set it: a preemption found).
      first_update: the step's update was the first (mostly compiling it).
    """

    step: int
    record: dict[str, Any]
    last: bool = False
    first_update: bool = False


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(info)`` every ``every`` steps, and at the last step whatever the cadence."""

    fn: Callable[[StepInfo], Any]
    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"Hook.every must be >= 1, got {self.every}")

    def due(self, info: StepInfo) -> bool:
        """Whether the hook runs after ``info``'s step."""
        return info.step % self.every == 0 or info.last


def run_hooks(hooks: Sequence[Hook], info: StepInfo) -> StepInfo:
    """Run each due hook in order (each sees what the earlier ones did); returns ``info``."""
    for hook in hooks:
        if hook.due(info):
            hook.fn(info)
    return info
