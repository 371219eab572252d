"""Where generation servers, reward futures and environment workers report back: the
only cross-thread queue.

Servers call ``generated`` from their own threads (``on_finished``); reward futures
call ``scored`` from the reward pool's dispatcher thread; environment calls
(``runtime.rollout.env_calls``) ``post`` their outcome from their worker threads.
Everything else the rollout scheduler does happens on whoever calls the
dispatcher's ``poll``, which drains this queue; no lock of the scheduler is taken
here, so a server calling back can never deadlock with the scheduler calling it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from jaxflash.runtime.clock import Clock


class Inbox:
    """Where servers and reward futures report back (any thread); drained by ``poll``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: collections.deque[tuple] = collections.deque()

    def generated(self, sample: Any) -> None:
        """A server finished ``sample`` (the servers' ``on_finished``)."""
        with self._cond:
            self._events.append(("generated", sample))
            self._cond.notify_all()

    def scored(self, sample: Any, future: Any) -> None:
        """The reward of ``sample`` resolved (a future's done-callback)."""
        with self._cond:
            self._events.append(("scored", sample, future))
            self._cond.notify_all()

    def post(self, kind: str, *payload: Any) -> None:
        """Any other report: the event ``(kind, *payload)`` (e.g. an environment call's
        outcome, ``("env", call_id, outcome)``)."""
        with self._cond:
            self._events.append((kind, *payload))
            self._cond.notify_all()

    def drain(self) -> list[tuple]:
        with self._cond:
            events, self._events = list(self._events), collections.deque()
            return events

    def empty(self) -> bool:
        with self._cond:
            return not self._events

    def wait(self, clock: Clock, timeout_s: float) -> None:
        """Block until an event arrives or ``timeout_s`` of ``clock`` time passes."""
        with self._cond:
            if not self._events:
                clock.wait(self._cond, timeout_s)
