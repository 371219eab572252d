"""Two small bookkeeping pieces of the simulated components: work time and versions.

``WorkClock`` maps a component's *work seconds* (what its cost model charges) to
clock seconds: work advances 1/factor per clock second (factor > 1 when it shares
hardware, ``Contention``), and not at all while suspended (a colocated server
while the learner holds its devices). A slow-down or a pause rescales only the
work still to do.

``VersionHistory`` records at which step boundary each policy version was applied
on a server, and stamps generated tokens with the version that made them (a
token made by the fill at boundary e, or by step e+1, carries the version last
applied at a boundary <= e).
"""

from __future__ import annotations

import numpy as np


class WorkClock:
    """t = t_ref + (w - w_ref)·factor for w >= w_ref; w frozen before t_ref (a pause).

    Args:
      now: clock time at work 0.
    """

    def __init__(self, now: float) -> None:
        self.t_ref, self.w_ref, self.factor = now, 0.0, 1.0

    def work(self, t: float) -> float:
        """Work seconds done by clock time ``t``."""
        return self.w_ref + max(0.0, t - self.t_ref) / self.factor

    def time(self, w: float) -> float:
        """Clock time at which work ``w`` (>= the work done now) is reached."""
        return self.t_ref + (w - self.w_ref) * self.factor

    def set_factor(self, now: float, factor: float) -> bool:
        """From ``now`` on, work runs ``factor`` times slower; True if it changed.

        Raises:
          ValueError: factor < 1 or not finite.
        """
        if not 1.0 <= factor < float("inf"):
            raise ValueError(f"WorkClock.set_factor: factor must be finite and >= 1, got {factor}")
        if factor == self.factor:
            return False
        self.w_ref, self.t_ref = self.work(now), max(now, self.t_ref)
        self.factor = factor
        return True

    def suspend(self, now: float, seconds: float) -> None:
        """No work for the next ``seconds`` (added to a pause already running)."""
        if self.t_ref > now:
            self.t_ref += seconds
        else:
            self.w_ref, self.t_ref = self.work(now), now + seconds

    def restart(self, now: float) -> None:
        """Work 0 is ``now`` (a new phase)."""
        self.t_ref, self.w_ref = now, 0.0


class VersionHistory:
    """Policy versions applied at step boundaries of one server.

    Args:
      version: the version held before any step (boundary -1).
    """

    def __init__(self, version: int) -> None:
        self._marks: list[int] = [-1]
        self._versions: list[int] = [int(version)]

    def apply(self, boundary: int, version: int) -> None:
        """``version`` applies from the boundary after step ``boundary`` on."""
        self._marks.append(int(boundary))
        self._versions.append(int(version))

    def stamps(self, fill_step: int, tokens: int, at_fill: int) -> np.ndarray:
        """int32 [tokens]: versions of ``tokens`` tokens made since a fill at boundary
        ``fill_step``: ``at_fill`` of them by the fill, the rest by steps fill_step+1, ..."""
        first = min(at_fill, tokens)
        e = np.concatenate([np.full(first, fill_step), fill_step + np.arange(tokens - first)])
        idx = np.searchsorted(np.asarray(self._marks), e, side="right") - 1
        return np.asarray(self._versions, np.int32)[idx]
