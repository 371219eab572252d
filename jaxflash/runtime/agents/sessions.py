"""Agent sessions: the user's agent on its own thread, seen by the run as an environment.

Control is inverted so that an agent is an ordinary ``TextEnv`` to the environment
manager (``runtime.rollout.episode_dispatch``), and everything built-in environments
get applies to it unchanged: each call on a worker under ``step_timeout_s``,
environment-level asynchrony, redundancy, restarts, the staleness bound, partial
rollout across weight updates (turns are ordinary generation requests, routed to
whatever fleet the run has: engine threads or generation programs):

    reset(seed) : start the agent thread (client -> this session's base URL); wait for
                  its first request -> the episode renders it as the first prompt
    (the run samples a turn; the episode records the sampled ids)
    step(text)  : answer the pending HTTP request with the sampled turn; wait for the
                  agent's next request (-> the next delta) or its return (-> reward,
                  terminated)
    close()     : the episode ended or was cancelled: the session closes, a request
                  still waiting is answered ``session_closed``

Threads: the endpoint's event loop posts requests (``AgentSession.post_request``, a
future per request); the agent thread posts its return or exception; the
environment call's worker waits on the session's queue. An agent that fails -- raises,
returns a bad value, makes no request, sends a malformed request or rewrites its
history, or is silent past ``step_timeout_s`` -- raises ``AgentFailedError`` out of
``reset``/``step`` (an ``EnvFailure`` ``raised`` to the manager, or ``timeout``), after
the session counted the reason and closed itself.

Counters (``SessionTable.counts``) add up:
``agent_sessions_started == agent_sessions_returned + agent_sessions_failed
+ agent_sessions_closed + agent_sessions_running`` and ``agent_sessions_failed`` is
the sum of ``agent_sessions_failed_<reason>`` over ``FAILURES``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxflash.envs.agent_chat import ChatRequest, RequestError, ToolFormat
from jaxflash.envs.agent_contract import (
    AgentConfig,
    AgentContractError,
    AgentTask,
    as_result,
    is_async_agent,
)
from jaxflash.envs.agent_turns import TURN_COUNTERS, SessionTurns
from jaxflash.envs.base import StepResult

log = logging.getLogger(__name__)

FAILURES = ("raised", "bad_return", "no_request", "malformed", "history_rewritten", "timeout")
"""Why an agent session fails (``agent_sessions_failed_<reason>``)."""

CLIENT_TIMEOUT_S = 3600.0
"""The agent's client waits this long for one response (a busy run queues turns)."""


