"""Routing single-sample requests to generation servers: choose, submit, deadlines, deaths.

The generation half of queue scheduling (ROLL Flash, arXiv 2510.11345 §5.1), shared
by the two things that send requests: the prompt dispatcher (RLVR: a prompt's G
samples, ``runtime.rollout.dispatch``) and the environment manager (agentic: one request
per episode turn, ``runtime.rollout.episode_dispatch``). Each request goes to the best
server (``ServerPool.choose``: healthy, up to date, least loaded); no silent hang
(rl_pitfalls "No silent hang"): a request not back within ``sample_deadline_s`` is
aborted on its server and retried elsewhere, after ``max_retries`` its prompt
fails (GENERATION_TIMEOUT); a server that raises is marked dead and its requests
rerouted; with no server left every prompt in flight fails (SERVER_DIED).

A failure is reported to the owner through ``on_failed(prompt_id, reason,
detail)`` (the owner fails the prompt's group and stops whatever else runs for
it); ``on_halt()`` says no server is left (the owner admits nothing more).
Thread-free: whoever owns it serialises access.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from jaxflash.replay.staleness import start_version_of
from jaxflash.replay.versions import PolicyClock
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.rollout.outstanding import Outstanding, OutstandingTable
from jaxflash.runtime.rollout.server_pool import ServerPool, Submitted
from jaxflash.types import FailureReason, FinishReason, GenerationRequest

OnFailed = Callable[[int, FailureReason, str], None]
"""(prompt_id, reason, detail): the prompt cannot be generated."""


class RequestRouter:
    """Outstanding requests over a pool of generation servers.

    Args:
      pool: the generation servers.
      policy_version: the version the servers hold at the start.
      sample_deadline_s: a request not back by then (queue time on the server
        included) is aborted and retried on another server.
      max_retries: retries of a late request before its prompt fails.
      clock: time of dispatch and deadlines.
      on_failed: called once per prompt that fails here (REQUEST_REJECTED,
        GENERATION_TIMEOUT, SERVER_DIED); its outstanding requests are gone by then.
      on_halt: called once when the last server died.
    """

    def __init__(
        self,
        pool: ServerPool,
        *,
        policy_version: int,
        sample_deadline_s: float,
        max_retries: int,
        clock: Clock,
        on_failed: OnFailed,
        on_halt: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.policy = PolicyClock(policy_version)
        self.deadline_s, self.max_retries = sample_deadline_s, max_retries
        self.clock = clock
        self.counters: collections.Counter = collections.Counter()  # samples_*, server_*
        self.on_failed, self.on_halt = on_failed, on_halt
        self.table = OutstandingTable()
        self.first_request_at: float | None = None
        self.halted = False

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int:
        """The published policy version the servers were handed last."""
        return self.policy.version

    def publish(self, version: int) -> None:
        """The learner published ``version`` (ValueError unless it increases)."""
        self.policy.publish(int(version))

    # ------------------------------------------------------------------ sending

    def dispatch(
        self, request: GenerationRequest, attempts: int = 0, avoid: int = -1, prefer: int = -1
    ) -> int:
        """Send one request to ``prefer`` if alive, else the best server.

        Returns:
          The server it went to, or -1 if its prompt failed instead (reported
          through ``on_failed``).
        """
        while True:
            usable = prefer not in self.pool.dead and prefer not in self.pool.retired
            if prefer >= 0 and prefer != avoid and usable:
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
                self.abort_prompt(pid)
                detail = f"prompt {pid} sample {request.sample_index}: {result.error}"
                self.on_failed(pid, FailureReason.REQUEST_REJECTED, detail)
                return -1
            self.server_died(i)  # it died taking the request: try another

    def abort_prompt(self, prompt_id: int) -> int:
        """Abort a prompt's outstanding requests on every server holding one (counted
        ``samples_aborted``); returns how many."""
        entries = self.table.by_prompt(prompt_id)
        for e in entries:
            self.table.pop(e.key)
            self.counters["samples_aborted"] += 1
        for i in sorted({e.server for e in entries}):
            if self.pool.abort(i, prompt_id) is Submitted.DIED:
                self.server_died(i)
        return len(entries)

    # ------------------------------------------------------------------ coming back

    def received(self, sample: Any) -> Outstanding | None:
        """A server finished ``sample``: its table row, or None when it is late (aborted or
        retried meanwhile; counted ``samples_late``). Counts ``samples_generated`` and
        notes the sample's start version for ``start_estimate``."""
        key = (int(sample.prompt_id), int(sample.sample_index))
        entry = self.table.get(key)
        if entry is None or sample.finish_reason == FinishReason.ABORTED:
            self.counters["samples_late"] += 1
            return None
        self.table.pop(key)
        self.pool.suspect.discard(entry.server)
        self.counters["samples_generated"] += 1
        self.table.note_finished(key[0], start_version_of(sample))
        return entry

    def check(self) -> int:
        """Find dead servers (reroute their requests), recovered ones (a restarted
        generation process; counted ``server_recoveries``) and late requests (retry or
        fail). Returns how many servers came back (the owner admits again)."""
        for i in self.pool.check():
            self.server_died(i)
        back = len(self.pool.recovered())
        if back:
            self.counters["server_recoveries"] += back
            self.halted = False
        self._check_deadlines()
        return back

    # ------------------------------------------------------------------ books

    def counts(self) -> dict[str, int]:
        """What it counted (samples_generated, _late, _timed_out, _retried, _failed,
        _aborted, _rerouted, _requeued; server_failures, server_recoveries)."""
        return dict(self.counters)

    def next_deadline(self) -> float | None:
        """Clock time at which the oldest outstanding request misses its deadline."""
        return self.table.next_deadline(self.deadline_s)

    def in_flight(self) -> list[int]:
        """Prompts with at least one request on a server, sorted."""
        return self.table.prompts()

    def outstanding(self, prompt_id: int) -> int:
        """Requests of ``prompt_id`` on a server."""
        return len(self.table.by_prompt(prompt_id))

    def start_estimate(self, prompt_id: int) -> float:
        """The start version the prompt's group will have (``OutstandingTable``)."""
        return self.table.start_estimate(prompt_id, self.pool.restarts)

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
                self.abort_prompt(pid)
                detail = (
                    f"sample {key[1]} not back within {self.deadline_s:g}s after "
                    f"{entry.attempts + 1} tries"
                )
                self.on_failed(pid, FailureReason.GENERATION_TIMEOUT, detail)
                continue
            self.counters["samples_retried"] += 1
            for e in on_server:  # the server dropped all of them: send them elsewhere
                tries = e.attempts + 1 if e.key == key else e.attempts
                self.dispatch(e.request, attempts=tries, avoid=server)

    def server_died(self, i: int) -> None:
        """Server i was found dead (the pool reports each death once): reroute its requests."""
        self.counters["server_failures"] += 1
        for e in self.table.by_server(i):
            self.table.pop(e.key)
            self.counters["samples_rerouted"] += 1
            self.dispatch(e.request, e.attempts, avoid=i)

    def retire(self, i: int) -> int:
        """Server i left the pool (``ServerPool.retire``; it is stopped): its requests
        are re-queued on the other servers, each counted ``samples_requeued``.

        A request keeps its key and its deadline retries, so its prompt's books do
        not change: it is neither lost nor counted twice (a sample the stopped
        server finished before it stopped was taken by ``received`` first; one it
        delivers late is ``samples_late``). Returns how many were re-queued.
        """
        entries = self.table.by_server(i)
        for e in entries:
            self.table.pop(e.key)
            self.counters["samples_requeued"] += 1
            self.dispatch(e.request, e.attempts, avoid=i)
        return len(entries)

    def _no_server_left(self, prompt_id: int) -> None:
        """Every server died: fail the prompts with requests in flight, halt the owner."""
        if not self.halted:
            self.halted = True
            self.on_halt()
        for pid in sorted({prompt_id, *self.table.prompts()}):
            for e in self.table.by_prompt(pid):
                self.table.pop(e.key)
            self.on_failed(pid, FailureReason.SERVER_DIED, "no generation server left")
