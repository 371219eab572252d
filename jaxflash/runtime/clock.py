"""The one source of time for the runtime: a real clock, or a virtual one for simulation.

Everything in ``jaxflash.runtime`` that reads time (deadlines, busy/idle
accounting, step timings) or waits with a timeout goes through a ``Clock``, so
the same scheduler, admission, group buffer and ledger can run against
simulated generation servers under a ``VirtualClock`` whose time moves only when
the driver advances it: no real sleeping, and the same result every run.

Units: seconds, as float. ``now()`` is monotonic and has an arbitrary origin
(compare two readings; never treat one as a date).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """What the runtime asks of time."""

    def now(self) -> float:
        """Monotonic time in seconds."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of this clock's time pass."""
        ...

    def wait(self, cond: threading.Condition, timeout_s: float) -> bool:
        """Wait on ``cond`` (held by the caller) until notified or ``timeout_s`` passes.

        Returns:
          False if the timeout passed, True if notified (spurious wake-ups allowed:
          callers re-check their predicate).
        """
        ...


class RealClock:
    """Wall-clock time: ``time.monotonic``, ``time.sleep``, ``Condition.wait``."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def wait(self, cond: threading.Condition, timeout_s: float) -> bool:
        return cond.wait(max(0.0, timeout_s))

    def __repr__(self) -> str:
        return "RealClock()"


class VirtualClock:
    """Simulated time that moves only when advanced (discrete-event simulation).

    Meant for one driver thread that owns time: it calls the runtime's thread-free
    steps (``RolloutScheduler.poll``, ``try_batch``) and advances the clock from
    one event to the next. ``sleep`` and ``wait`` advance time at once by the
    requested amount instead of blocking (the caller is the only actor that can
    make time pass), so code written against ``Clock`` never blocks for real.

    Args:
      start: initial time in seconds.

    Raises:
      ValueError: advancing by a negative amount or to an earlier time.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0); returns the new time."""
        if not seconds >= 0:
            raise ValueError(f"VirtualClock.advance: seconds must be >= 0, got {seconds}")
        with self._lock:
            self._now += float(seconds)
            return self._now

    def advance_to(self, t: float) -> float:
        """Move time forward to ``t`` (>= now); returns it."""
        with self._lock:
            if not t >= self._now:
                raise ValueError(f"VirtualClock.advance_to({t}): time is already {self._now}")
            self._now = float(t)
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def wait(self, cond: threading.Condition, timeout_s: float) -> bool:
        del cond  # nothing else can run in simulated time while the driver waits
        self.advance(max(0.0, timeout_s))
        return False

    def __repr__(self) -> str:
        return f"VirtualClock(now={self.now()})"