class AgentFailedError(RuntimeError):
    """The agent broke the contract; ``reason`` is one of ``FAILURES``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"agent {reason}: {detail}")
        self.reason = reason


class SessionClosedError(RuntimeError):
    """A request arrived for a session that has ended."""


class AgentSession:
    """One session's mailbox between the endpoint, the agent thread and the environment.

    Events (``next_event``): ``("request", ChatRequest, Future)``, ``("malformed",
    RequestError)``, ``("returned", value)``, ``("raised", exception)``.
    """

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._waiting: list[concurrent.futures.Future] = []

    def post_request(self, request: ChatRequest) -> concurrent.futures.Future:
        """From the endpoint: a request; its future resolves to ``(status, body)``.

        Raises:
          SessionClosedError: the session has ended.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise SessionClosedError(self.session_id)
            self._waiting.append(future)
        self._events.put(("request", request, future))
        return future

    def post(self, kind: str, payload: Any) -> None:
        """From the endpoint (``malformed``) or the agent thread (``returned``, ``raised``)."""
        self._events.put((kind, payload))

    def next_event(self, timeout_s: float) -> tuple | None:
        """The next event, or None after ``timeout_s`` seconds."""
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @staticmethod
    def answer(future: concurrent.futures.Future, status: int, body: dict[str, Any]) -> None:
        """Resolve a request's future (once; a late second answer is ignored)."""
        if not future.done():
            future.set_result((status, body))

    def close(self, why: str) -> None:
        """No more requests; any still waiting are answered ``session_closed``."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, []
        err = RequestError(f"session {self.session_id} has ended: {why}", code="session_closed")
        for future in waiting:
            self.answer(future, 400, err.body())


class SessionTable:
    """The run's sessions by id (thread-safe) and what they counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, AgentSession] = {}
        self._counters: collections.Counter = collections.Counter(
            {n: 0 for n in ("agent_sessions_started", "agent_sessions_returned")}
        )
        self._counters.update({f"agent_sessions_failed_{r}": 0 for r in FAILURES})
        self._counters.update({n: 0 for n in ("agent_sessions_closed", *TURN_COUNTERS)})
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(3)  # ids unique across the tables of a process

    def open(self) -> AgentSession:
        """A new registered session."""
        with self._lock:
            session = AgentSession(f"s{self._prefix}-{next(self._ids)}")
            self._sessions[session.session_id] = session
            self._counters["agent_sessions_started"] += 1
        return session

    def get(self, session_id: str) -> AgentSession | None:
        """The open session ``session_id`` (None: unknown or ended)."""
        with self._lock:
            return self._sessions.get(session_id)

    def end(self, session: AgentSession, outcome: str, turns: collections.Counter) -> None:
        """Close and unregister ``session``; count its outcome (``returned``, ``closed`` or
        ``failed_<reason>``) and its turn counters."""
        session.close(outcome)
        with self._lock:
            if self._sessions.pop(session.session_id, None) is None:
                return  # ended before
            self._counters[f"agent_sessions_{outcome}"] += 1
            self._counters.update(turns)

    def counts(self) -> dict[str, int]:
        """Counters so far, with ``agent_sessions_failed`` and ``_running``."""
        with self._lock:
            out = dict(self._counters)
            out["agent_sessions_running"] = len(self._sessions)
        out["agent_sessions_failed"] = sum(out[f"agent_sessions_failed_{r}"] for r in FAILURES)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentRuntime:
    """What every session of a run shares (built by ``host.AgentHost``).

    Attributes:
      agent: the user's agent. tasks: ``(seed, split) -> data``.
      table: the sessions. base_url: ``session_id -> base URL``. api_key: the run's key.
      model_name: the served model name. tool_format: lazily the tokenizer's.
      client_factory: ``(base_url, api_key, is_async) -> client``.
    """

    agent: Callable[..., Any]
    tasks: Callable[[int, str], Any]
    table: SessionTable
    base_url: Callable[[str], str]
    api_key: str
    model_name: str
    client_factory: Callable[[str, str, bool], Any]
    tool_format: dict = dataclasses.field(default_factory=dict)  # tokenizer id -> ToolFormat


