"""The run's console: one line per event, and a progress line during every long phase.

A real-model run spends minutes in phases that print nothing of their own:
loading weights, compiling the engine and the learner step, the first
evaluation, generating a step's samples. ``Console.phase`` names the phase;
while it lasts, a heartbeat thread prints ``label: status (elapsed)`` every
``every_s`` seconds of silence, where ``status`` is a function the phase
supplies (e.g. "20/32 samples generated, 16 scored, 2345 tokens at 45.0
tokens/s"). Between phases, ``background`` names what the run is in ("step
3/20"), so no stretch of work is silent for longer than ``every_s``. Plain lines, not an
in-place bar: they read the same in a terminal, through ``tee`` and in a log
file, and they never garble with the warnings logging writes to stderr.

The heartbeat reads counters the run already keeps (under their own locks); it
never touches a device and never raises into the run (a status function that
fails shows as "?").
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

Status = Callable[[], str]


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min`` (console text)."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Console:
    """Lines to ``stream`` and, inside ``phase``, a periodic progress line.

    Args:
      stream: where lines go (None: nothing is printed, e.g. in tests).
      every_s: seconds of silence after which a running phase prints its progress.
      now: monotonic time source (seconds).
    """

    def __init__(
        self,
        stream: TextIO | None = sys.stdout,
        *,
        every_s: float = 5.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"Console.every_s must be > 0, got {every_s}")
        self._stream = stream
        self.every_s = float(every_s)
        self._now = now
        self._lock = threading.Lock()
        self._phases: list[tuple[str, Status | None, float]] = []  # innermost last
        self._background: tuple[str, Status | None, float] | None = None
        self._last_output = now()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._noted: set[str] = set()

    def once(self, key: str, note: str) -> str:
        """``note`` the first time ``key`` is asked, "" after (e.g. "the first generation
        compiles the engine": the engine is compiled once, by whichever runs first)."""
        with self._lock:
            first = key not in self._noted
            self._noted.add(key)
        return note if first else ""

    def line(self, text: str) -> None:
        """Print one line now (and restart the silence timer)."""
        with self._lock:
            self._write(text)

    @contextlib.contextmanager
    def phase(
        self, label: str, status: Status | None = None, *, announce: str | None = None
    ) -> Iterator[None]:
        """A long phase: progress lines every ``every_s`` s of silence until it ends.

        Phases nest: an inner phase reports while it lasts, then the outer one again
        (a step's phase covers the work between its generation and training phases).

        Args:
          label: what is happening, short ("step 3/20: generating").
          status: returns the progress so far ("17/32 samples ..."); called on the
            heartbeat thread, so it must only read thread-safe counters.
          announce: a line printed at once (for phases worth naming even when short).
        """
        if self._stream is None:
            yield
            return
        entry = (label, status, self._now())
        with self._lock:
            if announce:
                self._write(announce)
            self._phases.append(entry)
            self._start()
        try:
            yield
        finally:
            with self._lock:
                self._phases.remove(entry)

    def background(self, label: str | None) -> None:
        """What the run is doing between phases ("step 3/20"); None: nothing (silence
        is then expected, e.g. after the run)."""
        with self._lock:
            self._background = None if label is None else (label, None, self._now())
            if label is not None and self._stream is not None:
                self._start()

    def close(self) -> None:
        """Stop the heartbeat thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -------------------------------------------------------------- internals

    def _write(self, text: str) -> None:  # under self._lock
        if self._stream is not None:
            print(text, file=self._stream, flush=True)
        self._last_output = self._now()

    def _start(self) -> None:  # under self._lock
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="console", daemon=True)
            self._thread.start()

    def _progress_line(self) -> str | None:  # under self._lock
        current = self._phases[-1] if self._phases else self._background
        if current is None or self._now() - self._last_output < self.every_s:
            return None
        label, status, started = current
        try:
            detail = status() if status is not None else ""
        except Exception:  # a progress line must never stop the run
            detail = "?"
        elapsed = duration(self._now() - started)
        return f"  {label}: {detail} ({elapsed})" if detail else f"  {label} ({elapsed})"

    def _beat(self) -> None:
        while not self._stop.wait(min(0.5, self.every_s / 4)):
            with self._lock:
                text = self._progress_line()
                if text is not None:
                    self._write(text)


# -------------------------------------------------------------- the run's status lines


class GenerationStatus:
    """Status of one step's generation, from the scheduler's counters.

    ``status()``: "20 samples generated, 16 scored (this step needs 32), 2345 tokens
    at 45.0 tokens/s" since this object was made. Generated samples are not shown as
    a fraction of the step's need: retries, regenerated stale samples and, with
    α > 0, samples for later steps make them exceed it ("generated incl. ahead" when
    the scheduler's ``sched_async_ratio`` > 0). In an agentic run every turn is a
    generated sample, so the line reads "87 turns generated, 5 episodes finished
    (this step needs 16), ...".

    Args:
      scheduler: ``stats()`` (samples_generated, samples_scored, episodes_finished,
        sched_async_ratio; locked) and ``server_stats()`` (each server's
        generated_tokens).
      now: the run's clock (seconds).
      samples: the step's need (B·G samples, or B·G episodes with ``episodes``).
      episodes: an agentic run (the need counts episodes, not samples).
    """

    def __init__(
        self, scheduler: Any, now: Callable[[], float], *, samples: int, episodes: bool = False
    ):
        self._scheduler, self._now, self._target = scheduler, now, samples
        self._episodes = episodes
        self._t0 = now()
        self._ahead = scheduler.stats().get("sched_async_ratio", 0) > 0
        self._before = self._counts()

    def _counts(self) -> tuple[int, int, int]:
        stats = self._scheduler.stats()
        # Remote servers' stats arrive as JSON numbers (floats): counts are shown as ints.
        tokens = int(sum(s.get("generated_tokens", 0) for s in self._scheduler.server_stats()))
        done = "episodes_finished" if self._episodes else "samples_scored"
        return stats.get("samples_generated", 0), stats.get(done, 0), tokens

    def __call__(self) -> str:
        (g0, s0, t0), (g1, s1, t1) = self._before, self._counts()
        rate = (t1 - t0) / max(self._now() - self._t0, 1e-9)
        ahead = " incl. ahead" if self._ahead else ""
        if self._episodes:
            head = f"{g1 - g0} turns generated, {s1 - s0} episodes finished{ahead}"
        else:
            head = f"{g1 - g0} samples generated{ahead}, {s1 - s0} scored"
        unit = "episodes" if self._episodes else "samples"
        need = f"(this step needs {self._target} {unit})"
        return f"{head} {need}, {t1 - t0} tokens at {rate:.1f} tokens/s"


class EvalStatus:
    """Status of an evaluation: ``update`` is its progress callback, ``status()`` the line.

    Args:
      now: the run's clock (seconds).
      unit: what ``update`` counts ("samples"; "episodes" for an agentic evaluation).
    """

    def __init__(self, now: Callable[[], float], *, unit: str = "samples"):
        self._now, self._t0, self._unit = now, now(), unit
        self.done = self.total = self.tokens = 0

    def update(self, done: int, total: int, tokens: int) -> None:
        self.done, self.total, self.tokens = done, total, tokens

    def __call__(self) -> str:
        if not self.total:  # no progress reported yet: no count to show
            return f"starting (no {self._unit} counted yet)"
        rate = self.tokens / max(self._now() - self._t0, 1e-9)
        return (
            f"{self.done}/{self.total} {self._unit} finished, {self.tokens} tokens at "
            f"{rate:.1f} tokens/s"
        )
