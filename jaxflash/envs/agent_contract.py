"""Bring your own agent: the contract between a user's agent and a jaxflash run.

An agent is a plain function (or a class with ``__call__``) written against the stock
``openai`` client. jaxflash calls it once per episode, on its own thread, with a client
already pointed at the run's OpenAI-compatible endpoint (``runtime.agents``) and a
task; the agent runs its own loop and returns a reward::

    # mypkg/agent.py
    def solve(client: openai.OpenAI, task: AgentTask) -> float | AgentResult:
        messages = [{"role": "user", "content": task.data["question"]}]
        for _ in range(4):
            reply = client.chat.completions.create(
                model=task.model, messages=messages, tools=TOOLS, max_tokens=128
            )
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))  # echo it back unchanged
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(call)})
        return AgentResult(reward=score(msg.content, task.data["answer"]))

    def tasks(seed: int, split: str) -> dict:          # the task of one episode group
        return {"question": ..., "answer": ...}

and a config names both, as rewards are named (``package.module:fn``)::

    c.env.name = "agent"
    c.env.options = {"agent": "mypkg.agent:solve", "tasks": "mypkg.agent:tasks",
                     "max_turns": 4, "max_tokens_per_turn": 128, "step_timeout_s": 60}

* ``async def solve(client: openai.AsyncOpenAI, task)`` gets an ``AsyncOpenAI`` client
  (run with ``asyncio.run`` on the episode's thread); a plain function gets ``OpenAI``.
* ``task`` is an ``AgentTask``: ``data`` is what ``tasks(seed, split)`` returned for the
  group's seed (episodes of a GRPO group share a seed), ``model`` the name to pass as
  ``model=``, ``base_url`` / ``api_key`` / ``session_id`` the session's endpoint (for
  an agent that builds its own client, e.g. ``verifiers``), ``deadline_s`` the time
  allowed between two requests of the agent (``step_timeout_s``).
* The return is a finite ``float`` (the episode's reward, given to its last turn) or an
  ``AgentResult`` (optionally one reward per model turn, and metrics).
* Every request of one call belongs to that episode's session; its base URL is
  ``http://127.0.0.1:<port>/sessions/<id>/v1`` (the client is given it). One request
  is one model turn; the conversation must be extended, never rewritten: each request's
  ``messages`` repeat the previous request's messages and the assistant message the
  endpoint returned, then add new ones (tool results, a user message). ``n`` must be 1
  (a session is one trajectory; a GRPO group is ``rollout.group_size`` sessions).

What jaxflash trains on is what the engine sampled, never a re-tokenisation of the
text the agent echoes back: the next turn's prompt is the previous turn's exact token
ids followed by the new messages rendered by the model's chat template (the
reference-conversation delta of ``envs.chat``). An echoed assistant message whose text
or tool calls differ from what was returned is counted (``agent_echo_mismatch``) and
the recorded ids are kept (the agent's edit is not seen by the model); one whose text
matches but whose re-rendered tokens differ from the sampled ids is counted
(``agent_retokenized_differently``: the case this design exists for), ids kept.

Failures are the agent's and end its episode (counted by reason, the run goes on; the
environment manager restarts or covers the episode as for any environment failure):
the agent raises, returns something that is not a finite reward, makes no request,
sends a malformed request (it gets an OpenAI-style 400 body first), rewrites the
history, or makes no request and no return within ``step_timeout_s`` of the last
response.

This module holds the contract and its checks only (no threads, no I/O); the endpoint,
the sessions and the agents' threads are ``jaxflash.runtime.agents``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxflash.envs.base import EnvConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentTask:
    """What one agent call gets besides its client.

    Attributes:
      seed: the episode group's seed (episodes of a GRPO group share it).
      split: "train" or "eval".
      data: what the config's ``tasks(seed, split)`` returned (any value).
      model: the model name to pass as ``model=`` (``/v1/models`` lists it).
      base_url: the session's OpenAI base URL (``.../sessions/<id>/v1``).
      api_key: the run's key (``Authorization: Bearer <key>``).
      session_id: the session (episode) id.
      deadline_s: seconds allowed between a response and the agent's next request
        (or its return); past it the episode fails (``timeout``).
    """

    seed: int
    split: str
    data: Any
    model: str
    base_url: str
    api_key: str
    session_id: str
    deadline_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentResult:
    """What an agent returns (a bare finite ``float`` is ``AgentResult(reward=it)``).

    Attributes:
      reward: the episode's reward (finite), given to its last model turn.
      turn_rewards: optional, one finite reward per model turn (request) of the
        session, in order; then ``reward`` must equal their sum (the episode return).
      metrics: optional named finite numbers, kept in the trained sample's
        ``reward_info`` as ``agent_metric_<name>`` and averaged over the step's trained
        episodes into the step record's ``episodes`` section (``agent_metric_<name>``).
    """

    reward: float
    turn_rewards: Sequence[float] | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


class AgentContractError(ValueError):
    """An agent broke the contract (bad return value, bad config path)."""


def as_result(value: Any, num_turns: int) -> AgentResult:
    """The agent's return value checked and normalised.

    Args:
      value: what the agent returned.
      num_turns: model turns (requests) the session served.

    Returns:
      an ``AgentResult`` with float rewards.

    Raises:
      AgentContractError: not a finite real / ``AgentResult``; turn_rewards of the wrong
        length, non-finite, or not summing to ``reward`` (within 1e-6 relative); a
        non-numeric metric.
    """
    if isinstance(value, AgentResult):
        result = value
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        result = AgentResult(reward=float(value))
    else:
        raise AgentContractError(
            f"the agent returned {type(value).__name__}; return a float or an AgentResult"
        )
    reward = _finite(result.reward, "reward")
    turn_rewards = None
    if result.turn_rewards is not None:
        turn_rewards = tuple(_finite(r, "turn_rewards[]") for r in result.turn_rewards)
        if len(turn_rewards) != num_turns:
            raise AgentContractError(
                f"turn_rewards has {len(turn_rewards)} entries for {num_turns} model turns"
            )
        if not math.isclose(sum(turn_rewards), reward, rel_tol=1e-6, abs_tol=1e-6):
            raise AgentContractError(
                f"reward {reward} is not the sum of turn_rewards {sum(turn_rewards)}"
            )
    metrics = {str(k): _finite(v, f"metrics[{k!r}]") for k, v in dict(result.metrics).items()}
    return AgentResult(reward=reward, turn_rewards=turn_rewards, metrics=metrics)


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AgentContractError(f"{what} is {type(value).__name__}, not a number")
    if not math.isfinite(float(value)):
        raise AgentContractError(f"{what} is {value}, not finite")
    return float(value)


def load_callable(path: str, field: str) -> Callable[..., Any]:
    """``package.module:fn`` imported (``fn`` may be a dotted attribute path).

    Raises:
      AgentContractError: the form is wrong, the module does not import, or the
        attribute is missing or not callable (names ``field``).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise AgentContractError(f"{field}={path!r}: expected 'package.module:fn'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise AgentContractError(f"{field}={path!r} does not resolve: {e}") from None
    if not callable(obj):
        raise AgentContractError(f"{field}={path!r} is {type(obj).__name__}, not callable")
    return obj


def is_async_agent(agent: Callable[..., Any]) -> bool:
    """True when the agent is a coroutine function (it gets ``openai.AsyncOpenAI``)."""
    call = agent if inspect.isfunction(agent) or inspect.ismethod(agent) else agent.__call__
    return inspect.iscoroutinefunction(call)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig(EnvConfig):
    """``env.name = "agent"``: episodes played by a user's agent through the endpoint.

    Attributes (besides ``EnvConfig``'s; ``max_turns`` caps the agent's requests,
    ``max_tokens_per_turn`` each response, ``step_timeout_s`` the agent's time between
    a response and its next request):
      agent: ``package.module:fn``, the agent (module docstring).
      tasks: ``package.module:fn``, ``(seed, split) -> task data``.
      split: "train" or "eval" (set by the run).
      host: the endpoint's bind address; loopback unless ``allow_remote``.
      port: its TCP port (0: any free port).
      allow_remote: bind a non-loopback address (the key still guards every request).
      model_name: the name ``/v1/models`` lists and requests must use ("" = any).
    """

    agent: str = ""
    tasks: str = ""
    split: str = "train"
    host: str = "127.0.0.1"
    port: int = 0
    allow_remote: bool = False
    model_name: str = "jaxflash-policy"

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("agent", "tasks"):
            value = getattr(self, field)
            self.require(field, value.count(":") == 1 and all(value.split(":")), "'pkg.mod:fn'")
        self.require("split", self.split in ("train", "eval"), "'train' or 'eval'")
        self.require("port", 0 <= self.port < 65536, "an int in [0, 65535]")
