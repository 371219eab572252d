"""The rollout scheduler: keeps generation servers fed and hands the learner batches.

    prompts ─► Admission ((α+1)·B) ─► Dispatcher: G single-sample requests ─► ServerPool
       ▲                                                                       │
       │                                        reward per sample ◄── Inbox ◄──┘
    servers_changed(v+1): release ◄── learner ◄── next_batch ◄── BatchAssembler ◄── GroupBuffer

Built from thread-free parts, each with its own tests: ``OutstandingTable``,
``Admission``, ``ServerPool``, a dispatcher (``rollout.settings.Dispatch``, built by
the workload's factory), ``BatchAssembler``. Each part owns its state (the others
call its methods) and its counters (``counts()``; ``books.counters()`` adds them to the
checkpoint's). Their work is reachable without threads (``thread_free.ThreadFree``: ``poll``,
``try_batch``, ``mark_trained``; and ``servers_changed``); the scheduler adds only the pump
thread that calls ``poll`` in a loop and the blocking ``next_batch``.

Faces: the loop sees ``Rollout`` (``start``, ``next_batch``, ``end_step``, ``close``,
``watch``: ``rollout.watch.RolloutWatch``, ``books``: ``rollout.books.Books``), the fleet
a ``ServerListener`` (``servers_changed``), the step controller ``reconfigure``; the
simulator and the tests drive ``rollout.thread_free.ThreadFree(scheduler)`` without
threads under a ``VirtualClock`` (``runtime.clock``).

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

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxflash.replay.groups import Group
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.runtime.rollout.admission import Admission
from jaxflash.runtime.rollout.batches import ALL_TRUNCATED, Batch, BatchAssembler
from jaxflash.runtime.rollout.books import Books
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.pacing import Pacer
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
from jaxflash.runtime.rollout.stalls import AdmissionStalls
from jaxflash.runtime.rollout.watch import RolloutWatch
from jaxflash.types import PromptOutcome

__all__ = [
    "Batch",
    "Inbox",
    "Rollout",
    "RolloutBooks",
    "RolloutScheduler",
    "RolloutSettings",
]


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
        self._settings, self._inbox = settings, inbox
        self._ledger, self._buffer, self._source = books.ledger, books.buffer, books.source
        self._truncation = settings.truncation
        self._clock = clock or RealClock()
        self._pool = servers if isinstance(servers, ServerPool) else ServerPool(servers)
        self._pacer = Pacer.of(settings)  # None unless stale_policy="pace"
        self._admission = Admission(
            books.source,
            capacity=settings.capacity,
            refill_budget=settings.refill_budget,
            resume=books.resume_prompts,
            pacer=self._pacer,
        )
        parts = DispatchParts(
            pool=self._pool,
            inbox=inbox,
            admission=self._admission,
            ledger=self._ledger,
            buffer=self._buffer,
            clock=self._clock,
            restored={k: int(v) for k, v in books.counters.items()},
        )
        self._dispatcher = dispatch(parts, settings)
        self._assembler = BatchAssembler(
            self._dispatcher, self._admission, self._buffer, self._ledger, settings, self._pacer
        )
        self._stalls = AdmissionStalls(settings.slots_per_server)  # generation held back
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Counters: the checkpoint's, plus what each part counted since (``counts``).
        self._books = Books(
            ledger=self._ledger,
            buffer=self._buffer,
            source=self._source,
            restored=books.counters,
            parts=(lambda: self._dispatcher.watch.counts(), self._assembler.counts),
            lock=self._lock,
        )
        self._books.count("prompts_regenerated_on_resume", n=len(books.resume_prompts))
        self._watch = RolloutWatch(
            books=self._books,
            pool=self._pool,
            dispatcher=self._dispatcher,
            admission=self._admission,
            assembler=self._assembler,
            buffer=self._buffer,
            ledger=self._ledger,
            stalls=self._stalls,
            lock=self._lock,
        )

    # ------------------------------------------------------------------ the other faces

    @property
    def watch(self) -> RolloutWatch:
        """What observers read while it runs (console, step times, the simulator)."""
        return self._watch

    @property
    def books(self) -> Books:
        """The prompt books: the last step's (a checkpoint), outcomes, prompts open."""
        return self._books

    # ------------------------------------------------------------------ thread-free parts

    def _poll(self) -> int:
        """One pump step (reports, deaths, deadlines, admission); events handled."""
        with self._changed:
            n = self._dispatcher.poll()
            self._observe_admission()
            self._changed.notify_all()
            return n

    def _observe_admission(self) -> None:
        """Admission's state from now on, for ``rollout.stalls`` (under the lock)."""
        self._stalls.observe(
            self._clock.now(),
            self._admission.held_by(),
            servers=len(self._pool.alive),
            outstanding=len(self._dispatcher.router.table),
        )

    def _try_batch(self, learner_version: int) -> Batch | None:
        """The batch for the step at ``learner_version`` if complete, else None (never blocks).

        See ``BatchAssembler.take``.

        Raises:
          RuntimeError: every generation server died and nothing is left to hand out.
        """
        with self._changed:
            batch = self._assembler.take(learner_version)
            self._observe_admission()
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
            self._assembler.reconfigure(batch_prompts=batch_prompts, async_ratio=async_ratio)
            if self._pacer is not None:
                self._pacer.reconfigure(batch_prompts=batch_prompts, async_ratio=async_ratio)
            refill = batch_prompts if self._settings.refill_dropped else 0
            self._admission.resize(capacity=prompts_in_flight, refill_budget=refill)
            self._changed.notify_all()

    def _mark_trained(self, groups: Sequence[Group]) -> None:
        """Close a batch's prompts in the ledger (their capacity returns at the next
        version, ``servers_changed``).

        TRAINED, or FILTERED "all_truncated" when no sample of the group carried
        loss (``truncation="mask"`` with every sample truncated).
        """
        with self._lock:
            for g in groups:
                if self._truncation.masks_all(g.samples):
                    self._ledger.close(g.prompt_id, PromptOutcome.FILTERED, ALL_TRUNCATED)
                else:
                    self._ledger.close(g.prompt_id, PromptOutcome.TRAINED, "trained")
            self._ledger.check()

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
        t0 = self._clock.now()
        requeued, added = 0, []
        with self._changed:
            for i in change.retired:
                self._pool.retire(i).stop(60.0)
                self._dispatcher.poll()
                requeued += self._dispatcher.router.retire(i)
            for server in change.added:
                added.append(self._pool.add(server))
                if self._thread is not None:
                    server.start()
            if change.version is not None:
                self._publish(change.weights, change.version)
            self._changed.notify_all()
        return ServersApplied(seconds=self._clock.now() - t0, requeued=requeued, added=tuple(added))

    def _publish(self, weights: Sequence[Any], version: int) -> None:
        """Hand ``version`` to every live server and release capacity (under the lock)."""
        for i, params in enumerate(weights):
            if self._pool.update(i, params, version) is Submitted.DIED:
                self._dispatcher.router.server_died(i)
        self._dispatcher.router.publish(version)
        if self._pacer is not None:
            self._pacer.published(version)
        self._assembler.release()
        for prompt in self._admission.release():  # surplus prompts, fresh at this version
            self._dispatcher.dispatch_prompt(prompt)
        self._observe_admission()

    # ------------------------------------------------------------------ threads

    def start(self) -> None:
        """Start the servers and the pump thread."""
        self._pool.start()
        self._thread = threading.Thread(target=self._pump, name="rollout-scheduler", daemon=True)
        self._thread.start()
        self._watch.mark_start()  # what the first step's generation metrics count from

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
        t0 = self._clock.now()
        timeout_s = self._settings.batch_timeout_s if timeout_s is None else timeout_s
        with self._changed:
            while True:
                if stop is not None:
                    stop()
                if self._error is not None:
                    raise RuntimeError(f"rollout scheduler failed: {self._error!r}")
                batch = self._try_batch(learner_version)
                if batch is not None:
                    return dataclasses.replace(batch, wait_s=self._clock.now() - t0)
                left = timeout_s - (self._clock.now() - t0)
                if left <= 0:
                    raise TimeoutError(
                        f"next_batch: {self._assembler.groups_so_far}/{self._assembler.B} groups "
                        f"after {timeout_s}s at learner version {learner_version}: "
                        f"{self._watch.stats()}"
                    )
                self._clock.wait(self._changed, min(left, 0.5))

    def close(self) -> None:
        """Stop the pump, abort every outstanding request (counted), stop the servers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for pid in self._dispatcher.in_flight():
                self._dispatcher.end_prompt(pid, abort=True)
        self._pool.stop()

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                self._inbox.wait(self._clock, 0.02)
                self._poll()
        except BaseException as err:  # surfaced by next_batch
            with self._changed:
                self._error = err
                self._changed.notify_all()

    # ------------------------------------------------------------------ books

    def end_step(
        self, groups: Sequence[Group], version: int, tracker: Any, *, skipped: str | None = None
    ) -> tuple[int, int]:
        """Step boundary, after the update and before the publish frees capacity.

        A skipped step (``skipped``: its reason, ``learner_batch.empty_reason``) counts
        ``steps_skipped`` and ``steps_skipped_<reason>`` (the loop's counts live with the
        rollout's, in its books). Closes the batch's prompts (``_mark_trained``), keeps
        the books a checkpoint of this step saves (``step_books``: what is in flight was
        admitted under the old weights) and reports the step's sections to ``tracker``
        (``metrics.tracker.StepTracker``): ``generation`` (the servers' ``gen*`` over
        the step at ``version``), ``rollout`` (``stats``) and ``outcomes``
        (``prompt_outcomes``: the ledger's outcome -> reason -> count, live).

        Returns:
          (samples generated since the run began, groups pending in the buffer): the
          step controller's view of supply and queue (``control.step_control.StepReport``).
        """
        if skipped is not None:
            self._books.count("steps_skipped", f"steps_skipped_{skipped}")
        self._mark_trained(groups)
        self._books.close_step()
        tracker.report("rollout", self._watch.stats())
        tracker.report("outcomes", {"prompt_outcomes": self._ledger.outcomes})
        with self._lock:  # supply and queue, before the servers' metrics (as they were)
            generated = int(self._books.counters().get("samples_generated", 0))
            progress = generated, int(self._buffer.counts()["pending"])
        tracker.report("generation", self._watch.step_metrics(version))
        return progress

    def _next_deadline(self) -> float | None:
        """Clock time at which the oldest outstanding sample misses its deadline (None if
        nothing is out): the next event a discrete-event driver must ``poll`` at."""
        with self._lock:
            return self._dispatcher.next_deadline()


class Rollout(Protocol):
    """The loop's face of the rollout (``RolloutScheduler``): the fleet sees it as a
    ``server_pool.ServerListener`` (``servers_changed``), the step controller calls its
    ``reconfigure``; observers read ``watch`` and ``books``."""

    def start(self) -> None:
        """Start the servers and the pump thread."""

    def next_batch(
        self,
        learner_version: int,
        timeout_s: float | None = None,
        stop: Callable[[], None] | None = None,
    ) -> Batch:
        """The step's batch (blocks; TimeoutError after the workload's batch timeout)."""

    def end_step(
        self, groups: Sequence[Group], version: int, tracker: Any, *, skipped: str | None = None
    ) -> tuple[int, int]:
        """Step boundary: books closed and kept, sections reported; (generated, pending)."""

    def close(self) -> None:
        """Stop the pump, abort what is outstanding, stop the servers."""

    @property
    def watch(self) -> RolloutWatch:
        """Counters, stats and spans for observers."""

    @property
    def books(self) -> Books:
        """The prompt books."""
