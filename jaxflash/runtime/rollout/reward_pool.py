"""A pool of reward worker processes with a per-item deadline.

Scoring runs in separate processes (multiprocessing *spawn* context) so that:
- a reward that hangs (a pathological sympy simplification, a stuck sandbox)
  can be killed: the item resolves to score 0.0, error "timeout after Xs scoring
  <item_id>" and failure ``FailureReason.REWARD_TIMEOUT``; the worker is replaced;
- SIGALRM-based code works (each worker runs its reward on its main thread);
- scoring never holds the learner's or the scheduler's GIL.

One dispatcher thread owns all workers: it hands one item at a time to each
idle worker, waits on the result pipes with the earliest deadline as timeout,
and resolves `concurrent.futures.Future`s. The deadline clock for an item starts
when a *ready* worker receives it (start-up and queueing do not count).

Workers (``runtime.rollout.reward_worker``) import `jaxflash.rewards` only (not jax):
start-up costs one Python interpreter plus Math-Verify/sympy. Note that spawn
re-imports the parent's ``__main__`` module in every worker, so launchers keep
heavy imports (jax) inside ``main()``, not at module top level.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import multiprocessing
import threading
from collections.abc import Iterable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from jaxflash.rewards.base import REWARD_FNS, RewardFn, RewardResult, as_reward_fn
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.runtime.rollout.reward_worker import READY, STARTUP_ERROR, RewardItem, worker_main
from jaxflash.types import FailureReason


@dataclasses.dataclass(frozen=True)
class Scored:
    """What a scored item resolves to.

    Attributes:
      result: the reward's result (score 0.0 and ``error`` set when scoring failed).
      failure: None when the reward ran to completion and reported no error; else
        why not: REWARD_ERROR (raised, returned an error or the wrong type),
        REWARD_TIMEOUT, REWARD_CRASH (worker died), REWARD_UNAVAILABLE (pool closed
        or broken).
    """

    result: RewardResult
    failure: FailureReason | None = None


@dataclasses.dataclass(eq=False)
class _Job:
    item: RewardItem
    future: concurrent.futures.Future
    attempts: int = 0  # dispatches so far

    def dispatched(self) -> None:
        """One more attempt at scoring it."""
        self.attempts += 1


@dataclasses.dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing.context.SpawnProcess
    conn: Connection
    started_at: float
    ready: bool = False
    job: _Job | None = None
    deadline: float = float("inf")

    def started(self) -> None:
        """It said READY."""
        self.ready = True

    def assign(self, job: _Job, deadline: float) -> None:
        """It scores ``job`` until ``deadline`` (clock time)."""
        self.job, self.deadline = job, deadline

    def finish(self) -> _Job | None:
        """Its job came back: idle again; the job it held."""
        job, self.job, self.deadline = self.job, None, float("inf")
        return job


class RewardPool:
    """Score (response_text, answer, item_id) items in worker processes.

    Args:
      reward: a `REWARD_FNS` name, a {name: weight} dict, or a picklable callable
        (module-level function or instance of a module-level class).
      num_workers: worker processes (>= 1).
      timeout_s: per-item deadline in seconds (> 0), from hand-off to a ready worker.
      max_retries: extra attempts for an item whose worker timed out or died
        (>= 0). An exception raised by the reward is not retried (it is
        deterministic); it becomes the item's error.
      startup_timeout_s: how long a worker may take to import and resolve the reward.
      clock: time source of the deadlines (the pipe waits themselves are real:
        worker processes run in real time).

    Every submitted item resolves to a `Scored` (never an exception): its result
    has score 0.0 and `error` set, and `failure` says why, on timeout, crash,
    raise, or pool close.

    Raises:
      KeyError: `reward` is an unknown name (checked here, in the parent).
      ValueError: bad num_workers / timeout_s / max_retries.
    """

    def __init__(
        self,
        reward: str | RewardFn | Mapping[str, float],
        *,
        num_workers: int,
        timeout_s: float,
        max_retries: int = 0,
        startup_timeout_s: float = 120.0,
        clock: Clock | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"RewardPool.num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool.timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"RewardPool.max_retries must be >= 0, got {max_retries}")
        if isinstance(reward, str) and reward not in REWARD_FNS:
            raise KeyError(f"unknown reward function {reward!r}; known: {sorted(REWARD_FNS)}")
        as_reward_fn(reward)  # fail here, not in every worker, on a bad spec
        self._reward = reward
        self._num_workers = num_workers
        self._timeout_s = float(timeout_s)
        self._max_retries = max_retries
        self._startup_timeout_s = float(startup_timeout_s)
        self._clock = clock or RealClock()
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: collections.deque[_Job] = collections.deque()
        self._closed = False
        self._fatal: str | None = None  # set when workers cannot start at all
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._dispatch_loop, name="reward-pool", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API

    def submit(self, item: RewardItem | tuple) -> concurrent.futures.Future:
        """Queue one item; the future resolves to its `Scored`.

        Raises:
          RuntimeError: the pool is closed or its workers could not start.
          TypeError: item is not (str, str, id).
        """
        item = RewardItem(*item)
        if not isinstance(item.response_text, str) or not isinstance(item.answer, str):
            raise TypeError(
                f"reward item {item.item_id!r}: response_text and answer must be str, got "
                f"{type(item.response_text).__name__}, {type(item.answer).__name__}"
            )
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._fatal is not None:
                raise RuntimeError(f"RewardPool failed: {self._fatal}")
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            self._pending.append(_Job(item=item, future=future))
        self._wake()
        return future

    def score_many(self, items: Iterable[RewardItem | tuple]) -> list[Scored]:
        """Score items in parallel; results in input order. Returns within about
        ceil(n / num_workers) * timeout_s * (1 + max_retries) plus worker restarts."""
        futures = [self.submit(item) for item in items]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop the workers; items not yet scored resolve with an error. Idempotent."""
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_workers(self) -> int:
        return self._num_workers

    # ------------------------------------------------------------- worker control

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main, args=(child, self._reward), name="reward-worker", daemon=True
        )
        process.start()
        child.close()  # the parent keeps only its end, so a dead worker reads as EOF
        return _Worker(process=process, conn=parent, started_at=self._clock.now())

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"")
        except OSError:  # the dispatcher already closed the pipe
            pass

    def _finish(self, job: _Job, result: RewardResult, failure: FailureReason | None) -> None:
        if not job.future.done():
            job.future.set_result(Scored(result, failure))

    def _fail(self, job: _Job, error: str, failure: FailureReason) -> None:
        self._finish(job, RewardResult(score=0.0, error=error), failure)

    def _fail_or_retry(self, job: _Job, error: str, failure: FailureReason) -> None:
        if job.attempts <= self._max_retries:
            with self._lock:
                self._pending.appendleft(job)  # retry before newer items
        else:
            self._fail(job, error, failure)

    # ------------------------------------------------------------ dispatcher loop

    def _dispatch_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    closed = self._closed
                if closed:
                    break
                self._assign()
                self._wait_and_collect()
        except BaseException as e:  # never leave a future hanging
            with self._lock:
                self._fatal = f"dispatcher crashed: {type(e).__name__}: {e}"
        finally:
            self._shutdown()

    def _assign(self) -> None:
        """Hand pending items to ready, idle workers."""
        now = self._clock.now()
        for worker in self._workers:
            if not worker.ready or worker.job is not None:
                continue
            with self._lock:
                if not self._pending:
                    return
                job = self._pending.popleft()
            job.dispatched()
            try:
                worker.conn.send(tuple(job.item))
            except (OSError, EOFError):
                self._fail_or_retry(
                    job,
                    f"reward worker died before scoring {job.item.item_id}",
                    FailureReason.REWARD_CRASH,
                )
                self._replace(worker)
                continue
            worker.assign(job, now + self._timeout_s)

    def _wait_and_collect(self) -> None:
        """Block until a result, a wake-up or the earliest deadline; then handle it."""
        now = self._clock.now()
        deadlines = [w.deadline for w in self._workers if w.job is not None]
        deadlines += [w.started_at + self._startup_timeout_s for w in self._workers if not w.ready]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else None
        conns = {w.conn: w for w in self._workers}
        ready = wait([self._wake_r, *conns], timeout=wait_s)
        for conn in ready:
            if conn is self._wake_r:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
                continue
            self._collect(conns[conn])
        now = self._clock.now()
        for worker in list(self._workers):
            if worker.job is not None and now >= worker.deadline:
                job = worker.job
                self._replace(worker)  # SIGKILL: a hung reward cannot block us
                self._fail_or_retry(
                    job,
                    f"timeout after {self._timeout_s:g}s scoring {job.item.item_id}",
                    FailureReason.REWARD_TIMEOUT,
                )
            elif not worker.ready and now >= worker.started_at + self._startup_timeout_s:
                self._set_fatal(f"worker did not start within {self._startup_timeout_s:g}s", worker)

    def _collect(self, worker: _Worker) -> None:
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)  # EOF can come before the exit is reaped
            code = worker.process.exitcode
            job = worker.job
            if not worker.ready:
                self._set_fatal(f"worker exited during start-up (exit code {code})", worker)
                return
            self._replace(worker)
            if job is not None:
                self._fail_or_retry(
                    job,
                    f"reward worker died (exit code {code}) scoring {job.item.item_id}",
                    FailureReason.REWARD_CRASH,
                )
            return
        if msg == READY:
            worker.started()
        elif isinstance(msg, tuple) and msg and msg[0] == STARTUP_ERROR:
            self._set_fatal(msg[1], worker)
        elif worker.job is not None:
            job = worker.finish()
            # The worker turns a raise (or a wrong return type) into an error result.
            self._finish(job, msg, None if msg.error is None else FailureReason.REWARD_ERROR)

    def _set_fatal(self, reason: str, worker: _Worker) -> None:
        """Workers cannot start (bad import, unpicklable reward): fail everything."""
        self._kill(worker)
        self._workers.remove(worker)
        with self._lock:
            self._fatal = reason
            self._closed = True

    def _shutdown(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, EOFError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=2.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5.0)
            worker.conn.close()
            if worker.job is not None:
                self._fail(
                    worker.job,
                    f"reward pool closed while scoring {worker.job.item.item_id}",
                    FailureReason.REWARD_UNAVAILABLE,
                )
        self._workers = []
        with self._lock:
            pending, self._pending = list(self._pending), collections.deque()
            reason = self._fatal
        for job in pending:
            why = f"reward pool failed ({reason})" if reason else "reward pool closed"
            self._fail(
                job, f"{why} before scoring {job.item.item_id}", FailureReason.REWARD_UNAVAILABLE
            )
        self._wake_r.close()
        self._wake_w.close()
