"""Batch-level barrier dispatch: the rollout without queue scheduling.

ROLL Flash's synchronous baseline (arXiv 2510.11345 §5.1.1) generates a round of
requests, assigned to workers up front, and hands results on only when the whole
round is done: rewards, filters and replacement prompts all wait for the round's
slowest sample. ``RoundBarrier`` imposes that on simulated servers sharing it:

* a request joins the round that is open when it is submitted; the open round
  closes (starts) at the first server step after its first submission, and later
  requests join the next round;
* a server fills slots only with requests of the current round;
* finished samples are held until every request of the round has finished (or
  been aborted), then handed on together, and the next round starts.

Without a barrier (``None``) every sample is its own task: queue scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxflash.types import RequestKey


class RoundBarrier:
    """Rounds of requests across the servers that share it (thread-free)."""

    def __init__(self) -> None:
        self.round = 0  # the current round: the only one servers may fill from
        self._started = False  # the current round has closed to new requests
        self._members: dict[int, set[RequestKey]] = {0: set()}
        self._held: list[tuple[Callable[[Any], None], Any]] = []
        self._on_release: list[Callable[[], None]] = []
        self.rounds_done = 0

    def subscribe(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called when a round ends (servers then start the next)."""
        self._on_release.append(wake)

    def join(self, key: RequestKey) -> int:
        """The round a request submitted now belongs to."""
        r = self.round + 1 if self._started else self.round
        self._members.setdefault(r, set()).add(key)
        return r

    def may_fill(self, round_id: int) -> bool:
        return round_id == self.round

    def started(self) -> None:
        """A server stepped: the current round takes no new requests."""
        if self._members.get(self.round):
            self._started = True

    def finished(
        self, key: RequestKey, round_id: int, deliver: Callable[[Any], None], sample: Any
    ) -> None:
        """A member finished: hold its sample; end the round if it was the last."""
        self._held.append((deliver, sample))
        self._leave(key, round_id)

    def aborted(self, key: RequestKey, round_id: int) -> None:
        """A member was aborted (its held sample, if any, is dropped)."""
        self._held = [(d, s) for d, s in self._held if (s.prompt_id, s.sample_index) != key]
        self._leave(key, round_id)

    def _leave(self, key: RequestKey, round_id: int) -> None:
        members = self._members.get(round_id, set())
        members.discard(key)
        if round_id == self.round and not members and self._started:
            self._release()

    def _release(self) -> None:
        held, self._held = self._held, []
        self._members.pop(self.round, None)
        self.round += 1
        self._members.setdefault(self.round, set())
        self._started = False
        self.rounds_done += 1
        for deliver, sample in held:
            deliver(sample)
        for wake in self._on_release:
            wake()
