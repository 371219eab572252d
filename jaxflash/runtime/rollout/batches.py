"""Assembling the learner's batch from the group buffer, and closing what is not trained.

``BatchAssembler.take(v)`` gathers complete groups whose staleness is <= α
(``GroupBuffer.take``, oldest first) for the step at learner version v, until B
or until nothing more can arrive. Every group that leaves untrained is resolved
here: closed in the ledger with its outcome and reason (a failure with its
``FailureReason``), or generated again (``stale_policy="regenerate"``); each
sample gets its rollouts.jsonl row either way.

Surplus aborted once a batch is full (ROLL Flash, arXiv 2510.11345 §5.1): every
in-flight prompt whose group would start below v + 1 − α -- stale at the next
step -- is aborted at once instead of finishing only to be dropped.

Thread-free: the scheduler serialises access.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.groups import DroppedGroup, Group
from jaxflash.runtime.rollout.admission import Admission
from jaxflash.runtime.rollout.dispatch import Dispatcher
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.records import rollout_row
from jaxflash.runtime.rollout.scoring import TruncationPolicy
from jaxflash.types import FailureReason, PromptOutcome

log = logging.getLogger(__name__)

ALL_TRUNCATED = "all_truncated"  # filter reason of a group with no sample carrying loss


@dataclasses.dataclass
class Batch:
    """What the learner gets for one step.

    Attributes:
      groups: complete fresh groups (at most B; taken oldest first), returned sorted
        by prompt_id: completion order depends on thread timing and float sums on
        order, so a canonical order makes a resumed run match bit for bit.
      dropped: groups that left the buffer untrained (closed in the ledger, or
        regenerated).
      rows: rollouts.jsonl rows of every sample in ``groups`` and ``dropped``.
      wait_s: seconds the learner waited in ``next_batch`` (0 from ``try_batch``).
    """

    groups: list[Group] = dataclasses.field(default_factory=list)
    dropped: list[DroppedGroup] = dataclasses.field(default_factory=list)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wait_s: float = 0.0


class BatchAssembler:
    """Turns the buffer's groups into batches of B and resolves every dropped group.

    Args:
      dispatcher: aborts and resubmits prompts; knows what is still in flight.
      admission: capacity of the prompts taken or dropped.
      buffer, ledger: the run's group buffer and prompt ledger.
      batch_prompts: B; async_ratio: α; stale_policy: "drop" | "regenerate".
      truncation: decides the rows' ``loss_masked``.
      refill_dropped: a dropped prompt's capacity returns at once (dynamic sampling).
      counters: the run's counters.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        admission: Admission,
        buffer: GroupBuffer,
        ledger: PromptLedger,
        *,
        batch_prompts: int,
        async_ratio: int,
        stale_policy: str,
        truncation: TruncationPolicy,
        refill_dropped: bool,
        counters: collections.Counter,
    ) -> None:
        self.dispatcher, self.admission, self.buffer, self.ledger = (
            dispatcher,
            admission,
            buffer,
            ledger,
        )
        self.B, self.alpha, self.stale_policy = batch_prompts, async_ratio, stale_policy
        self.truncation, self.refill_dropped, self.counters = truncation, refill_dropped, counters
        self.forming: Batch | None = None
        self.taken: list[int] = []  # prompts handed out since the last publish

    def take(self, learner_version: int) -> Batch | None:
        """The batch for the step at ``learner_version`` if complete, else None.

        Complete means B groups, or fewer when nothing more can arrive (nothing in
        flight or being scored and no capacity to admit: e.g. α = 0 with failed
        prompts, as in the synchronous loop). Partial progress is kept. Capacity
        freed here (dynamic-sampling refills, surplus drops) is used at once, so
        after a None only a server, reward or deadline event can make progress.

        Raises:
          RuntimeError: every generation server died and nothing is left to hand out.
        """
        v = learner_version
        f = self.forming = self.forming or Batch()
        got, gone = self.buffer.take(self.B - len(f.groups), v, self.alpha, self.stale_policy)
        f.groups += got
        for g in got:  # a group whose every sample is masked trains nothing: filtered
            kind = ("filtered", ALL_TRUNCATED) if self.truncation.masks_all(g.samples) else None
            f.rows += [self._row(s, *(kind or ("trained", "trained")), v) for s in g.samples]
        for d in gone:
            f.dropped.append(d)
            f.rows += self._resolve_dropped(d, v)
        self.taken += [g.prompt_id for g in got]
        if len(f.groups) == self.B:
            self._abort_surplus(f, v)
            self.dispatcher.admit()  # capacity freed by surplus drops: replacements start
        elif self.dispatcher.admit() or not self.dispatcher.idle() or self.buffer.num_complete():
            return None
        elif not f.groups and not f.dropped and self.admission.halted:
            raise RuntimeError("every generation server died: no prompt can be generated")
        self.forming = None
        f.groups.sort(key=lambda g: g.prompt_id)
        return f

    def _row(
        self, s: Any, outcome: str, reason: str, v: int, failure: FailureReason | None = None
    ) -> dict[str, Any]:
        return rollout_row(
            s,
            self.admission.prompt(int(s.prompt_id)),
            outcome=outcome,
            reason=reason,
            learner_version=v,
            truncation=self.truncation,
            failure=failure,
        )

    def _resolve_dropped(self, d: DroppedGroup, v: int) -> list[dict[str, Any]]:
        """Close a dropped group in the ledger, or resubmit it (regenerate); its rows."""
        regen = d.regenerate and self.admission.is_active(d.prompt_id)
        outcome = "regenerated" if regen else str(d.outcome)
        rows = [self._row(s, outcome, d.reason, v, d.failure) for s in d.samples]
        self.dispatcher.abort_prompt(d.prompt_id)  # e.g. siblings of a failed sample
        self.dispatcher.forget(d.prompt_id)
        self.counters[f"samples_dropped_{d.reason}"] += len(d.samples)
        if regen:
            self.counters["prompts_regenerated_stale"] += 1
            self.dispatcher.dispatch_prompt(self.admission.prompt(d.prompt_id))
            return rows
        failed = d.outcome == PromptOutcome.FAILED
        self.ledger.close(d.prompt_id, d.outcome, d.failure if failed else d.reason)
        if failed:
            log.warning("failed (%s): %s", d.failure, d.detail)
        if self.refill_dropped:  # dynamic sampling: a replacement may start now
            self.admission.free_for_refill(d.prompt_id)
        else:  # as the synchronous loop: the next prompts start at the next version
            self.admission.release_at_publish(d.prompt_id)
        return rows

    def _abort_surplus(self, f: Batch, v: int) -> None:
        """The batch is full: abort in-flight prompts that would be stale at step v + 1.

        A prompt is doomed when its group's start version estimate
        (``OutstandingTable.start_estimate``) is below v + 1 − α. "drop": aborted,
        its pending group discarded, closed STALE "surplus_stale"; its capacity
        returns now if a prompt started now would be fresh at the next step, else
        at the next release. "regenerate": its G requests are resubmitted (now, or
        at the next release).
        """
        oldest_fresh = v + 1 - self.alpha
        now_fresh = self.dispatcher.version >= oldest_fresh
        doomed = [
            pid
            for pid in self.dispatcher.in_flight()
            if self.admission.is_active(pid) and self.dispatcher.start_estimate(pid) < oldest_fresh
        ]
        regen = self.stale_policy == "regenerate"
        for pid in doomed:
            self.counters["samples_aborted_surplus"] += self.dispatcher.outstanding(pid)
            self.dispatcher.abort_prompt(pid)
            self.dispatcher.forget(pid, scoring=True)  # late scores are discarded
            d = self.buffer.discard(pid, PromptOutcome.STALE, "surplus_stale", regenerate=regen)
            if d is not None:
                self.counters["samples_dropped_surplus_stale"] += len(d.samples)
                f.dropped.append(d)
                outcome = "regenerated" if regen else "stale"
                f.rows += [self._row(s, outcome, d.reason, v) for s in d.samples]
            if regen:
                self.counters["prompts_regenerated_stale"] += 1
                if now_fresh:
                    self.dispatcher.dispatch_prompt(self.admission.prompt(pid))
                else:
                    self.admission.regenerate_at_release(pid)
                continue
            self.ledger.close(pid, PromptOutcome.STALE, "surplus_stale")
            if now_fresh:
                self.admission.free(pid)
            else:
                self.admission.release_at_publish(pid)

    def release(self) -> None:
        """New weights are published: the prompts handed out since return their capacity."""
        for pid in self.taken:
            self.admission.release_at_publish(pid)
            self.dispatcher.forget(pid)
        self.taken = []
