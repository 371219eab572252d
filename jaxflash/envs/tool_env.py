"""A tool-use environment: arithmetic the policy may compute with sandboxed tools.

Task ``seed`` of a split asks for the value of an expression such as
``4821 * 377 - 1290`` (deterministic in (seed, split); train and eval never share
an expression, by hashing as in ``frozenlake``). Each turn the policy either calls
tools or answers:

- ``<tool_call>{"name": "python", "arguments": {"code": "print(4821*377-1290)"}}</tool_call>``
  (``arguments`` may also be a JSON *string* holding the object, as in OpenAI's
  format; tools: ``python``, ``calculator``, see ``tool_sandbox``). Every call of
  the turn is numbered across the episode (``[call n]``) and its result or its
  error is in the next observation (role ``"tool"``). A malformed call -- body or
  arguments not valid JSON (e.g. cut off), arguments not an object (e.g. ``[1, 2]``),
  an unknown tool, a missing argument -- is an error message for that call and the
  episode goes on; it is the policy's mistake, never an environment failure. A turn
  whose calls are all malformed counts as an invalid action (penalty).
- ``<answer>N</answer>``: ends the episode; reward ``correct_reward`` when N equals
  the value, else 0.
- neither: an invalid action, ``invalid_action_penalty`` (-0.1, our choice; ROLL
  sets none for tools) and a reminder of the format.

Tool executions are counted in ``executions`` (tests check a tool ran exactly once),
and how each ended in ``outcomes`` (the sandbox's ``Outcome``: ok, error, timeout,
memory, output_too_long, ...; also per turn in ``info["tool_outcomes"]``). Tools run
in the bubblewrap sandbox of model-written code (``tool_sandbox``); where it cannot
start, building the environment fails with one line saying why, unless
``allow_unsandboxed`` (which runs model code without isolation) is set.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
from typing import Any, Literal

import numpy as np

from jaxflash.envs.actions import parse_answer
from jaxflash.envs.base import EnvConfig, StepResult
from jaxflash.envs.tool_sandbox import (
    TOOL_NAMES,
    ToolLimits,
    ToolStatus,
    run_tool,
    tool_sandbox,
)

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARG_KEY = {"python": "code", "calculator": "expression"}
_SPLIT_STREAM = {"train": 0, "eval": 1}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolUseConfig(EnvConfig):
    """Tool environment knobs (plus the common limits of ``EnvConfig``).

    Attributes:
      min_digits, max_digits: digits of each of the three operands (1..9).
      split, eval_fraction: task split, as in ``FrozenLakeConfig``.
      tool_timeout_s, tool_memory_mb, max_output_chars: ``ToolLimits`` of one call.
      max_calls_per_turn: calls beyond this in one turn are refused with a message.
      allow_unsandboxed: where bubblewrap cannot start, run tool code WITHOUT
        isolation (it could read files, use the network and signal processes).
      correct_reward: reward of a correct answer.
      invalid_action_penalty: -0.1.
    """

    max_turns: int = 4
    max_tokens_per_turn: int = 200
    invalid_action_penalty: float = -0.1
    min_digits: int = 3
    max_digits: int = 4
    split: Literal["train", "eval"] = "train"
    eval_fraction: float = 0.2
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 256
    max_output_chars: int = 2000
    max_calls_per_turn: int = 4
    correct_reward: float = 1.0
    allow_unsandboxed: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("min_digits", 1 <= self.min_digits <= 9, "an int in [1, 9]")
        self.require(
            "max_digits",
            self.min_digits <= self.max_digits <= 9,
            f"an int in [min_digits={self.min_digits}, 9]",
        )
        self.require("eval_fraction", 0.0 < self.eval_fraction < 1.0, "a number in (0, 1)")
        self.require("max_calls_per_turn", self.max_calls_per_turn >= 1, "an int >= 1")
        self.require(
            "step_timeout_s",
            self.step_timeout_s > self.tool_timeout_s * self.max_calls_per_turn,
            "a number > tool_timeout_s * max_calls_per_turn = "
            f"{self.tool_timeout_s * self.max_calls_per_turn}",
        )
        # ToolLimits' own bounds, named by this config's fields (then its own check).
        self.require("tool_timeout_s", self.tool_timeout_s > 0, "a number > 0")
        self.require("tool_memory_mb", self.tool_memory_mb >= 64, "an int >= 64")
        self.require("max_output_chars", self.max_output_chars >= 16, "an int >= 16")
        ToolLimits(**self.sandbox_kwargs())

    def sandbox_kwargs(self) -> dict[str, Any]:
        return dict(
            timeout_s=self.tool_timeout_s,
            memory_mb=self.tool_memory_mb,
            max_output_chars=self.max_output_chars,
            allow_unsandboxed=self.allow_unsandboxed,
        )


def tool_task(index: int, config: ToolUseConfig) -> tuple[str, int]:
    """(expression, value) of task ``index`` of ``config.split``; deterministic.

    Raises:
      ValueError: negative index.
    """
    if index < 0:
        raise ValueError(f"tool_task: index must be >= 0, got {index}")
    rng = np.random.default_rng([index, _SPLIT_STREAM[config.split], 7])
    while True:  # ~1 / (1 - eval_fraction) draws on average
        digits = rng.integers(config.min_digits, config.max_digits + 1, size=3)
        a, b, c = (int(rng.integers(10 ** (d - 1), 10**d)) for d in digits)
        op = "+" if rng.random() < 0.5 else "-"
        expr = f"{a} * {b} {op} {c}"
        h = hashlib.blake2b(expr.encode(), digest_size=8).digest()
        if (int.from_bytes(h, "big") / 2.0**64 < config.eval_fraction) == (config.split == "eval"):
            return expr, a * b + c if op == "+" else a * b - c


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One ``<tool_call>`` of a turn: a tool and arguments, or the error to report."""

    name: str | None
    args: dict[str, str] | None
    error: str | None


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>`` of a response, in order (an unclosed last one included)."""
    bodies = _CALL_RE.findall(text)
    end = "</tool_call>"
    tail = text[text.rfind(end) + len(end) :] if bodies else text
    if "<tool_call>" in tail:  # cut off before its closing tag
        bodies.append(None)
    return [_parse_call(body) for body in bodies]


def _parse_call(body: str | None) -> ParsedCall:
    if body is None:
        return ParsedCall(None, None, "unclosed <tool_call> (the call was cut off)")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ParsedCall(None, None, f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        return ParsedCall(None, None, 'a tool call must be {"name": ..., "arguments": {...}}')
    name = call["name"]
    if name not in TOOL_NAMES:
        return ParsedCall(None, None, f"unknown tool {name!r}; tools are {', '.join(TOOL_NAMES)}")
    args = call["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ParsedCall(name, None, f"arguments are not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(args, dict):
        return ParsedCall(name, None, f"arguments must be a JSON object, got {type(args).__name__}")
    key = _ARG_KEY[name]
    if not isinstance(args.get(key), str):
        return ParsedCall(name, None, f"{name} needs a string argument {key!r}")
    return ParsedCall(name, {key: args[key]}, None)


class ToolUseEnv:
    """Arithmetic with sandboxed tools; ``reset(seed)`` poses task ``seed`` of the split.

    Raises:
      RuntimeError: bubblewrap cannot start here and ``config.allow_unsandboxed`` is
        False (the message is the sandbox's one-line check).
    """

    def __init__(self, config: ToolUseConfig | None = None) -> None:
        self.config = config or ToolUseConfig()
        self._limits = ToolLimits(**self.config.sandbox_kwargs())
        check = tool_sandbox(self.config.allow_unsandboxed).check()
        if not check.ok and not self.config.allow_unsandboxed:
            raise RuntimeError(f"{check.line} (env option allow_unsandboxed)")
        self.outcomes: collections.Counter[str] = collections.Counter()
        self._value: int | None = None
        self._done = False
        self._calls = 0
        self.executions = 0

    def reset(self, seed: int) -> str:
        expr, self._value = tool_task(seed, self.config)
        self._calls, self._done = 0, False
        return (
            f"What is {expr}? You may call tools before answering. Call one with "
            '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call> '
            '(python prints results) or <tool_call>{"name": "calculator", "arguments": '
            '{"expression": "1 + 1"}}</tool_call>; results come back in the next message. '
            "When you know the value, reply <answer>the integer</answer>."
        )

    def step(self, action_text: str) -> StepResult:
        if self._value is None:
            raise RuntimeError("ToolUseEnv: call reset(seed) first")
        if self._done:
            raise RuntimeError("ToolUseEnv: step after the episode ended; call reset")
        cfg = self.config
        calls = parse_tool_calls(action_text)
        if calls:
            lines, executed, errors = [], 0, 0
            outcomes: collections.Counter[str] = collections.Counter()
            for i, call in enumerate(calls):
                self._calls += 1
                tag = f"[call {self._calls}]"
                if i >= cfg.max_calls_per_turn:
                    lines.append(
                        f"{tag} error: more than {cfg.max_calls_per_turn} calls in one turn"
                    )
                    errors += 1
                    continue
                if call.error is not None:
                    lines.append(f"{tag} error: {call.error}")
                    errors += 1
                    continue
                result = run_tool(call.name, call.args, self._limits)
                self.executions += 1
                executed += 1
                outcomes[result.outcome.value] += 1
                if result.status == ToolStatus.OK:
                    lines.append(f"{tag} {call.name} output:\n{result.output.rstrip()}")
                else:
                    lines.append(f"{tag} {call.name} {result.status.value}: {result.error}")
                    if result.output:
                        lines.append(result.output.rstrip())
            invalid = executed == 0
            info = {
                "invalid_action": invalid,
                "role": "tool",
                "tool_calls": len(calls),
                "tool_errors": errors,
                "tool_executions": executed,
                "tool_outcomes": dict(outcomes),
            }
            self.outcomes.update(outcomes)
            reward = float(cfg.invalid_action_penalty) if invalid else 0.0
            return StepResult("\n".join(lines), reward, False, False, info)
        answer = parse_answer(action_text)
        if answer is None:
            obs = (
                "Invalid action: call a tool with <tool_call>...</tool_call> or reply "
                "<answer>the integer</answer>."
            )
            return StepResult(
                obs, float(cfg.invalid_action_penalty), False, False, {"invalid_action": True}
            )
        try:
            correct = int(answer.replace(",", "").strip()) == self._value
        except ValueError:
            correct = False
        reward = cfg.correct_reward if correct else 0.0
        self._done = True
        obs = "Correct." if correct else "Wrong answer."
        return StepResult(
            obs,
            float(reward),
            True,
            False,
            {"invalid_action": False, "success": correct, "answer": answer},
        )

    def close(self) -> None:
        self._value = None
