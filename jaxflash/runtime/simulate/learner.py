"""The simulated learner: a train phase then a weight-sync phase per step.

A step's train time comes from ``LearnerCost`` over the trained samples' true
prompt+response lengths, plus ``replay_ratio`` x as many replayed samples (the
hook for a replay cycle, ReFlow-style: they add learner time, not generation).
Time runs as work seconds scaled by a contention factor, like ``SimServer``.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxflash.runtime.clock import VirtualClock
from jaxflash.runtime.simulate.costs import CostModel
from jaxflash.runtime.simulate.timebase import WorkClock


@dataclasses.dataclass
class StepRecord:
    """One simulated learner step (clock seconds)."""

    version: int  # learner version the batch was taken at
    taken_at: float
    train_end: float = 0.0
    sync_end: float = 0.0
    trained: int = 0  # fresh samples that carried loss
    replayed: int = 0
    tokens: int = 0  # tokens the step computed (learner cost model)
    lengths: list[int] = dataclasses.field(default_factory=list)  # response tokens, fresh
    rewards: list[float] = dataclasses.field(default_factory=list)  # of the same samples
    staleness: list[int] = dataclasses.field(default_factory=list)
    gen_s: list[float] = dataclasses.field(default_factory=list)  # in-slot seconds, fresh
    groups: list[int] = dataclasses.field(default_factory=list)  # prompt ids trained


class SimLearner:
    """Busy with one step at a time: ``start`` -> train end -> sync end.

    Args:
      costs: the cost model (learner and sync parts).
      devices: devices the learner trains on.
      rows: padded batch rows per step (B x G, the ``num_sequences``).
      clock: the driver's clock.
      servers: generation servers the weights go to after each step.
      colocated: they sit on the learner's devices (``SyncCost.colocated_s``).
      replay_ratio: replayed samples per fresh sample trained (>= 0).

    Raises:
      ValueError: devices < 1 or replay_ratio < 0.
    """

    def __init__(
        self,
        costs: CostModel,
        *,
        devices: int,
        rows: int,
        clock: VirtualClock,
        servers: int = 1,
        colocated: bool = False,
        replay_ratio: float = 0.0,
    ) -> None:
        if devices < 1 or replay_ratio < 0:
            raise ValueError(
                f"SimLearner: devices >= 1 and replay_ratio >= 0, got {devices}, {replay_ratio}"
            )
        self.costs, self.devices, self.rows, self.clock = costs, devices, rows, clock
        self.sync_s = costs.sync.seconds(servers, colocated=colocated)
        self.replay_ratio = replay_ratio
        self._recent: collections.deque[int] = collections.deque(maxlen=4096)  # replay pool lengths
        self.step: StepRecord | None = None
        self.phase = "idle"  # idle | train | sync
        self._work, self._w_end = WorkClock(clock.now()), 0.0
        self.busy_intervals: list[tuple[float, float]] = []

    @property
    def idle(self) -> bool:
        return self.phase == "idle"

    def set_factor(self, factor: float) -> None:
        """From now on the current phase runs ``factor`` times slower (>= 1)."""
        self._work.set_factor(self.clock.now(), factor)

    def due(self) -> float | None:
        """Clock time the current phase ends (None when idle)."""
        if self.idle:
            return None
        return self._work.time(self._w_end)

    def start(self, record: StepRecord, prompt_lengths: list[int]) -> None:
        """Train on ``record``'s samples (``prompt_lengths`` matching ``record.lengths``)."""
        seqs = [p + r for p, r in zip(prompt_lengths, record.lengths, strict=True)]
        record.replayed = round(self.replay_ratio * len(seqs))
        pool = list(self._recent) or seqs
        seqs_all = seqs + [pool[i % len(pool)] for i in range(record.replayed)]
        rows = max(self.rows, len(seqs_all)) if self.replay_ratio else self.rows
        record.tokens = self.costs.learner.tokens(seqs_all, rows)
        self._recent.extend(seqs)
        work = self.costs.learner.step_time_s(seqs_all, rows, self.devices) if seqs else 0.0
        self.step, self.phase = record, "train"
        now = self.clock.now()
        self._work.restart(now)
        self._w_end = work
        self._began = now

    def advance(self) -> str | None:
        """Called at ``due()``: the phase that just ended ("train" | "sync"), else None."""
        due = self.due()
        if due is None or due > self.clock.now():
            return None
        now = self.clock.now()
        if self.phase == "train":
            self.step.train_end = now
            self.phase = "sync"
            self._work.restart(now)
            self._w_end = self.sync_s
            return "train"
        self.step.sync_end = now
        self.busy_intervals.append((self._began, now))
        self.phase = "idle"
        return "sync"
