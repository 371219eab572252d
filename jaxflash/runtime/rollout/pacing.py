"""Staleness without discards: ``stale_policy="pace"`` (earliest-deadline-first batches).

Dropping a group older than α versions starves the slow rollouts -- the long, hard
ones -- and biases training toward short answers (tinker-cookbook #822; slime #1781,
#1800). ``Pacer`` holds the bound α by construction instead, so no group is ever
discarded for staleness:

* every admitted prompt gets a deadline: the learner version at which it must be
  trained, d = (version the servers hold when it is admitted) + α. A sample's
  start version (its first token's) is never older than that, so a group trained
  by its deadline has staleness <= α;
* the learner trains earliest deadline first, *waiting* for a due group still
  being generated: a complete group is taken into the batch for version v only if
  every group left open still fits the batches up to its own deadline,

      for every d >= v:  #{open groups with deadline <= d}  <=  R + (d - v)·B

  (R = slots left in batch v, B per later batch; the EDF feasibility condition of
  unit jobs, Liu & Layland 1973). A group due at v is always taken, and the
  batch is complete only when every group due at v is in it;
* a prompt is admitted only while that condition still holds with it added
  (``admits``). With the (α+1)·B capacity of ``Admission`` this is implied for
  plain runs; it binds with dynamic-sampling refills and after a ``reconfigure``.

Where the bound can still be exceeded -- α lowered by ``reconfigure`` below what is
in flight, or a server that stamps a first token older than the version it was
handed the prompt at -- the group is trained anyway and the overshoot is counted
(``GroupBuffer`` ``staleness_overshoot``, ``samples_trained_overshoot``), never
dropped. The price is paid in waiting: the learner waits for due stragglers and,
while it does, capacity is not released, so generation slots can sit idle (the
simulator measures it: ``SimResult.admission_idle``; the runtime: ``rollout.stalls``).

Thread-free: the scheduler serialises access.
"""

from __future__ import annotations

import collections
from typing import Any


class Pacer:
    """Deadlines of the open (admitted, not yet taken or closed) prompts.

    Args:
      batch_prompts: B groups per learner step (>= 1).
      async_ratio: α >= 0.
      version: the policy version the servers hold at the start.

    Raises:
      ValueError: B < 1 or α < 0.
    """

    def __init__(self, *, batch_prompts: int, async_ratio: int, version: int) -> None:
        self._check(batch_prompts, async_ratio)
        self.B, self.alpha = batch_prompts, async_ratio
        self.version = int(version)  # what the servers hold (the last publish)
        self.batch_version = int(version)  # the learner version of the next/forming batch
        self.taken = 0  # groups in the forming batch
        self._forming = False
        self._deadline: dict[int, int] = {}  # open prompt -> learner version it is due at
        self._count: collections.Counter = collections.Counter()  # deadline -> open prompts

    @classmethod
    def of(cls, settings: Any) -> Pacer | None:
        """The pacer of ``RolloutSettings`` with ``stale_policy="pace"``, else None."""
        if settings.stale_policy != "pace":
            return None
        return cls(
            batch_prompts=settings.batch_prompts,
            async_ratio=settings.async_ratio,
            version=settings.policy_version,
        )

    @staticmethod
    def _check(batch_prompts: int, async_ratio: int) -> None:
        if batch_prompts < 1 or async_ratio < 0:
            raise ValueError(
                f"Pacer needs batch_prompts >= 1 and async_ratio >= 0, got "
                f"{batch_prompts}, {async_ratio}"
            )

    # -- the owner's events -----------------------------------------------------------

    def published(self, version: int) -> None:
        """The servers hold ``version`` now: later admissions are due α after it."""
        self.version = int(version)

    def reconfigure(self, *, batch_prompts: int, async_ratio: int) -> None:
        """A step boundary's new B and α. Open prompts keep their deadlines (a lower α
        can leave some overdue: they are taken first and their overshoot counted).

        Raises:
          ValueError: B < 1 or α < 0.
        """
        self._check(batch_prompts, async_ratio)
        self.B, self.alpha = batch_prompts, async_ratio

    def admitted(self, prompt_id: int) -> None:
        """``prompt_id`` was admitted now: due at version + α (kept if already open: a
        resumed or retried prompt keeps the deadline it was admitted with)."""
        if prompt_id not in self._deadline:
            d = self.version + self.alpha
            self._deadline[prompt_id] = d
            self._count[d] += 1

    def closed(self, prompt_id: int) -> None:
        """``prompt_id`` left untrained (filtered, failed): it needs no batch slot."""
        d = self._deadline.pop(prompt_id, None)
        if d is not None:
            self._count[d] -= 1
            if not self._count[d]:
                del self._count[d]

    def begin(self, learner_version: int) -> None:
        """A batch for ``learner_version`` is being assembled."""
        if not self._forming:
            self._forming = True
            self.batch_version, self.taken = max(self.batch_version, int(learner_version)), 0

    def batch_done(self, learner_version: int) -> None:
        """The batch for ``learner_version`` was handed out: the next is for the one after."""
        self._forming = False
        self.batch_version, self.taken = int(learner_version) + 1, 0

    # -- the decisions ----------------------------------------------------------------

    def _slots(self, d: int) -> int:
        """Batch slots from the forming (or next) batch through the one at version d."""
        left = self.B - self.taken
        return left + (d - self.batch_version) * self.B

    def _open_by_deadline(self) -> list[tuple[int, int]]:
        """(deadline, open prompts due by then), deadlines clamped to the next batch
        (an overdue prompt is due now), cumulative, ascending."""
        out, cum = [], 0
        for d in sorted(self._count):
            cum += self._count[d]
            d = max(d, self.batch_version)
            if out and out[-1][0] == d:
                out[-1] = (d, cum)
            else:
                out.append((d, cum))
        return out

    def admits(self) -> bool:
        """One more prompt, due at version + α, keeps every open prompt within its deadline."""
        new = max(self.version + self.alpha, self.batch_version)
        below = 0
        for d, cum in self._open_by_deadline():
            if d < new:
                below = cum
                continue
            if cum + 1 > self._slots(d):
                return False
        return below + 1 <= self._slots(new)

    def accept(self, prompt_id: int, start_version: int) -> bool:
        """Take the complete group of ``prompt_id`` into the forming batch now?

        True (and it is no longer open) when it is due (or overdue), or when every
        other open prompt due before it still fits the slots left; False: it waits,
        its slot kept for a due group still being generated. A prompt the pacer never
        saw admitted is due at ``start_version`` + α.
        """
        if self.taken >= self.B:
            return False
        due = max(self._deadline.get(prompt_id, start_version + self.alpha), self.batch_version)
        if due > self.batch_version:
            for d, cum in self._open_by_deadline():  # its own deadline is >= due
                if d >= due:
                    break
                if cum > self._slots(d) - 1:
                    return False
        self.closed(prompt_id)
        self.taken += 1
        return True

    def open_prompts(self) -> int:
        """Prompts admitted and neither taken into a batch nor closed."""
        return len(self._deadline)
