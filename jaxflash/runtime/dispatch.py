"""Dispatching samples to generation servers and getting them back, without threads.

The per-sample work of queue scheduling (ROLL Flash, arXiv 2510.11345 §5.1): each
admitted prompt becomes G single-sample requests (prompt replication), each sent
to the best server (``ServerPool.choose``); each finished sample is scored at once
(no batch barrier) and filed in the ``GroupBuffer``. No silent hang
(rl_pitfalls "No silent hang"): a sample not back within ``sample_deadline_s`` is
aborted on its server and retried elsewhere, after ``max_retries`` its prompt
fails (GENERATION_TIMEOUT); a server that raises is marked dead and its samples
rerouted; with no server left every unfinished prompt fails (SERVER_DIED) and
admission halts.

Servers and the reward pool report back through an ``Inbox`` (thread-safe); all
other state is touched only by whoever calls ``poll`` (the scheduler's pump
thread, or a simulator driving a ``VirtualClock``), under the scheduler's lock.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from jaxflash.data.prompts import PromptFailure
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.staleness import start_version_of
from jaxflash.replay.versions import PolicyClock
from jaxflash.runtime.admission import Admission
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.inbox import Inbox
from jaxflash.runtime.ledger import PromptLedger
from jaxflash.runtime.outstanding import Outstanding, OutstandingTable
from jaxflash.runtime.scoring import (
    Scorer,
    TruncationPolicy,
    apply_score,
    response_text,
    reward_item,
    unavailable,
)
from jaxflash.runtime.server_pool import ServerPool, Submitted
from jaxflash.types import FailureReason, FinishReason, GenerationRequest, Prompt, SamplingParams

log = logging.getLogger(__name__)


class Dispatcher:
    """Admits prompts, dispatches their samples, scores what comes back.

    Args:
      pool: the generation servers.
      inbox: the servers' and reward futures' report queue.
      admission: capacity over the prompt source.
      ledger: every prompt taken enters it here.
      buffer: scored samples (or failures) go here.
      scorer: ``submit((text, answer, item_id)) -> Future[Scored]``.
      tokenizer: ``response_text(ids)`` (the text up to the first stop id).
      group_size: G requests per prompt.
      sampling, seed: of every request (the sampling RNG is keyed per sample).
      policy_version: the version the servers hold at the start.
      sample_deadline_s, max_retries: per-sample deadline and retries after it.
      truncation: what a truncated response gets.
      counters: the run's counters (restored from a checkpoint; they keep adding up).
      clock: time of dispatch and deadlines.
      prompt_replication: each of a prompt's G samples goes to the best server on
        its own (ROLL Flash §5.1.2); False keeps them together on the server
        chosen for the first (the baseline that generates a prompt's group as one
        request).
    """

    def __init__(
        self,
        pool: ServerPool,
        inbox: Inbox,
        admission: Admission,
        ledger: PromptLedger,
        buffer: GroupBuffer,
        scorer: Scorer,
        *,
        tokenizer: Any,
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        policy_version: int,
        sample_deadline_s: float,
        max_retries: int,
        truncation: TruncationPolicy,
        counters: collections.Counter,
        clock: Clock,
        prompt_replication: bool = True,
    ) -> None:
        self.pool, self.inbox, self.admission = pool, inbox, admission
        self.ledger, self.buffer, self.scorer = ledger, buffer, scorer
        self.tokenizer, self.G = tokenizer, group_size
        self.sampling, self.seed = sampling, seed
        self.policy = PolicyClock(policy_version)
        self.deadline_s, self.max_retries = sample_deadline_s, max_retries
        self.truncation, self.counters, self.clock = truncation, counters, clock
        self.prompt_replication = prompt_replication
        self.table = OutstandingTable()
        self.scoring: dict[tuple[int, int], Any] = {}  # key -> sample awaiting its reward
        self.first_request_at: float | None = None

    # ------------------------------------------------------------------ one step

    def poll(self) -> int:
        """Handle reports, server deaths and deadlines, then admit; returns events handled."""
        events = self.inbox.drain()
        for kind, sample, *rest in events:
            if kind == "generated":
                self._on_generated(sample)
            else:
                self._on_scored(sample, rest[0])
        for i in self.pool.check():
            self.server_died(i)
        self._check_deadlines()
        self.admit()
        return len(events)

    def idle(self) -> bool:
        """Nothing in flight or being scored, nothing to report, nothing admissible."""
        return (
            not self.table
            and not self.scoring
            and self.inbox.empty()
            and not self.admission.can_admit()
        )

    def admit(self) -> int:
        """Admit prompts while capacity allows (each becomes G requests); how many."""
        n = 0
        while (nxt := self.admission.next()) is not None:
            n += 1
            item, from_source = nxt
            if from_source:
                self.ledger.take(item.prompt_id)
            if isinstance(item, PromptFailure):
                self.buffer.fail(item.prompt_id, item.failure, item.reason)
                continue
            self.dispatch_prompt(item)
        return n

    def dispatch_prompt(self, prompt: Prompt) -> None:
        """Send all G samples of ``prompt`` (stops at the first that fails)."""
        server = -1
        for i in range(self.G):
            server = self.dispatch(self._request(prompt, i), prefer=server)
            if server < 0:
                break
            if self.prompt_replication:
                server = -1

    # ------------------------------------------------------------------ dispatch

    def dispatch(
        self, request: GenerationRequest, attempts: int = 0, avoid: int = -1, prefer: int = -1
    ) -> int:
        """Send one sample to ``prefer`` if alive, else the best server.

        Returns:
          The server it went to, or -1 if its prompt failed instead.
        """
        while True:
            if prefer >= 0 and prefer != avoid and prefer not in self.pool.dead:
                i, prefer = prefer, -1
            else:
                i = self.pool.choose(self.table.load(), self.policy.version, avoid)
            if i < 0:
                self._no_server_left(request.prompt_id)
                return -1
            held = self.pool.version(i)
            result = self.pool.submit(i, request)
            if result.status is Submitted.OK:
                now = self.clock.now()
                if self.first_request_at is None:
                    self.first_request_at = now
                self.table.add(
                    Outstanding(
                        request=request,
                        server=i,
                        dispatched_at=now,
                        version=held,
                        attempts=attempts,
                    )
                )
                return i
            if result.status is Submitted.REJECTED:
                self.counters["samples_failed"] += 1
                pid = request.prompt_id
                detail = f"prompt {pid} sample {request.sample_index}: {result.error}"
                self.buffer.fail(pid, FailureReason.REQUEST_REJECTED, detail)
                self.abort_prompt(pid)
                return -1
            self.server_died(i)  # it died taking the request: try another

    def abort_prompt(self, prompt_id: int) -> None:
        """Abort a prompt's outstanding samples on every server holding one (counted)."""
        entries = self.table.by_prompt(prompt_id)
        for e in entries:
            self.table.pop(e.key)
            self.counters["samples_aborted"] += 1
        for i in sorted({e.server for e in entries}):
            if self.pool.abort(i, prompt_id) is Submitted.DIED:
                self.server_died(i)

    # ------------------------------------------------------------------ for the batch side

    @property
    def version(self) -> int:
        """The published policy version the servers were handed last."""
        return self.policy.version

    def publish(self, version: int) -> None:
        """The learner published ``version`` (ValueError unless it increases)."""
        self.policy.publish(int(version))

    @property
    def num_outstanding(self) -> int:
        return len(self.table)

    @property
    def num_scoring(self) -> int:
        return len(self.scoring)

    def next_deadline(self) -> float | None:
        """Clock time at which the oldest outstanding sample misses its deadline."""
        return self.table.next_deadline(self.deadline_s)

    def in_flight(self) -> list[int]:
        """Prompts with at least one sample on a server, sorted."""
        return self.table.prompts()

    def outstanding(self, prompt_id: int) -> int:
        """Samples of ``prompt_id`` on a server."""
        return len(self.table.by_prompt(prompt_id))

    def start_estimate(self, prompt_id: int) -> float:
        """The start version the prompt's group will have (``OutstandingTable``)."""
        return self.table.start_estimate(prompt_id, self.pool.restarts)

    def forget(self, prompt_id: int, *, scoring: bool = False) -> None:
        """Drop a prompt's start record (trained, dropped or regenerated); with
        ``scoring``, also its samples awaiting a reward (their scores come back late)."""
        self.table.forget(prompt_id)
        if scoring:
            for key in [k for k in self.scoring if k[0] == prompt_id]:
                del self.scoring[key]

    def _request(self, prompt: Prompt, index: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_id=prompt.prompt_id,
            sample_index=index,
            prompt_tokens=prompt.prompt_tokens,
            sampling=self.sampling,
            seed=self.seed,
        )

    # ------------------------------------------------------------------ coming back

    def _on_generated(self, sample: Any) -> None:
        key = (int(sample.prompt_id), int(sample.sample_index))
        entry = self.table.get(key)
        if entry is None or sample.finish_reason == FinishReason.ABORTED:
            self.counters["samples_late"] += 1  # aborted or retried meanwhile
            return
        self.table.pop(key)
        self.pool.suspect.discard(entry.server)
        self.counters["samples_generated"] += 1
        self.table.note_finished(key[0], start_version_of(sample))
        sample.response_text = response_text(sample, self.tokenizer)
        prompt = self.admission.prompt(key[0])
        if prompt is None:  # released meanwhile: nothing will take this sample
            self.counters["samples_late"] += 1
            return
        self.scoring[key] = sample
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
        if not self.admission.is_active(key[0]) or key in self.table:
            self.counters["samples_late"] += 1  # prompt closed or resubmitted meanwhile
            return
        failure = apply_score(sample, scored, self.truncation)
        self.counters["samples_scored"] += 1
        self.buffer.add(sample, failure=failure)

    # ------------------------------------------------------------------ faults

    def _check_deadlines(self) -> None:
        for key in self.table.late(self.clock.now(), self.deadline_s):
            entry = self.table.get(key)
            if entry is None:
                continue  # resubmitted as a sibling of an earlier late one
            pid, server = key[0], entry.server
            self.counters["samples_timed_out"] += 1
            self.pool.suspect.add(server)
            on_server = [e for e in self.table.by_prompt(pid) if e.server == server]
            if self.pool.abort(server, pid) is Submitted.DIED:
                self.server_died(server)  # everything it held went elsewhere
                continue
            for e in on_server:
                self.table.pop(e.key)
            if entry.attempts >= self.max_retries:
                self.counters["samples_failed"] += 1
                detail = (
                    f"sample {key[1]} not back within {self.deadline_s:g}s after "
                    f"{entry.attempts + 1} tries"
                )
                self.buffer.fail(pid, FailureReason.GENERATION_TIMEOUT, detail)
                self.abort_prompt(pid)
                continue
            self.counters["samples_retried"] += 1
            for e in on_server:  # the server dropped all of them: send them elsewhere
                tries = e.attempts + 1 if e.key == key else e.attempts
                self.dispatch(e.request, attempts=tries, avoid=server)

    def server_died(self, i: int) -> None:
        """Server i was found dead (the pool reports each death once): reroute its samples."""
        self.counters["server_failures"] += 1
        for e in self.table.by_server(i):
            self.table.pop(e.key)
            self.counters["samples_rerouted"] += 1
            self.dispatch(e.request, e.attempts, avoid=i)

    def _no_server_left(self, prompt_id: int) -> None:
        """Every server died: fail the prompts with samples in flight, admit no more.

        Prompts whose every sample is back (scored or being scored) still complete.
        """
        if not self.admission.halted:
            self.admission.halted = True
            log.error("every generation server died: failing the prompts in flight")
        for pid in sorted({prompt_id, *self.table.prompts()}):
            for e in self.table.by_prompt(pid):
                self.table.pop(e.key)
            self.buffer.fail(pid, FailureReason.SERVER_DIED, "no generation server left")
