"""The text-environment protocol, its limits, and checked calls that never crash a caller.

An environment is a gymnasium-style object over text:

    reset(seed) -> observation: str
    step(action_text) -> StepResult(observation, reward, terminated, truncated, info)

``action_text`` is the policy's whole response of one turn (decoded, without the stop
token); the environment parses its action out of it (``<answer>...</answer>``, a tool
call). A response with no valid action gets the environment's documented penalty,
``info["invalid_action"] = True`` and no environment step (ROLL's convention,
arXiv 2510.11345: FrozenLake -0.01, Sokoban -0.15).

Concurrency (decided). ``reset`` and ``step`` are synchronous and may block (sleep,
wait on a subprocess or a socket). Environments hold no threads and no event loop;
the runtime runs each call on a worker (thread or process) under the call's
deadline, ``EnvConfig.step_timeout_s``, so an episode that waits on its environment
never blocks another episode's generation (a blocked ``time.sleep`` or I/O wait
releases the GIL). The token bookkeeping (``envs.episode.Episode``) does no I/O, so
one scheduler thread or event loop can drive any number of episodes; only
environment calls need a worker. A worker that misses the deadline is abandoned
and its environment instance discarded (never reused): the caller records
``StepOutcome.timed_out(...)``.

Failures are data, not exceptions. ``checked_reset`` / ``checked_step`` catch what
an environment raises and validate what it returns (the observation must be a
``str``, the reward a finite real number, the flags booleans); each failure carries
an ``EnvFailureReason``, never a parsed message. The environment is the only party
that can be at fault here: a malformed *action* is the policy's fault and is an
ordinary step (an error observation, a penalty), not a failure.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import time
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np


class EnvOptionError(ValueError):
    """An environment config field with a wrong type or out of its range.

    Attributes:
      config: the config class's name (``FrozenLakeConfig``).
      field: the field (``max_turns``); a run config names it ``env.options.<field>``.
      value: the value given.
      expected: what the field accepts, in words ("an int >= 1").
    """

    def __init__(self, config: str, field: str, value: Any, expected: str) -> None:
        self.config, self.field, self.value, self.expected = config, field, value, expected
        super().__init__(f"{config}.{field} must be {expected}, got {value!r}")


def _type_problem(hint: Any, value: Any) -> str | None:
    """What ``value`` should be for a field annotated ``hint`` (None when it fits).

    bool is not an int here (``max_turns=True`` is a mistake, not 1); an int is a
    fine float; a float must be finite (a NaN would pass every range check below).
    """
    if hint is bool:
        return None if isinstance(value, bool) else "a bool (true/false)"
    if hint is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return None if ok else "an int"
    if hint is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return None if ok and math.isfinite(value) else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a str"
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return None if value in choices and isinstance(value, str) else f"one of {choices}"
    # A new field type must be taught here, or its bad values would pass unchecked.
    raise TypeError(f"EnvConfig: cannot type-check a field annotated {hint!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """Limits every environment has (subclassed by each environment's config).

    Every field is type-checked against its annotation first (``int``, ``float``,
    ``bool``, ``str``, ``Literal[...]``; bool is not an int, an int is a float), then
    range-checked; both raise ``EnvOptionError`` naming the field.

    Attributes:
      max_turns: policy turns per episode (>= 1); the episode is truncated after the
        last one whatever the environment says (``Episode`` enforces it).
      max_tokens_per_turn: response budget of one turn in tokens (>= 1); a turn cut
        off there has no end-of-turn token and usually no parsable action.
      step_timeout_s: deadline of one ``reset`` or ``step`` call in seconds (> 0).
      invalid_action_penalty: reward of a turn whose response holds no valid action
        (<= 0); the environment does not step.
    """

    max_turns: int = 8
    max_tokens_per_turn: int = 128
    step_timeout_s: float = 30.0
    invalid_action_penalty: float = 0.0

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            expected = _type_problem(hints[f.name], getattr(self, f.name))
            if expected is not None:
                raise EnvOptionError(type(self).__name__, f.name, getattr(self, f.name), expected)
        self.require("max_turns", self.max_turns >= 1, "an int >= 1")
        self.require("max_tokens_per_turn", self.max_tokens_per_turn >= 1, "an int >= 1")
        self.require("step_timeout_s", self.step_timeout_s > 0, "a number > 0")
        self.require("invalid_action_penalty", self.invalid_action_penalty <= 0, "a number <= 0")

    def require(self, field: str, ok: bool, expected: str) -> None:
        """Raise ``EnvOptionError`` for ``field`` unless ``ok`` (subclasses' range checks).

        Raises:
          EnvOptionError: naming this config, the field, its value and ``expected``.
        """
        if not ok:
            raise EnvOptionError(type(self).__name__, field, getattr(self, field), expected)


class StepResult(NamedTuple):
    """What ``step`` returns (unpacks like gymnasium's 5-tuple).

    Attributes:
      observation: text shown to the policy next (a new chat message).
      reward: this turn's reward (penalties included).
      terminated: the task ended (solved, failed, answered).
      truncated: the environment cut the episode short (its own step limit).
      info: free-form; keys read by jaxflash: ``invalid_action`` (bool),
        ``success`` (bool, on the last step), ``role`` (chat role of the
        observation message, default ``"user"``), ``turn_rewards`` (on a terminating
        step: the rewards of the episode's earlier turns, in order; an agent's).
    """

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@runtime_checkable
class TextEnv(Protocol):
    """A text environment (see the module docstring for the contract)."""

    config: EnvConfig

    def reset(self, seed: int) -> str: ...

    def step(self, action_text: str) -> StepResult: ...

    def close(self) -> None: ...


class EnvFailureReason(enum.StrEnum):
    """Why an environment call failed (the environment's fault, never the policy's)."""

    RAISED = "raised"  # reset/step raised an exception
    TIMEOUT = "timeout"  # the call did not return within its deadline
    BAD_OBSERVATION = "bad_observation"  # not a str, or a message the chat template rejects
    BAD_REWARD = "bad_reward"  # reward is not a finite real number
    BAD_RESULT = "bad_result"  # not a 5-tuple, flags not bool, info not a mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvFailure:
    """One failed environment call.

    Attributes:
      reason: the failure kind (count by it).
      phase: "reset" or "step".
      detail: human-readable detail (exception text, the offending value's type).
    """

    reason: EnvFailureReason
    phase: str
    detail: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResetOutcome:
    """Result of ``checked_reset``: exactly one of ``observation`` / ``failure`` is set."""

    observation: str | None
    failure: EnvFailure | None
    elapsed_s: float

    @classmethod
    def timed_out(cls, deadline_s: float) -> ResetOutcome:
        """The outcome a runtime records when its worker misses the reset deadline."""
        return cls(observation=None, failure=_timeout("reset", deadline_s), elapsed_s=deadline_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """Result of ``checked_step``: exactly one of ``result`` / ``failure`` is set."""

    result: StepResult | None
    failure: EnvFailure | None
    elapsed_s: float

    @classmethod
    def timed_out(cls, deadline_s: float) -> StepOutcome:
        """The outcome a runtime records when its worker misses the step deadline."""
        return cls(result=None, failure=_timeout("step", deadline_s), elapsed_s=deadline_s)


def _timeout(phase: str, deadline_s: float) -> EnvFailure:
    return EnvFailure(
        reason=EnvFailureReason.TIMEOUT, phase=phase, detail=f"no result within {deadline_s}s"
    )


def _late(phase: str, elapsed_s: float, deadline_s: float | None) -> EnvFailure | None:
    if deadline_s is not None and elapsed_s > deadline_s:
        return EnvFailure(
            reason=EnvFailureReason.TIMEOUT,
            phase=phase,
            detail=f"returned after {elapsed_s:.3f}s > deadline {deadline_s}s",
        )
    return None


def checked_reset(
    env: TextEnv,
    seed: int,
    *,
    deadline_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ResetOutcome:
    """Call ``env.reset(seed)``; an exception or a non-str observation becomes a failure.

    Args:
      env: the environment.
      seed: episode seed (selects the map / level / task).
      deadline_s: a call that returns later than this (seconds) is a TIMEOUT
        failure. This check runs after the call returns; a call that never returns
        needs the caller's worker timeout (then record ``ResetOutcome.timed_out``).
      clock: monotonic seconds (injectable for tests).

    Returns:
      ResetOutcome with the observation, or the failure; ``elapsed_s`` either way.
    """
    start = clock()
    try:
        obs = env.reset(seed)
    except Exception as e:  # noqa: BLE001 -- any environment error is isolated here
        return ResetOutcome(
            observation=None,
            failure=EnvFailure(
                reason=EnvFailureReason.RAISED, phase="reset", detail=f"{type(e).__name__}: {e}"
            ),
            elapsed_s=clock() - start,
        )
    elapsed = clock() - start
    failure = _late("reset", elapsed, deadline_s)
    if failure is None and not isinstance(obs, str):
        failure = EnvFailure(
            reason=EnvFailureReason.BAD_OBSERVATION,
            phase="reset",
            detail=f"observation is {type(obs).__name__}, not str",
        )
    return ResetOutcome(observation=None if failure else obs, failure=failure, elapsed_s=elapsed)


def checked_step(
    env: TextEnv,
    action_text: str,
    *,
    deadline_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StepOutcome:
    """Call ``env.step(action_text)`` and validate the result.

    Args:
      env: the environment.
      action_text: the policy's response text of this turn.
      deadline_s: as in ``checked_reset``.
      clock: monotonic seconds (injectable for tests).

    Returns:
      StepOutcome with a normalised StepResult (reward a Python float, flags bool,
      info a dict), or the failure: RAISED, TIMEOUT, BAD_RESULT (not a 5-tuple,
      non-bool flags, non-mapping info), BAD_OBSERVATION (not a str), BAD_REWARD
      (not a finite real number; bool is not a reward).
    """
    start = clock()
    try:
        raw = env.step(action_text)
    except Exception as e:  # noqa: BLE001 -- any environment error is isolated here
        return StepOutcome(
            result=None,
            failure=EnvFailure(
                reason=EnvFailureReason.RAISED, phase="step", detail=f"{type(e).__name__}: {e}"
            ),
            elapsed_s=clock() - start,
        )
    elapsed = clock() - start
    failure = _late("step", elapsed, deadline_s)
    result = None
    if failure is None:
        result, failure = _validate_step(raw)
    return StepOutcome(result=result, failure=failure, elapsed_s=elapsed)


def _validate_step(raw: Any) -> tuple[StepResult | None, EnvFailure | None]:
    def fail(reason: EnvFailureReason, detail: str) -> tuple[None, EnvFailure]:
        return None, EnvFailure(reason=reason, phase="step", detail=detail)

    if not isinstance(raw, tuple) or len(raw) != 5:
        return fail(
            EnvFailureReason.BAD_RESULT, f"step returned {type(raw).__name__}, not a 5-tuple"
        )
    obs, reward, terminated, truncated, info = raw
    if not isinstance(obs, str):
        return fail(
            EnvFailureReason.BAD_OBSERVATION, f"observation is {type(obs).__name__}, not str"
        )
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return fail(EnvFailureReason.BAD_REWARD, f"reward is {type(reward).__name__}, not a number")
    if not math.isfinite(float(reward)):
        return fail(EnvFailureReason.BAD_REWARD, f"reward is {reward}")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool | int | np.bool_) or flag not in (0, 1):
            return fail(EnvFailureReason.BAD_RESULT, f"{name} is {flag!r}, not a bool")
    if not isinstance(info, Mapping):
        return fail(EnvFailureReason.BAD_RESULT, f"info is {type(info).__name__}, not a mapping")
    return StepResult(obs, float(reward), bool(terminated), bool(truncated), dict(info)), None
