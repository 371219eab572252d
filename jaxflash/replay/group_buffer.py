"""Collects finished, scored samples into GRPO groups and hands out fresh batches.

A group is the G samples of one prompt. `GroupBuffer.take` returns complete, fresh
groups oldest-first (by start version, then prompt_id) and never more than asked:
what does not fit stays for the next call ("Nothing dropped at the batch edge",
tests/replay/test_group_buffer.py). Every group leaves through `take` (or `drain`, `discard`),
either returned or in the `dropped` list with an outcome and a reason, so at any time

    produced == returned + dropped + pending                       (see `counts`)

Dropped reasons: "stale" (staleness > async_ratio, or negative -- that one is also
counted as an anomaly), "failed" (a sample carried an error or a non-finite reward,
or `fail` was called; the group carries the `FailureReason` given where it
happened), the filter reasons "zero_variance", "mean_below_min", "mean_above_max",
"std_below_min", "drained" (`drain`, at shutdown), and whatever
reason the caller gives `discard` (e.g. "surplus_stale": a prompt aborted in flight).
With policy="regenerate", stale groups are still reported in `dropped` (reason
"stale", `regenerate=True`): the caller resubmits the prompt instead of closing it,
and the regenerated samples (start version = the new version) form a new group,
counted as produced again. With policy="pace" no group is dropped for staleness:
the caller paces admission and batches so none exceeds α
(``runtime.rollout.pacing``), and a group that still does is returned and counted
(``staleness_overshoot``); its ``accept`` hook may keep a complete group for a later
call (its batch slot is held for a group that is due sooner).

Stale and failed groups are removed eagerly on every `take`, also beyond the batch
edge; the filters run only on groups about to be returned (they are deterministic,
so when they run does not change which groups pass).

Holds a lock so a rollout thread may `add` while the learner thread calls `take`;
it starts no threads itself.

References: ROLL Flash, arXiv 2510.11345 (per-sample async ratio; drop or regenerate);
DAPO, arXiv 2503.14476 (dynamic sampling: drop groups whose rewards are all equal).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from jaxflash.replay.buffer_books import BufferBooks
from jaxflash.replay.groups import DroppedGroup, Group, GroupFilter
from jaxflash.replay.staleness import StalenessCounts, Verdict, classify, start_version_of
from jaxflash.types import FailureReason, FinishReason, PolicyVersion, PromptOutcome, Sample

StalePolicy = Literal["drop", "regenerate", "pace"]
STALE_POLICIES = ("drop", "regenerate", "pace")


@dataclasses.dataclass
class _Pending:
    samples: dict[int, Sample] = dataclasses.field(default_factory=dict)
    failure: tuple[FailureReason, str] | None = None  # the first failure and its detail
    unfinished: tuple[Sample, ...] = ()  # what that failure cut short (``fail``)


class GroupBuffer:
    """Groups samples by prompt_id; `take` hands out complete fresh groups.

    Args:
      group_size: G >= 1, samples per prompt.
      group_filter: optional GroupFilter applied to groups about to be returned.
      state: a previous buffer's ``state_dict()`` (a checkpoint's): its counters go
        on from there, as the scheduler's prompts_* / samples_* do.
    """

    def __init__(
        self,
        group_size: int,
        *,
        group_filter: GroupFilter | None = None,
        state: Mapping[str, int] | None = None,
    ) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        self.group_size = group_size
        self.group_filter = group_filter
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        # Prompts whose group was complete or failed when last touched: what `take`
        # looks at (entries no longer pending are pruned there), so a take costs the
        # ready groups, not every pending one.
        self._ready: dict[int, None] = {}
        self._closed_failed: set[int] = set()  # failed or discarded: late samples dropped
        self._last_learner_version: int | None = None
        self._books = BufferBooks.from_state(state) if state else BufferBooks()

    def state_dict(self) -> dict[str, int]:
        """The cumulative counters, for a checkpoint (``GroupBuffer(..., state=...)``;
        ``BufferBooks.state_dict``: groups pending now are left out of ``produced``)."""
        with self._lock:
            return self._books.state_dict(pending=len(self._pending))

    # -- adding ---------------------------------------------------------------

    def add(self, sample: Sample, *, failure: FailureReason | None = None) -> None:
        """Add one finished, scored sample.

        A sample with a ``failure``, or whose `reward_info["error"]` is set
        (REWARD_ERROR unless ``failure`` says otherwise), or whose reward is not
        finite (NON_FINITE_REWARD), marks its group failed with that reason
        (reported by the next `take`). A sample of a prompt already reported as
        failed is discarded and counted (`samples_late_discarded`).

        Raises:
          TypeError: not a Sample.
          ValueError: sample_index outside [0, G); a duplicate (prompt_id,
            sample_index); an ABORTED sample without error (restart it instead);
            a sample with no reward and no error (score it first).
        """
        if not isinstance(sample, Sample):
            raise TypeError(f"GroupBuffer.add takes a jaxflash.types.Sample, got {type(sample)}")
        pid, idx = int(sample.prompt_id), int(sample.sample_index)
        if not 0 <= idx < self.group_size:
            raise ValueError(
                f"sample_index {idx} of prompt {pid} is outside [0, group_size={self.group_size})"
            )
        error = sample.reward_info.get("error") if sample.reward_info else None
        if error and failure is None:
            failure = FailureReason.REWARD_ERROR
        if failure is not None and not error:
            error = str(failure)
        if not error:
            if sample.finish_reason == FinishReason.ABORTED:
                raise ValueError(
                    f"sample {pid}/{idx} is ABORTED: restart or fail it, do not add it"
                )
            if sample.reward is None:
                raise ValueError(f"sample {pid}/{idx} has no reward: score it before adding")
            if not math.isfinite(float(sample.reward)):
                error = f"non-finite reward {sample.reward}"
                failure = FailureReason.NON_FINITE_REWARD
        with self._lock:
            if pid in self._closed_failed:
                self._books.late_discarded += 1
                return
            pend = self._get_or_create(pid)
            if idx in pend.samples:
                raise ValueError(f"duplicate sample {pid}/{idx} added to GroupBuffer")
            pend.samples[idx] = sample
            if failure is not None and pend.failure is None:
                pend.failure = (failure, f"prompt {pid} sample {idx}: {error}")
            if pend.failure is not None or len(pend.samples) == self.group_size:
                self._ready[pid] = None

    def fail(
        self,
        prompt_id: int,
        failure: FailureReason,
        detail: str,
        *,
        unfinished: Sequence[Sample] = (),
    ) -> None:
        """Mark a prompt's group failed (e.g. generation error or timeout, no Sample).

        The group is reported by the next `take` with reason "failed", ``failure``
        and ``detail``, and ``unfinished`` (``DroppedGroup.unfinished``). Calling it
        for a prompt already reported failed is counted as a late discard and
        otherwise ignored; calling it again before that keeps the first failure.

        Args:
          prompt_id, failure, detail: the prompt, why it failed, the detail for people.
          unfinished: samples the failure cut short (an episode's tokens so far,
            unscored): reported, never counted as produced or added.

        Raises:
          TypeError: ``failure`` is not a FailureReason; ValueError: empty detail.
        """
        if not isinstance(failure, FailureReason):
            raise TypeError(f"fail({prompt_id}): failure must be a FailureReason, got {failure!r}")
        if not detail:
            raise ValueError(f"fail({prompt_id}) needs a non-empty detail")
        pid = int(prompt_id)
        with self._lock:
            if pid in self._closed_failed:
                self._books.late_discarded += 1
                return
            pend = self._get_or_create(pid)
            if pend.failure is None:
                prefix = f"prompt {pid}"
                text = detail if detail.startswith(prefix) else f"{prefix}: {detail}"
                pend.failure = (failure, text)
                pend.unfinished = tuple(unfinished)
            self._ready[pid] = None

    def _get_or_create(self, pid: int) -> _Pending:
        pend = self._pending.get(pid)
        if pend is None:
            pend = self._pending[pid] = _Pending()
            self._books.produced += 1
        return pend

    # -- taking ---------------------------------------------------------------

    def take(
        self,
        batch_groups: int,
        learner_version: PolicyVersion,
        async_ratio: int,
        policy: StalePolicy = "drop",
        accept: Callable[[int, int], bool] | None = None,
    ) -> tuple[list[Group], list[DroppedGroup]]:
        """Up to `batch_groups` complete fresh groups, oldest first, plus what was dropped.

        Args:
          batch_groups: the most groups to return (>= 1).
          learner_version: version of the learner step that will train on them;
            must not decrease between calls.
          async_ratio: alpha >= 0; a group is fresh iff 0 <= learner_version -
            start_version <= alpha.
          policy: "drop" (stale groups are closed as STALE), "regenerate"
            (reported with regenerate=True for resubmission) or "pace" (returned
            like fresh ones and counted ``staleness_overshoot``: nothing is dropped
            for staleness).
          accept: ``(prompt_id, start_version) -> bool``, asked for each complete
            group that passed the filters, in order, before it is returned: False
            keeps it pending for a later call (``runtime.rollout.pacing.Pacer``).

        Returns:
          (groups, dropped): groups sorted by (start_version, prompt_id), at most
          batch_groups of them; dropped: failed, stale and filtered groups removed
          by this call, each with outcome and reason. Complete fresh groups beyond
          the batch edge stay in the buffer.

        Raises:
          ValueError: bad arguments, or learner_version lower than a previous call's.
        """
        if isinstance(batch_groups, bool) or not isinstance(batch_groups, int):
            raise TypeError(f"batch_groups must be an int, got {batch_groups!r}")
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        for name, v in (("learner_version", learner_version), ("async_ratio", async_ratio)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if policy not in STALE_POLICIES:
            raise ValueError(f"policy must be one of {STALE_POLICIES}, got {policy!r}")
        with self._lock:
            if self._last_learner_version is not None and (
                learner_version < self._last_learner_version
            ):
                raise ValueError(
                    f"learner versions only go up: take at version {learner_version} "
                    f"after version {self._last_learner_version}"
                )
            dropped: list[DroppedGroup] = []
            self._ready = {p: None for p in self._ready if p in self._pending}
            for pid in sorted(p for p in self._ready if self._pending[p].failure is not None):
                pend = self._pending.pop(pid)
                self._closed_failed.add(pid)
                failure, detail = pend.failure
                dropped.append(
                    self._drop(pid, pend, PromptOutcome.FAILED, "failed", detail, failure=failure)
                )

            complete = [
                (min(start_version_of(s) for s in g.samples.values()), pid)
                for pid, g in ((p, self._pending.get(p)) for p in self._ready)
                if g is not None and len(g.samples) == self.group_size
            ]
            groups: list[Group] = []
            for start, pid in sorted(complete):
                verdict = classify(start, learner_version, async_ratio)
                overshoot = policy == "pace" and verdict is Verdict.STALE
                if verdict is not Verdict.FRESH and not overshoot:
                    self._books.judge(verdict)
                    what = "anomaly: newer than the learner" if verdict is Verdict.ANOMALY else ""
                    detail = (
                        f"start version {start}, learner version {learner_version}, "
                        f"staleness {learner_version - start} > async_ratio {async_ratio}"
                        if not what
                        else f"{what}: start version {start} > learner version {learner_version}"
                    )
                    dropped.append(
                        self._drop(
                            pid,
                            self._pending.pop(pid),
                            PromptOutcome.STALE,
                            "stale",
                            detail,
                            regenerate=policy == "regenerate",
                        )
                    )
                    continue
                if len(groups) == batch_groups:
                    continue  # fresh but past the batch edge: keep for the next call
                pend = self._pending[pid]
                group = Group(
                    prompt_id=pid,
                    start_version=start,
                    samples=tuple(pend.samples[i] for i in range(self.group_size)),
                )
                reason = self.group_filter.reason(group.rewards_g) if self.group_filter else None
                if reason is None and accept is not None and not accept(pid, int(start)):
                    continue  # held: the caller keeps its slot for a group due sooner
                del self._pending[pid]
                if overshoot:
                    self._books.overshoot += 1
                else:
                    self._books.judge(Verdict.FRESH)
                if reason is not None:
                    detail = f"rewards {group.rewards_g.tolist()}"
                    dropped.append(self._drop(pid, pend, PromptOutcome.FILTERED, reason, detail))
                    continue
                groups.append(group)
            self._books.returned += len(groups)
            self._last_learner_version = int(learner_version)
            return groups, dropped

    def drain(self, reason: str = "drained") -> list[DroppedGroup]:
        """Remove every pending group (complete or not) as FAILED (SHUTDOWN) with `reason`."""
        with self._lock:
            out = [
                self._drop(
                    pid,
                    self._pending.pop(pid),
                    PromptOutcome.FAILED,
                    reason,
                    reason,
                    failure=FailureReason.SHUTDOWN,
                )
                for pid in sorted(self._pending)
            ]
            return out

    def discard(
        self,
        prompt_id: int,
        outcome: PromptOutcome,
        reason: str,
        *,
        regenerate: bool = False,
    ) -> DroppedGroup | None:
        """Remove one prompt's pending group now (e.g. a surplus prompt aborted in flight).

        The group (complete or not) is counted as dropped with `reason`, so
        produced == returned + dropped + pending still holds. Unless `regenerate`,
        the prompt is closed: samples of it added later are discarded and counted
        (`samples_late_discarded`). With `regenerate=True` the caller resubmits it
        and its new samples form a new group (counted as produced again).

        Args:
          prompt_id: the prompt.
          outcome: PromptOutcome for the ledger (e.g. STALE).
          reason: non-empty short reason (e.g. "surplus_stale").
          regenerate: the prompt will be resubmitted (do not close it).

        Returns:
          The DroppedGroup (samples that had arrived, maybe none), or None when no
          group was pending (nothing produced, nothing dropped).

        Raises:
          ValueError: empty reason, or outcome FAILED (a failure goes through
            `fail`, which carries its FailureReason).
        """
        if not reason:
            raise ValueError(f"discard({prompt_id}) needs a non-empty reason")
        if PromptOutcome(outcome) == PromptOutcome.FAILED:
            raise ValueError(f"discard({prompt_id}): a failed prompt goes through fail()")
        pid = int(prompt_id)
        with self._lock:
            if not regenerate:
                self._closed_failed.add(pid)  # closed: late samples are discarded
            pend = self._pending.pop(pid, None)
            if pend is None:
                return None
            return self._drop(pid, pend, outcome, reason, reason, regenerate=regenerate)

    def _drop(
        self,
        pid: int,
        pend: _Pending,
        outcome: PromptOutcome,
        reason: str,
        detail: str | None,
        *,
        regenerate: bool = False,
        failure: FailureReason | None = None,
    ) -> DroppedGroup:
        self._books.drop(reason)
        return DroppedGroup(
            prompt_id=pid,
            outcome=outcome,
            reason=reason,
            detail=detail or reason,
            samples=tuple(pend.samples[i] for i in sorted(pend.samples)),
            regenerate=regenerate,
            failure=failure,
            unfinished=pend.unfinished,
        )

    # -- introspection --------------------------------------------------------

    @property
    def staleness_counts(self) -> StalenessCounts:
        """Fresh / stale / anomaly verdicts of groups that left the buffer."""
        with self._lock:
            return self._books.staleness

    def num_complete(self) -> int:
        """Complete groups waiting (fresh or not yet judged)."""
        with self._lock:
            groups = (self._pending.get(p) for p in self._ready)
            return sum(g is not None and len(g.samples) == self.group_size for g in groups)

    def counts(self) -> dict[str, int]:
        """Counters; produced == returned + dropped + pending always holds.

        Keys: produced, returned, dropped, pending, dropped_<reason> for each reason
        seen, samples_late_discarded, staleness_fresh/_stale/_anomaly/_overshoot
        (overshoot: groups returned older than α under policy "pace").
        """
        with self._lock:
            return self._books.counts(pending=len(self._pending))
