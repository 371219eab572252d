"""Run a batch of blocking tasks with a per-attempt deadline and retries; never hang.

`collect` runs each task (a no-argument callable, e.g. "generate the G samples of
prompt 17") on its own daemon thread, waits at most `deadline_s` for each attempt,
retries a task that raised or timed out up to `max_retries` times, and then drops
it with a reason. It returns what finished plus a full account of the shortfall
("No silent hang", ../shared/cases/rl_pitfalls.md).

Python threads cannot be killed. A timed-out attempt is therefore *abandoned*: its
thread keeps running in the background as a daemon (so it cannot keep the
interpreter alive at exit), its eventual result is ignored, and it is counted
(`CollectResult.abandoned`, `abandoned_threads_alive()`). That is acceptable for
tasks that merely wait (on a server, a socket, a queue). Work that can hang while
holding the CPU or the GIL -- reward functions running untrusted code or a
verifier -- must run in worker processes, which can be killed; that is why rewards
use processes and not this helper. `concurrent.futures.ThreadPoolExecutor` is not
used because its workers are joined at interpreter exit, so one hung task would
hang shutdown.

Each attempt starts its own thread, so an abandoned attempt never occupies a slot:
a task that hangs on every try is dropped after its retries and later calls (and
later tasks of the same call) still run at full width.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

_abandoned_lock = threading.Lock()
_abandoned: list[threading.Thread] = []  # abandoned attempts, pruned when they finish


def abandoned_threads_alive() -> int:
    """How many abandoned (timed-out) task threads of this process are still running."""
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return len(_abandoned)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectResult:
    """What a `collect` call produced and what it did not.

    Attributes:
      results: task name -> return value, for tasks that succeeded (in task order).
      dropped: task name -> reason, for tasks that failed on every attempt; the
        reason names the task, the attempt count and the last error or timeout.
      failures: every failed attempt, in the order seen: "task 'x' attempt 1/2:
        timed out after 0.5 s" or "task 'x' attempt 1/2: ValueError: ...".
      attempts: attempts started in total.
      timeouts: attempts that missed the deadline (and were abandoned).
      errors: attempts that raised.
      abandoned: threads left running by this call (== timeouts).
      wall_s: seconds the call took.
    """

    results: dict[str, Any]
    dropped: dict[str, str]
    failures: tuple[str, ...]
    attempts: int
    timeouts: int
    errors: int
    abandoned: int
    wall_s: float

    @property
    def shortfall(self) -> int:
        """Tasks that produced no result (== len(dropped))."""
        return len(self.dropped)


@dataclasses.dataclass
class _Attempt:
    name: str
    number: int  # 1-based
    deadline: float
    thread: threading.Thread


def collect(
    tasks: Mapping[str, Callable[[], Any]],
    *,
    deadline_s: float,
    max_retries: int,
    max_workers: int | None = None,
) -> CollectResult:
    """Run `tasks` concurrently with a per-attempt deadline and retries.

    Args:
      tasks: name -> no-argument callable. Names appear in every reason string.
      deadline_s: seconds one attempt may take (> 0), measured from its start.
      max_retries: extra attempts after the first (>= 0); a task gets at most
        1 + max_retries attempts.
      max_workers: attempts running at once (default: all tasks). Abandoned
        attempts do not count against it.

    Returns:
      CollectResult. The call returns after at most about
      ceil(len(tasks) / max_workers) * (1 + max_retries) * deadline_s seconds.

    Raises:
      ValueError: bad deadline_s / max_retries / max_workers, or a task is not callable.
    """
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
    width = len(tasks) if max_workers is None else max_workers
    if tasks and (not isinstance(width, int) or width < 1):
        raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
    for name, fn in tasks.items():
        if not callable(fn):
            raise ValueError(f"task {name!r} is not callable: {fn!r}")

    t0 = time.monotonic()
    total = 1 + max_retries
    done_q: queue.Queue[tuple[int, bool, Any]] = queue.Queue()
    todo: collections.deque[tuple[str, int]] = collections.deque((n, 1) for n in tasks)
    running: dict[int, _Attempt] = {}
    results: dict[str, Any] = {}
    dropped: dict[str, str] = {}
    failures: list[str] = []
    counters = {"attempts": 0, "timeouts": 0, "errors": 0}
    next_id = 0

    def run(attempt_id: int, fn: Callable[[], Any]) -> None:
        try:
            done_q.put((attempt_id, True, fn()))
        except BaseException as e:  # reported to the caller as a failed attempt, not swallowed
            done_q.put((attempt_id, False, e))

    def failed(name: str, number: int, why: str) -> None:
        msg = f"task {name!r} attempt {number}/{total}: {why}"
        failures.append(msg)
        if number < total:
            todo.append((name, number + 1))
        else:
            dropped[name] = f"task {name!r} dropped after {total} attempt(s); last: {why}"

    while todo or running:
        while todo and len(running) < width:
            name, number = todo.popleft()
            thread = threading.Thread(
                target=run,
                args=(next_id, tasks[name]),
                name=f"collect:{name}#{number}",
                daemon=True,  # a hung attempt must not keep the interpreter alive
            )
            running[next_id] = _Attempt(name, number, time.monotonic() + deadline_s, thread)
            next_id += 1
            counters["attempts"] += 1
            thread.start()

        wait_s = max(0.0, min(a.deadline for a in running.values()) - time.monotonic())
        try:
            attempt_id, ok, value = done_q.get(timeout=wait_s)
        except queue.Empty:
            pass
        else:
            attempt = running.pop(attempt_id, None)
            if attempt is not None:  # None: a late answer from an abandoned attempt
                if ok:
                    results[attempt.name] = value
                else:
                    counters["errors"] += 1
                    failed(attempt.name, attempt.number, f"{type(value).__name__}: {value}")

        now = time.monotonic()
        for attempt_id in [i for i, a in running.items() if a.deadline <= now]:
            attempt = running.pop(attempt_id)
            counters["timeouts"] += 1
            with _abandoned_lock:
                _abandoned.append(attempt.thread)
            failed(attempt.name, attempt.number, f"timed out after {deadline_s:g} s")

    return CollectResult(
        results={n: results[n] for n in tasks if n in results},
        dropped={n: dropped[n] for n in tasks if n in dropped},
        failures=tuple(failures),
        attempts=counters["attempts"],
        timeouts=counters["timeouts"],
        errors=counters["errors"],
        abandoned=counters["timeouts"],
        wall_s=time.monotonic() - t0,
    )
