"""Tool-use environment: malformed calls are observations, the sandbox's limits, grading."""

import json

import pytest

from jaxflash.envs.base import checked_reset, checked_step
from jaxflash.envs.chat import TurnRenderer
from jaxflash.envs.episode import Episode, EpisodeEnd
from jaxflash.envs.tool_env import ToolUseConfig, ToolUseEnv, parse_tool_calls, tool_task
from jaxflash.envs.tool_sandbox import ToolLimits, ToolStatus, run_tool
from jaxflash.types import SamplingParams
from tests.envs_fixtures import chatml_tokenizer, text_sample

CFG = ToolUseConfig(max_turns=6, tool_timeout_s=2.0, step_timeout_s=30.0)
CUT_OFF_ARGS = '{"cmd": "ls -la", "path": '  # the pitfall case's cut-off arguments


def call(name, arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# Call 1: arguments cut off (OpenAI form: a JSON string holding the object; and the
# Hermes form: the object inline, so the whole call is cut off). Call 2: valid JSON, not
# an object. Call 3: valid.
MALFORMED_FIRST = {
    "string_arguments": call("python", CUT_OFF_ARGS),
    "inline_arguments": '<tool_call>{"name": "python", "arguments": '
    + CUT_OFF_ARGS
    + "</tool_call>",
}


@pytest.mark.parametrize("first", sorted(MALFORMED_FIRST))
def test_malformed_tool_calls_are_error_observations_and_the_episode_goes_on(first):
    tok = chatml_tokenizer()
    env = ToolUseEnv(CFG)
    ep = Episode(
        TurnRenderer(tok), env.config, prompt_id=0, episode_index=0, env_seed=4,
        start_version=0, max_context_tokens=8192,
    )  # fmt: skip
    value = tool_task(4, CFG)[1]
    replies = [
        MALFORMED_FIRST[first],
        call("python", [1, 2]),
        call("python", {"code": "print(6 * 7)"}),
        f"<answer>{value}</answer>",
    ]
    ep.begin(checked_reset(env, 4))
    for reply in replies:
        req = ep.next_request(SamplingParams(temperature=1.0))
        ep.record_step(checked_step(env, ep.record_turn(text_sample(tok, req, reply))))
    traj = ep.trajectory()
    assert traj.end == EpisodeEnd.TERMINATED and traj.failure is None  # no infrastructure failure
    assert traj.success and traj.turn_rewards[-1] == 1.0
    assert env.executions == 1  # the tool ran exactly once
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 3
    assert tool_msgs[0].startswith("[call 1] error: ") and "not valid JSON" in tool_msgs[0]
    assert tool_msgs[1] == "[call 2] error: arguments must be a JSON object, got list"
    assert tool_msgs[2] == "[call 3] python output:\n42"
    errors = [m for m in tool_msgs if "error" in m]
    assert len(errors) == 2
    # Malformed turns are invalid actions (penalty), the executed one is not.
    assert [t.invalid_action for t in traj.turns] == [True, True, False, False]
    assert traj.turn_rewards.tolist() == pytest.approx([-0.1, -0.1, 0.0, 1.0])
    # The tool output went into the context through the template, with mask 0.
    text = tok.decode(traj.response_tokens.tolist())
    assert "<|im_start|>tool\n[call 3] python output:\n42<|im_end|>" in text


def test_parse_tool_calls_kinds():
    got = parse_tool_calls(
        call("calculator", {"expression": "1+1"})
        + call("shell", {"cmd": "ls"})
        + call("python", {"source": "x"})
        + '<tool_call>{"name": "python"}</tool_call>'
        + '<tool_call>{"name": "python", "arguments": {"code": "print(1'
    )
    assert got[0].error is None and got[0].args == {"expression": "1+1"}
    assert "unknown tool 'shell'" in got[1].error
    assert got[2].error == "python needs a string argument 'code'"
    assert "must be" in got[3].error
    assert got[4].error == "unclosed <tool_call> (the call was cut off)"
    assert parse_tool_calls("no calls, <answer>3</answer>") == []


def test_answers_invalid_turns_and_call_limits():
    env = ToolUseEnv(ToolUseConfig(max_calls_per_turn=1, tool_timeout_s=2.0, step_timeout_s=30))
    env.reset(0)
    value = tool_task(0, env.config)[1]
    r = env.step("I think it is large.")
    assert r.reward == -0.1 and r.info["invalid_action"] and not r.terminated
    r = env.step(call("calculator", {"expression": "2 * 21"}) + call("python", {"code": "1"}))
    assert r.observation == (
        "[call 1] calculator output:\n42\n[call 2] error: more than 1 calls in one turn"
    )
    assert r.reward == 0.0 and env.executions == 1
    r = env.step(f"<answer>{value + 1}</answer>")
    assert r.terminated and r.reward == 0.0 and not r.info["success"]
    env.reset(0)
    assert env.step(f"<answer>{value:,}</answer>").info["success"]
    with pytest.raises(RuntimeError, match="ended"):
        env.step("<answer>1</answer>")


def test_tasks_deterministic_and_splits_disjoint():
    train = {tool_task(i, CFG)[0] for i in range(300)}
    held = {tool_task(i, ToolUseConfig(split="eval"))[0] for i in range(300)}
    assert train.isdisjoint(held)
    expr, value = tool_task(7, CFG)
    assert eval(expr) == value and tool_task(7, CFG) == (expr, value)  # noqa: S307


@pytest.mark.parametrize(
    "tool, args, status, text",
    [
        ("python", {"code": "import math\nprint(math.factorial(10))"}, ToolStatus.OK, "3628800"),
        ("calculator", {"expression": "2 ** 10 - sqrt(16)"}, ToolStatus.OK, "1020.0"),
        ("python", {"code": "print(1 / 0)"}, ToolStatus.ERROR, "ZeroDivisionError"),
        ("python", {"code": "open('/etc/passwd')"}, ToolStatus.ERROR, "NameError"),
        ("python", {"code": "import os"}, ToolStatus.ERROR, "not allowed"),
        ("python", {"code": "x = [0] * 10**9"}, ToolStatus.ERROR, "MemoryError"),
        ("calculator", {"expression": "__import__('os')"}, ToolStatus.ERROR, "unsupported"),
        ("python", {"code": "while True:\n    pass"}, ToolStatus.TIMEOUT, "timed out"),
    ],
)
def test_sandbox_limits(tool, args, status, text):
    # 0.5 s only where the timeout is the point: a loaded machine can take longer than
    # that to start a sandboxed interpreter (bwrap + python) for the other cases.
    timeout_s = 0.5 if status == ToolStatus.TIMEOUT else 20.0
    result = run_tool(tool, args, ToolLimits(timeout_s=timeout_s, memory_mb=128))
    assert result.status == status
    assert text in (result.output if status == ToolStatus.OK else result.error)


def test_sandbox_output_is_cut():
    result = run_tool("python", {"code": "print('x' * 100)"}, ToolLimits(max_output_chars=16))
    assert result.output == "x" * 16 + "... [cut at 16 chars]"
