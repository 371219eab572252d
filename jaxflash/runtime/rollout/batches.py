"""Assembling the learner's batch from the group buffer, and closing what is not trained.

``BatchAssembler.take(v)`` gathers complete groups whose staleness is <= α
(``GroupBuffer.take``, oldest first) for the step at learner version v, until B
or until nothing more can arrive. Every group that leaves untrained is resolved
here: closed in the ledger with its outcome and reason (a failure with its
``FailureReason``), or generated again (``stale_policy="regenerate"``); each
sample gets its rollouts.jsonl row either way, and a failed group's samples that
never arrived get one too (what the failure cut short, or an empty row), so every
failed prompt has rows: the distinct prompt ids of "failed" rows are the ledger's
failed prompts.

With ``stale_policy="pace"`` nothing is dropped for staleness: a ``Pacer``
(``rollout.pacing``) decides which complete groups join the batch
(earliest deadline first; the batch waits for a due group still being
generated), a group that still exceeds α is trained and counted
(``samples_trained_overshoot``), and no surplus is aborted.

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
from jaxflash.runtime.rollout.admission import Admission, admit_all
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.pacing import Pacer
from jaxflash.runtime.rollout.rows import missing_row, rollout_row
from jaxflash.runtime.rollout.settings import Dispatch, RolloutSettings
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
      settings: B (``batch_prompts``), α (``async_ratio``), ``stale_policy``,
        ``truncation`` (decides the rows' ``loss_masked``) and ``refill_dropped`` (a
        dropped prompt's capacity returns at once: dynamic sampling). B and α move
        with ``reconfigure``.
      pacer: the ``Pacer`` of ``stale_policy="pace"`` (None otherwise).

    Counts (``counts``): samples_dropped_<reason>, samples_aborted_surplus,
    prompts_regenerated_stale, samples_trained_overshoot.
    """

    def __init__(
        self,
        dispatcher: Dispatch,
        admission: Admission,
        buffer: GroupBuffer,
        ledger: PromptLedger,
        settings: RolloutSettings,
        pacer: Pacer | None = None,
    ) -> None:
        self.pacer = pacer
        self.dispatcher, self.admission, self.buffer, self.ledger = (
            dispatcher,
            admission,
            buffer,
            ledger,
        )
        self.B, self.alpha = settings.batch_prompts, settings.async_ratio
        self.stale_policy, self.truncation = settings.stale_policy, settings.truncation
        self.refill_dropped = settings.refill_dropped
        self.counters: collections.Counter = collections.Counter()
        # The batch being assembled (kept across ``take`` calls until it is complete).
        self._forming = False
        self._groups: list[Group] = []
        self._dropped: list[DroppedGroup] = []
        self._rows: list[dict[str, Any]] = []
        self.taken: list[int] = []  # prompts handed out since the last publish
        self._warned_rows: set[str] = set()  # malformed rows already warned of

    @property
    def assembling(self) -> bool:
        """A batch is partly assembled (not a step boundary)."""
        return self._forming

    @property
    def groups_so_far(self) -> int:
        """Groups of the batch being assembled."""
        return len(self._groups)

    def reconfigure(self, *, batch_prompts: int, async_ratio: int) -> None:
        """Step boundary: the next batch takes B groups with staleness <= α.

        Raises:
          RuntimeError: a batch is being assembled.
        """
        if self._forming:
            raise RuntimeError("reconfigure between batches only (a batch is being assembled)")
        self.B, self.alpha = batch_prompts, async_ratio

    def counts(self) -> dict[str, int]:
        """What it counted since it was built."""
        return dict(self.counters)

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
        self._forming = True
        if self.pacer is not None:
            self.pacer.begin(v)
        while self._take_some(v) and self.pacer is not None and len(self._groups) < self.B:
            pass  # a group taken may let one held before it in start order join now
        if len(self._groups) == self.B:
            if self.pacer is None:
                self._abort_surplus(v)  # paced: nothing in flight is doomed
            self._admit()  # capacity freed by surplus drops: replacements start
        elif self._admit() or not self.dispatcher.idle() or self.buffer.num_complete():
            return None
        elif not self._groups and not self._dropped and self.admission.halted:
            raise RuntimeError("every generation server died: no prompt can be generated")
        batch = Batch(
            groups=sorted(self._groups, key=lambda g: g.prompt_id),
            dropped=self._dropped,
            rows=self._rows,
        )
        self._forming, self._groups, self._dropped, self._rows = False, [], [], []
        if self.pacer is not None:
            self.pacer.batch_done(v)
        return batch

    def _take_some(self, v: int) -> int:
        """One ``GroupBuffer.take`` into the forming batch; the groups it added."""
        accept = self.pacer.accept if self.pacer is not None else None
        got, gone = self.buffer.take(
            self.B - len(self._groups), v, self.alpha, self.stale_policy, accept=accept
        )
        self._groups += got
        for g in got:  # a group whose every sample is masked trains nothing: filtered
            kind = ("filtered", ALL_TRUNCATED) if self.truncation.masks_all(g.samples) else None
            self._rows += [self._row(s, *(kind or ("trained", "trained")), v) for s in g.samples]
            if v - g.start_version > self.alpha:  # only under "pace": trained, counted
                self.counters["samples_trained_overshoot"] += len(g.samples)
        for d in gone:
            self._dropped.append(d)
            self._rows += self._resolve_dropped(d, v)
        self.taken += [g.prompt_id for g in got]
        return len(got)

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
        if self.pacer is not None:
            self.pacer.closed(d.prompt_id)  # needs no batch slot (or a new deadline)
        regen = d.regenerate and self.admission.is_active(d.prompt_id)
        outcome = "regenerated" if regen else str(d.outcome)
        rows = [self._row(s, outcome, d.reason, v, d.failure) for s in d.samples]
        if d.outcome == PromptOutcome.FAILED:
            rows += self._unfinished_rows(d, v)
        self.dispatcher.end_prompt(d.prompt_id, abort=True)  # e.g. siblings of a failed sample
        self.counters[f"samples_dropped_{d.reason}"] += len(d.samples)
        if regen:
            self.counters["prompts_regenerated_stale"] += 1
            self.dispatcher.dispatch_prompt(self.admission.prompt(d.prompt_id))
            return rows
        failed = d.outcome == PromptOutcome.FAILED
        self.ledger.close(d.prompt_id, d.outcome, d.failure if failed else d.reason)
        if failed:
            self._warn_failed(d)
        if self.refill_dropped:  # dynamic sampling: a replacement may start now
            self.admission.free_for_refill(d.prompt_id)
        else:  # as the synchronous loop: the next prompts start at the next version
            self.admission.release_at_publish(d.prompt_id)
        return rows

    def _unfinished_rows(self, d: DroppedGroup, v: int) -> list[dict[str, Any]]:
        """Rows of a failed group's samples that never arrived, so every failed prompt
        has rows: what the failure cut short (``d.unfinished``: an agentic group's
        episodes, with their tokens so far), then an empty row (``missing_row``) for
        each other sample index below G."""
        rows = [self._row(s, "failed", d.reason, v, d.failure) for s in d.unfinished]
        have = {int(s.sample_index) for s in (*d.samples, *d.unfinished)}
        prompt, missing = self.admission.prompt(d.prompt_id), set(range(self.buffer.group_size))
        for i in sorted(missing - have):
            rows.append(
                missing_row(
                    d.prompt_id, i, prompt, learner_version=v, failure=d.failure, reason=d.reason
                )
            )
        return rows

    def _warn_failed(self, d: DroppedGroup) -> None:
        """Warns of a failed prompt; a malformed row once per row, not every epoch.

        A file is read in epochs with fresh prompt ids, so its malformed rows fail again
        each epoch: the ledger counts every failure (``prompt_outcomes``), the log says
        each row once. The row is the detail after "prompt <id>: " (its file and line).
        """
        if d.failure == FailureReason.MALFORMED_ROW:
            row = d.detail.partition(": ")[2]
            if row in self._warned_rows:
                log.debug("failed (%s) again: %s", d.failure, d.detail)
                return
            self._warned_rows.add(row)
            log.warning(
                "failed (%s): %s (warned once per row; it fails again each epoch, counted "
                "every time under prompt_outcomes)", d.failure, d.detail,
            )  # fmt: skip
            return
        log.warning("failed (%s): %s", d.failure, d.detail)

    def _abort_surplus(self, v: int) -> None:
        """The batch is full: abort in-flight prompts that would be stale at step v + 1.

        A prompt is doomed when its group's start version estimate
        (``OutstandingTable.start_estimate``) is below v + 1 − α. "drop": aborted,
        its pending group discarded, closed STALE "surplus_stale"; its capacity
        returns now if a prompt started now would be fresh at the next step, else
        at the next release. "regenerate": its G requests are resubmitted (now, or
        at the next release).
        """
        oldest_fresh = v + 1 - self.alpha
        now_fresh = self.dispatcher.router.version >= oldest_fresh
        flying = self.dispatcher.in_flight()
        doomed = [
            pid
            for pid, f in flying.items()
            if self.admission.is_active(pid) and f.start_version < oldest_fresh
        ]
        regen = self.stale_policy == "regenerate"
        for pid in doomed:
            self.counters["samples_aborted_surplus"] += flying[pid].running
            self.dispatcher.end_prompt(pid, abort=True, scoring=True)  # late scores discarded
            d = self.buffer.discard(pid, PromptOutcome.STALE, "surplus_stale", regenerate=regen)
            if d is not None:
                self.counters["samples_dropped_surplus_stale"] += len(d.samples)
                self._dropped.append(d)
                outcome = "regenerated" if regen else "stale"
                self._rows += [self._row(s, outcome, d.reason, v) for s in d.samples]
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

    def _admit(self) -> int:
        """Admit prompts while capacity allows, played by the dispatcher; how many."""
        return admit_all(self.admission, self.ledger, self.buffer, self.dispatcher.dispatch_prompt)

    def release(self) -> None:
        """New weights are published: the prompts handed out since return their capacity."""
        for pid in self.taken:
            self.admission.release_at_publish(pid)
            self.dispatcher.end_prompt(pid)
        self.taken = []