class AgentEnv:
    """A ``TextEnv`` whose episode is one agent session (module docstring)."""

    def __init__(self, runtime: AgentRuntime, config: AgentConfig) -> None:
        self.config, self._rt = config, runtime
        self._session: AgentSession | None = None
        self._turns: SessionTurns | None = None
        self._pending: concurrent.futures.Future | None = None
        self._ended = False
        self._refused = False  # a request past max_turns was refused

    def turn_renderer(self, default: Any) -> SessionTurns:
        """This session's renderer for its episode (``envs.chat.renderer_for``)."""
        formats = self._rt.tool_format
        if id(default.tokenizer) not in formats:
            formats[id(default.tokenizer)] = ToolFormat(default.tokenizer)
        self._session = self._rt.table.open()
        self._turns = SessionTurns(
            default,
            formats[id(default.tokenizer)],
            session_id=self._session.session_id,
            model_name=self._rt.model_name,
        )
        return self._turns

    # ------------------------------------------------------------------ the environment

    def reset(self, seed: int) -> str:
        """Start the agent on task ``seed``; wait for its first request."""
        if self._turns is None:
            raise RuntimeError("AgentEnv: reset before turn_renderer")
        session, rt = self._session, self._rt
        task = AgentTask(
            seed=int(seed), split=self.config.split, data=rt.tasks(int(seed), self.config.split),
            model=rt.model_name, base_url=rt.base_url(session.session_id), api_key=rt.api_key,
            session_id=session.session_id, deadline_s=self.config.step_timeout_s,
        )  # fmt: skip
        threading.Thread(
            target=self._run_agent, args=(task,), name=f"agent-{session.session_id}", daemon=True
        ).start()
        kind, *payload = self._wait()
        if kind != "request":
            why = "raised" if kind == "raised" else "no_request"
            self._fail(why, f"ended before its first request: {payload[0]!r}")
        request, self._pending = payload
        return self._turns.begin(request)

    def step(self, action_text: str) -> StepResult:
        """Answer the pending request with the sampled turn; wait for what comes next."""
        turns = self._turns
        self._session.answer(self._pending, 200, turns.reply(action_text))
        self._pending = None
        while True:
            kind, *payload = self._wait()
            if kind == "request" and turns.num_turns >= self.config.max_turns:
                err = RequestError(
                    f"max_turns={self.config.max_turns} reached: return the reward",
                    code="max_turns",
                )
                self._session.answer(payload[1], 400, err.body())
                self._refused = True
                continue
            if kind == "request":
                request, future = payload
                try:
                    observation = turns.extend(request)
                except RequestError as e:
                    self._session.answer(future, e.status, e.body())
                    self._fail(e.code or "malformed", e.message)
                self._pending = future
                return StepResult(observation, 0.0, False, False, {"role": "user"})
            if kind == "raised" and self._refused:  # refused past max_turns: truncated
                return StepResult("", 0.0, False, True, {})
            if kind == "raised":
                self._fail("raised", repr(payload[0]))
            return self._returned(payload[0])

    def _returned(self, value: Any) -> StepResult:
        try:
            result = as_result(value, self._turns.num_turns)
        except AgentContractError as e:
            self._fail("bad_return", str(e))
        self._end("returned")
        earlier = result.turn_rewards
        last = result.reward if earlier is None else earlier[-1]
        info: dict[str, Any] = {"success": result.reward > 0, "agent_metrics": result.metrics}
        if earlier is not None:
            info["turn_rewards"] = list(earlier[:-1])
        return StepResult("", last, True, False, info)

    def close(self) -> None:
        """End the session (answered ``session_closed`` from now on)."""
        self._end("closed")

    # ------------------------------------------------------------------ internals

    def _wait(self) -> tuple:
        """The session's next event; a malformed request or silence fails the session."""
        event = self._session.next_event(self.config.step_timeout_s)
        if event is None:
            self._fail("timeout", f"nothing within {self.config.step_timeout_s}s")
        if event[0] == "malformed":
            self._fail("malformed", event[1].message)
        return event

    def _fail(self, reason: str, detail: str) -> None:
        self._end(f"failed_{reason}")
        raise AgentFailedError(reason, detail)

    def _end(self, outcome: str) -> None:
        if not self._ended and self._session is not None:
            self._ended = True
            self._rt.table.end(self._session, outcome, self._turns.counters)

    def _run_agent(self, task: AgentTask) -> None:
        """The agent thread: call the agent, post its return or exception."""
        rt, session = self._rt, self._session
        is_async = is_async_agent(rt.agent)
        started = time.monotonic()
        try:
            client = rt.client_factory(task.base_url, rt.api_key, is_async)
            if is_async:

                async def call() -> Any:
                    async with client:
                        return await rt.agent(client, task)

                value = asyncio.run(call())
            else:
                with client:
                    value = rt.agent(client, task)
            session.post("returned", value)
        except BaseException as e:  # noqa: BLE001 -- the agent's failure is its session's
            log.info("agent of session %s raised after %.1fs: %r", session.session_id,
                     time.monotonic() - started, e)  # fmt: skip
            session.post("raised", e)
