"""What observers read of a running rollout: metrics.jsonl's ``rollout`` and
``generation`` sections, the timeline's spans, the servers' stats.

``RolloutWatch`` owns one piece of state, the servers' cumulative stats at the last
step, so that ``step_metrics`` gives each step's generation metrics as a difference
(``rollout.server_metrics.server_metrics``). Reads of the scheduler's parts take the
scheduler's lock; the servers' own ``stats()`` are read without it (a server never
waits on the scheduler).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from jaxflash.runtime.rollout import server_metrics as gen_metrics
from jaxflash.runtime.rollout.books import Books
from jaxflash.runtime.rollout.server_pool import ServerPool
from jaxflash.runtime.rollout.stalls import AdmissionStalls


class RolloutWatch:
    """Reads of a running rollout (the console's ``GenerationStatus``, ``StepTimes``, the
    simulator, the loop's row).

    Args:
      books: the rollout's ``Books`` (its counters).
      pool: the ``ServerPool`` (the servers' stats, busy spans).
      dispatcher: the ``Dispatch`` (queue state, scoring spans, first request).
      admission, assembler, buffer, ledger: the parts whose state ``stats`` reports.
      stalls: the ``rollout.stalls.AdmissionStalls`` the scheduler observes (``stats``).
      lock: the scheduler's lock.
    """

    def __init__(
        self,
        *,
        books: Books,
        pool: ServerPool,
        dispatcher: Any,
        admission: Any,
        assembler: Any,
        buffer: Any,
        ledger: Any,
        stalls: AdmissionStalls,
        lock: threading.RLock,
    ) -> None:
        self._books, self._pool, self._dispatcher = books, pool, dispatcher
        self._admission, self._assembler = admission, assembler
        self._buffer, self._ledger, self._lock = buffer, ledger, lock
        self._stalls = stalls
        self._seen: list[dict[str, Any]] = []  # the servers' stats at the last step

    def stats(self) -> dict[str, Any]:
        """Counters plus instantaneous queue state (metrics.jsonl's ``rollout`` section)."""
        with self._lock:
            out = {k: int(v) for k, v in sorted(self._books.counters().items())}
            out.update(
                prompts_active=len(self._admission),
                sched_batch_prompts=self._assembler.B,
                sched_async_ratio=self._assembler.alpha,
                sched_prompts_capacity=self._admission.capacity,
                **self._dispatcher.watch.stats(),
                **self._stalls.stats(),
                **{f"buffer_{k}": v for k, v in self._buffer.counts().items()},
                **self._ledger.metrics(),
            )
            return out

    @property
    def counters(self) -> collections.Counter:
        """Every counter of the run (the checkpoint's plus each part's since; a copy)."""
        return self._books.counters()

    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's cumulative ``stats()`` ({} once dead)."""
        return self._pool.stats()

    def take_timeline_spans(self) -> dict[str, Any]:
        """Busy spans per server and reward-scoring spans since the last call (clock
        seconds), for ``<workdir>/timeline.jsonl``: {"gen": [[(t0, t1), ...] per
        server], "reward": [(t0, t1), ...]} (reward: RLVR samples only)."""
        with self._lock:
            spans = self._dispatcher.watch.take_score_spans()
            return {"gen": self._pool.take_busy_spans(), "reward": spans}

    @property
    def first_request_at(self) -> float | None:
        """Clock time of the first sample sent to a server (None before)."""
        return self._dispatcher.router.first_request_at

    def mark_start(self) -> None:
        """The servers' stats now are what the first step's metrics count from."""
        self._seen = self.server_stats()

    def step_metrics(self, version: int) -> dict[str, Any]:
        """The servers' generation metrics since the last call (since ``mark_start`` at
        the first): ``rollout.server_metrics.server_metrics`` of the step at ``version``."""
        now = self.server_stats()
        before, self._seen = self._seen, now
        return gen_metrics.server_metrics(before, now, version)
