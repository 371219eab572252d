"""Environment calls on worker threads, each under a deadline: nothing an environment
does can block the rollout.

``reset`` and ``step`` of a text environment are synchronous and may block (sleep,
I/O, a subprocess; ``envs.base``). Each call runs on its own daemon thread through
``checked_reset`` / ``checked_step`` (so an exception or a malformed result comes
back as an ``EnvFailure``, never as a raise), and its outcome is posted to the
scheduler's ``Inbox`` as ``("env", call_id, outcome)``. The owner's ``poll``
takes it with ``done(call_id)``.

A call still running at its deadline is *expired* by ``expired(now)``: the owner
records ``ResetOutcome.timed_out`` / ``StepOutcome.timed_out`` for it, the thread
is abandoned (Python cannot kill a thread; it is a daemon and its late outcome is
ignored) and the environment instance is never used again (counted
``env_calls_abandoned``). A call whose episode was cancelled meanwhile (redundancy,
a stale group) is *orphaned*: its outcome is ignored and its environment closed
when the call returns, never while it runs.

How a call runs is a ``Runner``: ``thread_runner`` (the default: a daemon thread
each), ``inline_runner`` (at once, on the caller), or a virtual-time runner
(``runtime.simulate.env_time.VirtualEnvTime``: the call runs at once and its
outcome is delivered after the latency the environment asked to sleep). Time is
the run's ``Clock`` (deadlines are clock times), so a virtual clock and a
virtual-time runner drive it deterministically in tests and benchmarks.
Thread-free apart from the workers themselves: the owner serialises every method
call.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from jaxflash.envs.base import (
    ResetOutcome,
    StepOutcome,
    TextEnv,
    checked_reset,
    checked_step,
)
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.rollout.inbox import Inbox

log = logging.getLogger(__name__)

Runner = Callable[[Callable[[], Any], Callable[[Any], None]], None]
"""``runner(call, deliver)``: run ``call()`` somewhere and hand its result to
``deliver`` (which posts it to the inbox; safe from any thread)."""


def thread_runner(call: Callable[[], Any], deliver: Callable[[Any], None]) -> None:
    """Run ``call`` on a new daemon thread (an abandoned one never blocks exit)."""
    threading.Thread(target=lambda: deliver(call()), name="env-call", daemon=True).start()


def inline_runner(call: Callable[[], Any], deliver: Callable[[Any], None]) -> None:
    """Run ``call`` at once on the caller (tests; a hang would block the caller)."""
    deliver(call())


@dataclasses.dataclass(frozen=True)
class _Call:
    key: Any  # the owner's key (an episode)
    env: TextEnv
    phase: str  # "reset" | "step"
    deadline_at: float  # clock time
    deadline_s: float


class EnvCalls:
    """Pending environment calls by id.

    Args:
      inbox: where outcomes are posted (``("env", call_id, outcome)``).
      clock: the run's clock (deadlines).
      runner: how a call is run (default ``thread_runner``).
    """

    def __init__(
        self,
        inbox: Inbox,
        clock: Clock,
        *,
        runner: Runner = thread_runner,
    ) -> None:
        self.inbox, self.clock, self._runner = inbox, clock, runner
        # env_calls, env_calls_abandoned, env_close_errors (of cancelled calls' envs)
        self.counters: collections.Counter = collections.Counter()
        self._pending: dict[int, _Call] = {}
        self._orphans: dict[int, TextEnv] = {}  # cancelled calls still running
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._pending)

    def counts(self) -> dict[str, int]:
        """What it counted since it was built."""
        return dict(self.counters)

    # ------------------------------------------------------------------ starting

    def reset(self, key: Any, env: TextEnv, seed: int) -> int:
        """Start ``env.reset(seed)`` under ``env.config.step_timeout_s``; returns the call id."""
        deadline_s = float(env.config.step_timeout_s)
        return self._start(
            key, env, "reset", deadline_s, lambda: checked_reset(env, seed, deadline_s=deadline_s)
        )

    def step(self, key: Any, env: TextEnv, action_text: str) -> int:
        """Start ``env.step(action_text)`` under its deadline; returns the call id."""
        deadline_s = float(env.config.step_timeout_s)
        return self._start(
            key,
            env,
            "step",
            deadline_s,
            lambda: checked_step(env, action_text, deadline_s=deadline_s),
        )

    def _start(self, key: Any, env: TextEnv, phase: str, deadline_s: float, call: Callable) -> int:
        self._next_id += 1
        call_id = self._next_id
        self._pending[call_id] = _Call(key, env, phase, self.clock.now() + deadline_s, deadline_s)
        self.counters["env_calls"] += 1

        self._runner(call, lambda outcome: self.inbox.post("env", call_id, outcome))
        return call_id

    # ------------------------------------------------------------------ coming back

    def done(self, call_id: int) -> Any | None:
        """The owner's key of a call that came back in time, else None (expired, or
        orphaned: then its environment is closed now)."""
        call = self._pending.pop(call_id, None)
        if call is not None:
            return call.key
        env = self._orphans.pop(call_id, None)
        if env is not None:
            close_env(env, self.counters)
        return None

    def expired(self, now: float) -> list[tuple[Any, ResetOutcome | StepOutcome]]:
        """Calls past their deadline, removed, with the timed-out outcome to record.

        Their threads are abandoned; their environments must not be used again.
        """
        late = sorted(i for i, c in self._pending.items() if now > c.deadline_at)
        out = []
        for i in late:
            call = self._pending.pop(i)
            self.counters["env_calls_abandoned"] += 1
            outcome_cls = ResetOutcome if call.phase == "reset" else StepOutcome
            out.append((call.key, outcome_cls.timed_out(call.deadline_s)))
        return out

    def cancel(self, call_id: int) -> None:
        """The call's episode was cancelled: ignore its outcome, close its environment
        once it returns."""
        call = self._pending.pop(call_id, None)
        if call is not None:
            self._orphans[call_id] = call.env

    def next_deadline(self) -> float | None:
        """Clock time at which the earliest pending call expires (None if none)."""
        return min((c.deadline_at for c in self._pending.values()), default=None)


def close_env(env: TextEnv, counters: collections.Counter) -> None:
    """Close an environment that no call is using; an error is counted, not raised."""
    try:
        env.close()
    except Exception as err:  # noqa: BLE001 -- a broken close must not stop the rollout
        counters["env_close_errors"] += 1
        log.warning("environment close failed: %r", err)
