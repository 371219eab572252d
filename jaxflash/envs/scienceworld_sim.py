"""ScienceWorld simulator processes: one JVM per environment in use, reused, killed when hung.

The PyPI ``scienceworld`` package (1.2.3; arXiv 2203.07540) runs its Scala simulator
in a JVM reached over py4j (``scienceworld.jar`` ships in the wheel; Java 17 runs it).
Starting one costs ~1.4 s of CPU on an idle core (237 MB resident), a step ~0.02-0.3 s,
so a JVM is never started per episode: ``SimulatorPool.acquire`` hands out an idle
simulator or starts one, and ``release`` takes it back for the next episode. The
pool therefore holds as many JVMs as episodes run at once (the environment manager's
concurrency), at most ``max_idle`` of them idle.

Hangs and crashes. Every call into a simulator runs under a watchdog
(``Simulator.call(timeout_s, ...)``): a call still running after ``timeout_s`` has
its JVM killed, which makes the blocked py4j call raise (``SimulatorDied``). A JVM
that died by itself makes the call raise too. Either way the simulator is marked
dead and ``release`` discards it (never reused); the environment call raised, so
``envs.base.checked_step`` records a RAISED failure and the episode ends as an
environment failure, counted by the runtime. The pool counts ``started``,
``reused``, ``discarded`` (dead ones) and ``closed`` (surplus idle ones).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class SimulatorDied(RuntimeError):  # noqa: N818 -- names the event, as TimeoutError
    """A ScienceWorld JVM crashed, or was killed by the watchdog after a hang."""


def _start_scienceworld() -> Any:
    """A new ``scienceworld.ScienceWorldEnv`` (starts its JVM; ~1.4 s)."""
    try:
        from scienceworld import ScienceWorldEnv  # noqa: PLC0415 -- optional dependency
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "the scienceworld environment needs `pip install scienceworld==1.2.3` "
            "(pip install 'jaxflash[scienceworld]') and Java >= 11 on PATH"
        ) from e
    # The episode's turn limit is jaxflash's (Episode enforces max_turns); the
    # simulator's own step limit is set far above it so it never truncates first.
    return ScienceWorldEnv("", envStepLimit=1_000_000)


class Simulator:
    """One ScienceWorld JVM and the watchdog of its calls.

    Args:
      env: a ``scienceworld.ScienceWorldEnv`` (or a test double with the methods
        called and, for ``kill``, a ``_gateway.java_process`` Popen or a ``kill()``).
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.dead = False
        self._lock = threading.Lock()

    def kill(self) -> None:
        """Kill the JVM now (idempotent); a call blocked on it raises."""
        with self._lock:
            self.dead = True
        proc = getattr(getattr(self.env, "_gateway", None), "java_process", None)
        try:
            if proc is not None:
                proc.kill()
            else:
                self.env.kill()
        except Exception as e:  # noqa: BLE001 -- already gone is fine
            log.debug("killing a ScienceWorld JVM: %r", e)

    def alive(self) -> bool:
        """False once killed, or when the JVM process has exited."""
        proc = getattr(getattr(self.env, "_gateway", None), "java_process", None)
        return not self.dead and (proc is None or proc.poll() is None)

    def call(self, timeout_s: float, method: str, *args: Any, **kwargs: Any) -> Any:
        """``env.<method>(*args, **kwargs)`` under a watchdog of ``timeout_s`` seconds.

        Raises:
          SimulatorDied: the JVM was dead already, died during the call, or was
            killed after ``timeout_s`` (the simulator is then dead for good).
          Exception: whatever the simulator raises for a live JVM (a bad task name).
        """
        if not self.alive():
            self.dead = True
            raise SimulatorDied("ScienceWorld JVM is not running")
        timer = threading.Timer(timeout_s, self.kill)
        timer.daemon = True
        timer.start()
        try:
            return getattr(self.env, method)(*args, **kwargs)
        except Exception as e:
            if self.dead or not self.alive():
                self.dead = True
                raise SimulatorDied(
                    f"ScienceWorld JVM died during {method} (hung past {timeout_s} s, "
                    f"or crashed): {type(e).__name__}: {e}"
                ) from e
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        """Shut the JVM down (kills it if the polite shutdown fails)."""
        try:
            if self.alive():
                self.env.close()
        except Exception as e:  # noqa: BLE001 -- a failed shutdown falls back to kill
            log.debug("closing a ScienceWorld JVM: %r", e)
        self.kill()


class SimulatorPool:
    """Idle ScienceWorld simulators, shared by the environments of one process.

    Thread-safe: environments on different worker threads acquire and release
    concurrently.

    Args:
      start: makes a new simulator's env (default: a real ``ScienceWorldEnv``).
      max_idle: idle simulators kept for reuse (>= 0); a release beyond it closes
        the JVM.
    """

    def __init__(self, start: Callable[[], Any] = _start_scienceworld, *, max_idle: int = 64):
        if max_idle < 0:
            raise ValueError(f"SimulatorPool: max_idle must be >= 0, got {max_idle}")
        self._start, self.max_idle = start, max_idle
        self._idle: list[Simulator] = []
        self._lock = threading.Lock()
        self._facts: dict[Any, Any] = {}
        self.counters: collections.Counter = collections.Counter()

    def acquire(self) -> Simulator:
        """A live simulator: an idle one (counted ``reused``) or a new JVM (``started``)."""
        with self._lock:
            while self._idle:
                sim = self._idle.pop()
                if sim.alive():
                    self.counters["reused"] += 1
                    return sim
                self.counters["discarded"] += 1
        sim = Simulator(self._start())  # outside the lock: a JVM start takes seconds
        with self._lock:
            self.counters["started"] += 1
        return sim

    def release(self, sim: Simulator) -> None:
        """Take ``sim`` back: kept idle if alive and there is room, else closed."""
        if not sim.alive():
            with self._lock:
                self.counters["discarded"] += 1
            sim.kill()
            return
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(sim)
                return
            self.counters["closed"] += 1
        sim.close()

    def remember(self, key: Any, ask: Callable[[], Any]) -> Any:
        """``ask()``'s answer for ``key``, asked once per pool (a task's variation list:
        the same in every JVM). Two first askers may both ask; the answers agree."""
        with self._lock:
            if key in self._facts:
                return self._facts[key]
        answer = ask()
        with self._lock:
            return self._facts.setdefault(key, answer)

    def idle(self) -> int:
        """Idle simulators held now."""
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """Close every idle simulator (the pool stays usable)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self.counters["closed"] += len(idle)
        for sim in idle:
            sim.close()


_DEFAULT_POOL: SimulatorPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> SimulatorPool:
    """The process's shared pool (its JVMs exit with the process: py4j's die_on_exit)."""
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None:
            _DEFAULT_POOL = SimulatorPool()
        return _DEFAULT_POOL
