"""A tool-calling math agent over the stock ``openai`` client; its python tool runs in
jaxflash's bubblewrap sandbox (``jaxflash.envs.tool_sandbox``, docs/SANDBOX.md).

The agent is what a user would write: a loop of ``client.chat.completions.create``
with an OpenAI ``tools`` list; each tool call is executed and its result sent back as
a ``tool`` message; the episode ends when the model answers without a tool call (or
after ``MAX_CALLS`` rounds). Reward: 1.0 when the last reply holds the right integer,
else 0.0 (``success`` alike). The tasks are ``envs.tool_env.tool_task``'s
(``a * b +- c`` with 3-4 digit operands: hard in the head, easy with the tool).

Config: ``configs/agent_math_tools.py`` (``env.name = "agent"``); docs/AGENTS.md.
"""

from __future__ import annotations

import json
import re

from jaxflash.envs.agent_contract import AgentResult, AgentTask
from jaxflash.envs.tool_env import ToolUseConfig, tool_task
from jaxflash.envs.tool_sandbox import ToolLimits, run_tool

MAX_CALLS = 3
"""Tool rounds before the agent stops asking."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and return what it printed.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python code"}},
                "required": ["code"],
            },
        },
    }
]

SYSTEM = (
    "Solve the arithmetic problem. You may call the python tool to compute. "
    "End with the final answer as a plain integer."
)

LIMITS = ToolLimits(timeout_s=5.0, memory_mb=256, max_output_chars=500)


def tasks(seed: int, split: str) -> dict:
    """Task ``seed`` of ``split``: the expression and its value."""
    expr, value = tool_task(seed, ToolUseConfig(split=split))
    return {"question": f"What is {expr}?", "answer": value}


def run_python(arguments: str) -> str:
    """One python tool call in the sandbox; errors are the model's, shown as text."""
    try:
        args = json.loads(arguments)
        code = args["code"] if isinstance(args, dict) else None
    except (json.JSONDecodeError, KeyError):
        code = None
    if not isinstance(code, str):
        return 'error: call python with {"code": "<python source>"}'
    result = run_tool("python", {"code": code}, LIMITS)
    return result.output if result.error is None else f"{result.status}: {result.error}"


def final_integer(text: str | None) -> int | None:
    """The last integer in a reply (None when there is none)."""
    found = re.findall(r"-?\d[\d,]*", text or "")
    return int(found[-1].replace(",", "")) if found else None


def solve(client, task: AgentTask) -> AgentResult:
    """The agent: ask, run the tool calls, repeat; reward 1 for the right integer."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.data["question"]},
    ]
    calls = 0
    for _ in range(MAX_CALLS + 1):
        reply = client.chat.completions.create(
            model=task.model, messages=messages, tools=TOOLS, max_tokens=128
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            calls += 1
            output = run_python(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    right = final_integer(messages[-1].get("content")) == task.data["answer"]
    return AgentResult(reward=float(right), metrics={"tool_calls": calls})
