"""Simulated reward scoring: the workload's reward after a latency, on FIFO workers.

Fits ``runtime.scoring.Scorer``: ``submit(item)`` returns a Future of ``Scored``.
With zero latency the future is resolved before it is returned (as a fast
reward pool would do); otherwise it resolves when the driver delivers its
completion time (``next_due`` / ``deliver_due``), each sample taking
``latency_s`` on the first free of ``workers`` workers.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import re

from jaxflash.rewards.base import RewardResult
from jaxflash.runtime.clock import VirtualClock
from jaxflash.runtime.rollout.reward_pool import Scored
from jaxflash.runtime.simulate.costs import RewardCost
from jaxflash.runtime.simulate.workload import SimWorkload

_ITEM_ID = re.compile(r"prompt (-?\d+) sample (\d+)")


class SimScorer:
    """Rewards from ``workload.reward(prompt_id, sample_index)``.

    Raises:
      ValueError (from submit): an item id not of the form ``scoring.reward_item`` builds.
    """

    def __init__(self, workload: SimWorkload, clock: VirtualClock, cost: RewardCost) -> None:
        self.workload, self.clock, self.cost = workload, clock, cost
        self._free = [clock.now()] * cost.workers  # when each worker is free next
        self._due: list[tuple[float, int, concurrent.futures.Future, Scored]] = []
        self._seq = 0
        self.scored = 0

    def submit(self, item: tuple[str, str, str]) -> concurrent.futures.Future:
        match = _ITEM_ID.fullmatch(item[2])
        if match is None:
            raise ValueError(f"SimScorer: item id {item[2]!r} is not 'prompt P sample I'")
        pid, idx = int(match[1]), int(match[2])
        scored = Scored(RewardResult(score=self.workload.reward(pid, idx)))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.scored += 1
        if self.cost.latency_s == 0:
            future.set_result(scored)
            return future
        start = max(self.clock.now(), heapq.heappop(self._free))
        heapq.heappush(self._free, start + self.cost.latency_s)
        self._seq += 1
        heapq.heappush(self._due, (start + self.cost.latency_s, self._seq, future, scored))
        return future

    def next_due(self) -> float | None:
        return self._due[0][0] if self._due else None

    def deliver_due(self) -> None:
        """Resolve every score due by now (their callbacks report to the inbox)."""
        now = self.clock.now()
        while self._due and self._due[0][0] <= now:
            _, _, future, scored = heapq.heappop(self._due)
            future.set_result(scored)
