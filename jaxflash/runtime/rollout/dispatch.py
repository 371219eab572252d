"""Dispatching prompts' samples to generation servers and scoring them, without threads.

The per-sample work of queue scheduling (ROLL Flash, arXiv 2510.11345 §5.1): each
admitted prompt becomes G single-sample requests (prompt replication), each routed
on its own (``runtime.routing.RequestRouter``: best server, deadlines and retries,
dead servers); each finished sample is scored at once (no batch barrier) and filed
in the ``GroupBuffer``. A prompt the router cannot generate fails with the
router's ``FailureReason``; with no server left admission halts.

Servers and the reward pool report back through an ``Inbox`` (thread-safe); all
other state is touched only by whoever calls ``poll`` (the scheduler's pump
thread, or a simulator driving a ``VirtualClock``), under the scheduler's lock.
The environment manager (``runtime.rollout.episode_dispatch``) offers the same methods
for episodes, so the scheduler and ``BatchAssembler`` drive either.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from jaxflash import failpoints
from jaxflash.runtime.rollout.admission import admit_all
from jaxflash.runtime.rollout.routing import RequestRouter
from jaxflash.runtime.rollout.scoring import (
    Scorer,
    response_text,
    reward_item,
    scored_sample,
    unavailable,
)
from jaxflash.runtime.rollout.settings import (
    DispatchFactory,
    DispatchParts,
    DispatchWatch,
    InFlight,
    RolloutSettings,
)
from jaxflash.types import GenerationRequest, Prompt

log = logging.getLogger(__name__)


_MAX_SPANS = 100_000  # scoring spans kept for the timeline between two reads


def prompt_dispatch(scorer: Scorer | None, tokenizer: Any) -> DispatchFactory:
    """The task workload's ``DispatchFactory``: G single-sample requests per prompt,
    each scored by ``scorer`` as it comes back (``Dispatcher``).

    Raises:
      ValueError: no scorer.
    """
    if scorer is None:
        raise ValueError("RolloutScheduler needs a scorer (or episodes, scored by their env)")

    def build(parts: DispatchParts, settings: RolloutSettings) -> Dispatcher:
        return Dispatcher(parts, settings, scorer=scorer, tokenizer=tokenizer)

    return build


class Dispatcher:
    """Admits prompts, dispatches their samples, scores what comes back.

    Args:
      parts: the scheduler's pool, inbox, admission, ledger, buffer and clock.
      settings: G (requests per prompt), sampling and seed (the sampling RNG is
        keyed per sample), the starting policy version, the per-sample deadline and
        retries, truncation, and ``prompt_replication``: each of a prompt's G samples
        goes to the best server on its own (ROLL Flash §5.1.2); False keeps them
        together on the server chosen for the first (the baseline that generates a
        prompt's group as one request).
      scorer: ``submit((text, answer, item_id)) -> Future[Scored]``.
      tokenizer: ``response_text(ids)`` (the text up to the first stop id).

    Counts (``counts``): samples_scored, samples_late, and its router's samples_* /
    server_*.
    """

    def __init__(
        self, parts: DispatchParts, settings: RolloutSettings, *, scorer: Scorer, tokenizer: Any
    ) -> None:
        self.pool, self.inbox, self.admission = parts.pool, parts.inbox, parts.admission
        self.ledger, self.buffer, self.clock = parts.ledger, parts.buffer, parts.clock
        self.scorer, self.tokenizer, self.G = scorer, tokenizer, settings.group_size
        self.sampling, self.seed = settings.sampling, settings.seed
        self.truncation = settings.truncation
        self.prompt_replication = settings.prompt_replication
        self.counters: collections.Counter = collections.Counter()  # samples_scored, _late
        self.router = RequestRouter(
            self.pool,
            policy_version=settings.policy_version,
            sample_deadline_s=settings.sample_deadline_s,
            max_retries=settings.max_retries,
            clock=self.clock,
            on_failed=self.buffer.fail,
            on_halt=self._halt,
        )
        self.scoring: dict[tuple[int, int], Any] = {}  # key -> sample awaiting its reward
        # Reward scoring spans (submit, scored) in clock seconds, for the run's timeline.
        self._scoring_since: dict[tuple[int, int], float] = {}
        self.score_spans: list[tuple[float, float]] = []
        self.watch = DispatchWatch(self._stats, self._counts, self._take_score_spans)

    # ------------------------------------------------------------------ one step

    def poll(self) -> int:
        """Handle reports, server deaths and deadlines, then admit; returns events handled."""
        events = self.inbox.drain()
        for kind, sample, *rest in events:
            if kind == "generated":
                self._on_generated(sample)
            else:
                self._on_scored(sample, rest[0])
        if self.router.check():  # a restarted generation process: admit again
            self.admission.reopen()
        admit_all(self.admission, self.ledger, self.buffer, self.dispatch_prompt)
        return len(events)

    def idle(self) -> bool:
        """Nothing in flight or being scored, nothing to report, nothing admissible."""
        return (
            not self.router.table
            and not self.scoring
            and self.inbox.empty()
            and not self.admission.can_admit()
        )

    def dispatch_prompt(self, prompt: Prompt) -> None:
        """Send all G samples of ``prompt`` (stops at the first that fails)."""
        server = -1
        for i in range(self.G):
            server = self.router.dispatch(self._request(prompt, i), prefer=server)
            if server < 0:
                break
            if self.prompt_replication:
                server = -1

    # ------------------------------------------------------------------ for the batch side
    # (the servers' events -- versions, deaths, retirements -- go to ``router`` itself)

    def next_deadline(self) -> float | None:
        """Clock time at which the oldest outstanding sample misses its deadline."""
        return self.router.next_deadline()

    def in_flight(self) -> dict[int, InFlight]:
        """Prompts with at least one sample on a server: how many, and the start version
        their group will have (``OutstandingTable.start_estimate``)."""
        r = self.router
        return {p: InFlight(r.outstanding(p), r.start_estimate(p)) for p in r.in_flight()}

    def end_prompt(self, prompt_id: int, *, abort: bool = False, scoring: bool = False) -> None:
        """Drop a prompt's start record (trained, dropped or regenerated); with
        ``abort``, first abort its outstanding samples on every server holding one
        (counted); with ``scoring``, also its samples awaiting a reward (their scores
        come back late)."""
        if abort:
            self.router.abort_prompt(prompt_id)
        self.router.table.forget(prompt_id)
        if scoring:
            for key in [k for k in self.scoring if k[0] == prompt_id]:
                del self.scoring[key]
                self._scoring_since.pop(key, None)

    def _stats(self) -> dict[str, Any]:
        """Instantaneous queue state for metrics.jsonl."""
        return {"samples_outstanding": len(self.router.table), "samples_scoring": len(self.scoring)}

    def _counts(self) -> dict[str, int]:
        """What it and its router counted since it was built."""
        out = collections.Counter(self.router.counts())
        out.update(self.counters)
        return dict(out)

    def _request(self, prompt: Prompt, index: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_id=prompt.prompt_id,
            sample_index=index,
            prompt_tokens=prompt.prompt_tokens,
            sampling=self.sampling,
            seed=self.seed,
        )

    def _take_score_spans(self) -> list[tuple[float, float]]:
        """(submitted, scored) clock times of the rewards scored since the last call."""
        spans, self.score_spans = self.score_spans, []
        return spans

    def _halt(self) -> None:
        self.admission.halt()
        log.error("every generation server died: failing the prompts in flight")

    # ------------------------------------------------------------------ coming back

    def _on_generated(self, sample: Any) -> None:
        if self.router.received(sample) is None:
            return
        key = (int(sample.prompt_id), int(sample.sample_index))
        sample = dataclasses.replace(sample, response_text=response_text(sample, self.tokenizer))
        prompt = self.admission.prompt(key[0])
        if prompt is None:  # released meanwhile: nothing will take this sample
            self.counters["samples_late"] += 1
            return
        self.scoring[key] = sample
        self._scoring_since[key] = self.clock.now()
        try:
            future = self.scorer.submit(reward_item(sample, prompt.answer))
        except Exception as err:  # the pool is closed or broken: fail, never hang
            self._score(sample, unavailable(err))
            return
        future.add_done_callback(lambda f, s=sample: self.inbox.scored(s, f))

    def _on_scored(self, sample: Any, future: Any) -> None:
        try:
            scored = future.result()
        except Exception as err:
            scored = unavailable(err)
        self._score(sample, scored)

    def _score(self, sample: Any, scored: Any) -> None:
        key = (int(sample.prompt_id), int(sample.sample_index))
        if self.scoring.get(key) is not sample:
            self.counters["samples_late"] += 1  # its prompt was aborted meanwhile
            return
        del self.scoring[key]
        since = self._scoring_since.pop(key, None)
        if since is not None and len(self.score_spans) < _MAX_SPANS:
            self.score_spans.append((since, self.clock.now()))
        if not self.admission.is_active(key[0]) or key in self.router.table:
            self.counters["samples_late"] += 1  # prompt closed or resubmitted meanwhile
            return
        sample, failure = scored_sample(sample, scored, self.truncation)
        self.counters["samples_scored"] += 1
        self.buffer.add(sample, failure=failure)
        failpoints.reach("rollout_scored")
