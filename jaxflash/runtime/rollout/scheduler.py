"""The rollout scheduler: keeps generation servers fed and hands the learner batches.

    prompts ─► Admission ((α+1)·B) ─► Dispatcher: G single-sample requests ─► ServerPool
       ▲                                                                       │
       │                                        reward per sample ◄── Inbox ◄──┘
    servers_changed(v+1): release ◄── learner ◄── next_batch ◄── BatchAssembler ◄── GroupBuffer

Built from thread-free parts, each with its own tests: ``OutstandingTable``,
``Admission``, ``ServerPool``, a dispatcher (``rollout.settings.Dispatch``, built by
the workload's factory), ``BatchAssembler``. Each part owns its state (the others
call its methods) and its counters (``counts()``; ``counters`` here adds them to the
checkpoint's). Their work is reachable without threads (``poll``, ``try_batch``,
``servers_changed``); the scheduler adds only the pump thread that calls ``poll`` in a loop
and the blocking ``next_batch``. A simulator drives the same object without threads under a
``VirtualClock`` (``runtime.clock``).

Driving it without threads (a discrete-event simulator; see
tests/test_scheduler_parts.py for a complete driver)::

    clock, inbox = VirtualClock(), Inbox()
    servers = [SimServer(on_finished=inbox.generated, clock=clock) for _ in range(n)]
    books = RolloutBooks(source=source, ledger=PromptLedger(), buffer=GroupBuffer(G))
    settings = RolloutSettings(batch_prompts=B, group_size=G, async_ratio=α, ...)
    sched = RolloutScheduler(
        servers, inbox, books, settings, prompt_dispatch(scorer, tokenizer), clock=clock
    )
    while v < steps:
        sched.poll()
        batch = sched.try_batch(v)
        if batch is None:  # jump to the next event; servers deliver what is due
            clock.advance_to(min(next server completion, sched.next_deadline()))
            continue
        clock.advance(learner time)
        sched.mark_trained(batch.groups)
        v += 1
        sched.servers_changed(ServersChanged(version=v, weights=[None] * n))

With α = 0 (capacity B, release at publish) the next prompts start at the new
version: the synchronous loop, prompt for prompt (ROLL Flash, arXiv 2510.11345).

Agentic RL: with ``episode_dispatch(EpisodeSettings)`` as the factory, a "prompt"
is a group of episodes sharing an environment seed and the environment manager
(``runtime.rollout.episode_dispatch.EpisodeDispatcher``) takes the ``Dispatcher``'s place:
every episode runs as its own loop, each turn one request to the servers; the
admission, staleness gate, batches, ledger and threads here are the same.
Threads: servers and reward futures only append to the ``Inbox``; everything
else runs under this scheduler's lock, and no lock of ours is held while a
server calls back, so the two can never deadlock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jaxflash.replay.groups import Group
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.runtime.rollout import server_metrics as gen_metrics
from jaxflash.runtime.rollout.admission import Admission
from jaxflash.runtime.rollout.batches import ALL_TRUNCATED, Batch, BatchAssembler
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.server_pool import (
    GenerationServerProtocol,
    ServerPool,
    ServersApplied,
    ServersChanged,
    Submitted,
)
from jaxflash.runtime.rollout.settings import (
    DispatchFactory,
    DispatchParts,
    RolloutBooks,
    RolloutSettings,
)
from jaxflash.types import PromptOutcome

__all__ = ["Batch", "Inbox", "RolloutBooks", "RolloutScheduler", "RolloutSettings"]


class BooksSnapshot(NamedTuple):
    """What ``RolloutScheduler.snapshot`` takes under one lock (a checkpoint's books).

    Attributes:
      ledger: ``PromptLedger.state_dict()`` (its in-flight prompts are generated again).
      counters: the scheduler's prompts_* / samples_* counters.
      cursor: the data source's cursor.
      buffer: ``GroupBuffer.state_dict()`` (the buffer_* counters).
    """

    ledger: dict[str, Any]
    counters: dict[str, int]
    cursor: int
    buffer: dict[str, int]


class RolloutScheduler:
    """Queue scheduling over generation servers with a per-sample staleness bound α.

    Args:
      servers: the generation servers (``GenerationServerProtocol``), built with
        ``on_finished=inbox.generated``; started by ``start``. Or a ``ServerPool`` of
        them: the fleet's own (``fleet.pool``), which the scheduler then routes to.
      inbox: where servers, reward futures and environments report back.
      books: source, ledger, group buffer (group size G), prompts in flight at the
        checkpoint (generated again first, ``prompts_regenerated_on_resume``) and
        the checkpoint's counters (they keep adding up).
      settings: B, G, α, sampling, deadlines, truncation, dynamic sampling.
      dispatch: builds the dispatcher (the workload's ``Workload.dispatch``: prompts
        scored by a reward pool, ``rollout.dispatch.prompt_dispatch``, or groups of
        episodes, ``rollout.episode_dispatch.episode_dispatch``).
      clock: time source (default: real time).

    Raises:
      ValueError: what the dispatch factory raises (no scorer; prompt_replication=False
        with episodes).
    """

    def __init__(
        self,
        servers: Sequence[GenerationServerProtocol] | ServerPool,
        inbox: Inbox,
        books: RolloutBooks,
        settings: RolloutSettings,
        dispatch: DispatchFactory,
        clock: Clock | None = None,
    ) -> None:
        self.settings, self.inbox = settings, inbox
        self.ledger, self.buffer, self.source = books.ledger, books.buffer, books.source
        self.truncation = settings.truncation
        self.clock = clock or RealClock()
        # Counters: the checkpoint's, plus what each part counted since (``counts``).
        self._restored: dict[str, int] = {k: int(v) for k, v in books.counters.items()}
        self._counters: collections.Counter = collections.Counter()  # the scheduler's own
        self._counters["prompts_regenerated_on_resume"] += len(books.resume_prompts)
        self.pool = servers if isinstance(servers, ServerPool) else ServerPool(servers)
        self.admission = Admission(
            books.source,
            capacity=settings.capacity,
            refill_budget=settings.refill_budget,
            resume=books.resume_prompts,
        )
        parts = DispatchParts(
            pool=self.pool,
            inbox=inbox,
            admission=self.admission,
            ledger=self.ledger,
            buffer=self.buffer,
            clock=self.clock,
            restored=dict(self._restored),
        )
        self.dispatcher = dispatch(parts, settings)
        self.assembler = BatchAssembler(
            self.dispatcher, self.admission, self.buffer, self.ledger, settings
        )
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._servers_seen: list[dict[str, Any]] = []  # server stats at the last step
        self.step_books: BooksSnapshot | None = None  # at the last ``end_step``

    @property
    def counters(self) -> collections.Counter:
        """Every counter of the run: the checkpoint's plus each part's since (a copy)."""
        with self._lock:
            out = collections.Counter(self._restored)
            for part in (self._counters, self.dispatcher.counts(), self.assembler.counts()):
                out.update(part)
            return out

    # ------------------------------------------------------------------ thread-free API

    def poll(self) -> int:
        """One pump step (reports, deaths, deadlines, admission); events handled."""
        with self._changed:
            n = self.dispatcher.poll()
            self._changed.notify_all()
            return n

    def try_batch(self, learner_version: int) -> Batch | None:
        """The batch for the step at ``learner_version`` if complete, else None (never blocks).

        See ``BatchAssembler.take``.

        Raises:
          RuntimeError: every generation server died and nothing is left to hand out.
        """
        with self._changed:
            batch = self.assembler.take(learner_version)
            if batch is not None:
                self._changed.notify_all()
            return batch

    def reconfigure(self, *, batch_prompts: int, async_ratio: int, prompts_in_flight: int) -> None:
        """Step boundary: new B, α and admission capacity (a controller's decision).

        Call between ``next_batch`` calls (after a batch was returned). The next
        batch takes ``batch_prompts`` groups with staleness <= ``async_ratio``;
        at most ``prompts_in_flight`` prompts are admitted and not yet released. A
        lower capacity admits nothing new until enough prompts are released (the
        ones admitted finish; none is aborted); a lower α drops groups that are now
        too stale at the next batch, counted as usual (``samples_dropped_stale``).
        With dynamic sampling the refill budget follows B.

        Raises:
          ValueError: batch_prompts < 1, async_ratio < 0, or prompts_in_flight <
            batch_prompts (no batch could ever be completed).
          RuntimeError: a batch is being assembled (not a step boundary).
        """
        if batch_prompts < 1 or async_ratio < 0 or prompts_in_flight < batch_prompts:
            raise ValueError(
                f"reconfigure needs batch_prompts >= 1, async_ratio >= 0 and prompts_in_flight "
                f">= batch_prompts; got {batch_prompts}, {async_ratio}, {prompts_in_flight}"
            )
        with self._changed:
            self.assembler.reconfigure(batch_prompts=batch_prompts, async_ratio=async_ratio)
            refill = batch_prompts if self.settings.refill_dropped else 0
            self.admission.resize(capacity=prompts_in_flight, refill_budget=refill)
            self._changed.notify_all()

    def count(self, *names: str) -> None:
        """Add 1 to each named counter (the loop's own counts live with the scheduler's)."""
        with self._lock:
            for name in names:
                self._counters[name] += 1

    def mark_trained(self, groups: Sequence[Group]) -> None:
        """Close a batch's prompts in the ledger (their capacity returns at the next
        version, ``servers_changed``).

        TRAINED, or FILTERED "all_truncated" when no sample of the group carried
        loss (``truncation="mask"`` with every sample truncated).
        """
        with self._lock:
            for g in groups:
                if self.truncation.masks_all(g.samples):
                    self.ledger.close(g.prompt_id, PromptOutcome.FILTERED, ALL_TRUNCATED)
                else:
                    self.ledger.close(g.prompt_id, PromptOutcome.TRAINED, "trained")
            self.ledger.check()

    def servers_changed(self, change: ServersChanged) -> ServersApplied:
        """The fleet's one call (``ServerListener``): its servers changed at a step boundary.

        Under the lock, so no request meets a server mid-change, in this order:

        - ``retired``: each leaves the pool, is stopped (its unfinished work dropped),
          what it finished before stopping is taken (``poll``) and its requests still
          out are re-queued on the others (``RequestRouter.retire``, counted
          ``samples_requeued``; ROLL's partial_gpu_mode shrinks its servers the same way);
        - ``added``: each joins at the pool's next index, started if the rollout runs;
        - ``version``: every live server is handed ``weights[i]`` (non-blocking; one
          found dead is rerouted) and the capacity of the prompts trained is released.

        Raises:
          ValueError: see ``ServerPool.retire``; a version that does not increase.
          TimeoutError: a retired server did not stop.
        """
        t0 = self.clock.now()
        requeued, added = 0, []
        with self._changed:
            for i in change.retired:
                self.pool.retire(i).stop(60.0)
                self.dispatcher.poll()
                requeued += self.dispatcher.router.retire(i)
            for server in change.added:
                added.append(self.pool.add(server))
                if self._thread is not None:
                    server.start()
            if change.version is not None:
                self._publish(change.weights, change.version)
            self._changed.notify_all()
        return ServersApplied(seconds=self.clock.now() - t0, requeued=requeued, added=tuple(added))

    def _publish(self, weights: Sequence[Any], version: int) -> None:
        """Hand ``version`` to every live server and release capacity (under the lock)."""
        for i, params in enumerate(weights):
            if self.pool.update(i, params, version) is Submitted.DIED:
                self.dispatcher.router.server_died(i)
        self.dispatcher.router.publish(version)
        self.assembler.release()
        for prompt in self.admission.release():  # surplus prompts, fresh at this version
            self.dispatcher.dispatch_prompt(prompt)

    # ------------------------------------------------------------------ threads

    def start(self) -> None:
        """Start the servers and the pump thread."""
        self.pool.start()
        self._thread = threading.Thread(target=self._pump, name="rollout-scheduler", daemon=True)
        self._thread.start()
        self._servers_seen = self.server_stats()  # what _server_metrics counts from

    def next_batch(
        self,
        learner_version: int,
        timeout_s: float | None = None,
        stop: Callable[[], None] | None = None,
    ) -> Batch:
        """``try_batch`` until it returns, waiting for the pump in between.

        Args:
          timeout_s: how long to wait (None: ``settings.batch_timeout_s``, the workload's).
          stop: called before every wait slice (<= 0.5 s); what it raises ends the
            wait (the loop's Ctrl-C, ``runtime.interrupt``).

        Raises:
          TimeoutError: no batch within ``timeout_s`` (naming the counts).
          RuntimeError: the pump thread died, or every generation server died.
        """
        t0 = self.clock.now()
        timeout_s = self.settings.batch_timeout_s if timeout_s is None else timeout_s
        with self._changed:
            while True:
                if stop is not None:
                    stop()
                if self._error is not None:
                    raise RuntimeError(f"rollout scheduler failed: {self._error!r}")
                batch = self.try_batch(learner_version)
                if batch is not None:
                    return dataclasses.replace(batch, wait_s=self.clock.now() - t0)
                left = timeout_s - (self.clock.now() - t0)
                if left <= 0:
                    raise TimeoutError(
                        f"next_batch: {self.assembler.groups_so_far}/{self.assembler.B} groups "
                        f"after {timeout_s}s at learner version {learner_version}: {self.stats()}"
                    )
                self.clock.wait(self._changed, min(left, 0.5))

    def close(self) -> None:
        """Stop the pump, abort every outstanding request (counted), stop the servers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for pid in self.dispatcher.in_flight():
                self.dispatcher.abort_prompt(pid)
        self.pool.stop()

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                self.inbox.wait(self.clock, 0.02)
                self.poll()
        except BaseException as err:  # surfaced by next_batch
            with self._changed:
                self._error = err
                self._changed.notify_all()

    # ------------------------------------------------------------------ books

    def snapshot(self) -> BooksSnapshot:
        """The books, consistent with each other, for a checkpoint."""
        with self._lock:
            counts = {k: int(v) for k, v in sorted(self.counters.items())}
            return BooksSnapshot(
                self.ledger.state_dict(), counts, int(self.source.cursor), self.buffer.state_dict()
            )

    def stats(self) -> dict[str, Any]:
        """Counters plus instantaneous queue state, for metrics.jsonl."""
        with self._lock:
            out = {k: int(v) for k, v in sorted(self.counters.items())}
            out.update(
                prompts_active=len(self.admission),
                sched_batch_prompts=self.assembler.B,
                sched_async_ratio=self.assembler.alpha,
                sched_prompts_capacity=self.admission.capacity,
                **self.dispatcher.stats(),
                **{f"buffer_{k}": v for k, v in self.buffer.counts().items()},
                **self.ledger.metrics(),
            )
            return out

    def end_step(self, groups: Sequence[Group], version: int, tracker: Any) -> tuple[int, int]:
        """Step boundary, after the update and before the publish frees capacity.

        Closes the batch's prompts (``mark_trained``), keeps the books a checkpoint of
        this step saves (``step_books``: what is in flight was admitted under the old
        weights) and reports the step's sections to ``tracker``
        (``metrics.tracker.StepTracker``): ``generation`` (the servers' ``gen*`` over
        the step at ``version``), ``rollout`` (``stats``) and ``outcomes``
        (``prompt_outcomes``: the ledger's outcome -> reason -> count, live).

        Returns:
          (samples generated since the run began, groups pending in the buffer): the
          step controller's view of supply and queue (``control.step_control.StepReport``).
        """
        self.mark_trained(groups)
        self.step_books = self.snapshot()
        tracker.report("rollout", self.stats())
        tracker.report("outcomes", {"prompt_outcomes": self.ledger.outcomes})
        with self._lock:  # supply and queue, before the servers' metrics (as they were)
            generated = int(self.counters.get("samples_generated", 0))
            progress = generated, int(self.buffer.counts()["pending"])
        tracker.report("generation", self._server_metrics(version))
        return progress

    def take_timeline_spans(self) -> dict[str, Any]:
        """Busy spans per server and reward-scoring spans since the last call (clock
        seconds), for ``<workdir>/timeline.jsonl``: {"gen": [[(t0, t1), ...] per
        server], "reward": [(t0, t1), ...]} (reward: RLVR samples only)."""
        with self._lock:
            spans = self.dispatcher.take_score_spans()
            return {"gen": self.pool.take_busy_spans(), "reward": spans}

    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's cumulative ``stats()`` ({} once dead)."""
        return self.pool.stats()

    def _server_metrics(self, version: int) -> dict[str, Any]:
        """The servers' generation metrics since the last call (since ``start`` at the
        first): ``rollout.server_metrics.server_metrics`` of the step at ``version``."""
        now = self.server_stats()
        before, self._servers_seen = self._servers_seen, now
        return gen_metrics.server_metrics(before, now, version)

    def next_deadline(self) -> float | None:
        """Clock time at which the oldest outstanding sample misses its deadline (None if
        nothing is out): the next event a discrete-event driver must ``poll`` at."""
        with self._lock:
            return self.dispatcher.next_deadline()

    @property
    def first_request_at(self) -> float | None:
        """Clock time of the first sample sent to a server (None before)."""
        return self.dispatcher.router.first_request_at
