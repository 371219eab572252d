"""Agents for the endpoint tests, named ``tests.runtime.agents.scripted_agents:<fn>``.

Each is written against the stock ``openai`` client, as a user's agent would be.
"""

from __future__ import annotations

import json
import os
import time

import openai

from jaxflash.envs.agent_contract import AgentResult

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
]

SEEN: dict[str, list] = {}
"""session_id -> the replies the agent saw (choices[0] as dicts), for assertions."""


def tasks(seed: int, split: str) -> dict:
    return {"question": f"task {seed} of {split}", "seed": seed}


def two_turns(client: openai.OpenAI, task) -> AgentResult:
    """Two requests (the second echoes the first reply and adds a tool result); reward
    = the seed, so sessions that mixed would show."""
    messages = [{"role": "user", "content": task.data["question"]}]
    seen = SEEN.setdefault(task.session_id, [])
    for turn in range(2):
        reply = client.chat.completions.create(
            model=task.model, messages=messages, tools=TOOLS, max_tokens=16, logprobs=True
        )
        seen.append(reply.choices[0].model_dump())
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "c0", "content": f"out {turn}"})
    return AgentResult(reward=float(task.data["seed"]), metrics={"turns": 2.0})


async def two_turns_async(client: openai.AsyncOpenAI, task) -> float:
    messages = [{"role": "user", "content": task.data["question"]}]
    for _ in range(2):
        reply = await client.chat.completions.create(model=task.model, messages=messages)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "again"})
    return 0.5


def edits_echo(client: openai.OpenAI, task) -> float:
    """Echoes an edited assistant message: counted, the recorded ids are kept."""
    messages = [{"role": "user", "content": task.data["question"]}]
    client.chat.completions.create(model=task.model, messages=messages)
    messages.append({"role": "assistant", "content": "an edit the model never sampled"})
    messages.append({"role": "user", "content": "go on"})
    client.chat.completions.create(model=task.model, messages=messages)
    return 1.0


def raises(client: openai.OpenAI, task) -> float:
    client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent's own bug")


def hangs(client: openai.OpenAI, task) -> float:
    client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "hi"}])
    time.sleep(3600)
    return 0.0


def malformed(client: openai.OpenAI, task) -> float:
    """A request with a bad role: the client raises BadRequestError (OpenAI's body)."""
    try:
        client.chat.completions.create(
            model=task.model, messages=[{"role": "wizard", "content": "hi"}]
        )
    except openai.BadRequestError as e:
        SEEN.setdefault("malformed", []).append(e.body)
        raise
    return 0.0


def rewrites_history(client: openai.OpenAI, task) -> float:
    client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "a"}])
    client.chat.completions.create(
        model=task.model,
        messages=[{"role": "user", "content": "b"}, {"role": "user", "content": "c"}],
    )
    return 0.0


def bad_return(client: openai.OpenAI, task) -> str:
    client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "a"}])
    return "not a reward"


CALLS = {"n": 0}
BROKEN_TASK = 4
"""``two_turns_flaky`` raises at once on this task, in every session: its group fails."""


def two_turns_flaky(client: openai.OpenAI, task) -> float:
    """``two_turns`` with faults by call number (every 5th raises, every 7th sends a
    malformed request). Tasks 2 and 3 (admitted at version 0, alpha 1) wait after their
    first turn until step 1 is written to ``$AGENT_TEST_WORKDIR/metrics.jsonl`` (after the
    publish): their second turn runs under version 1. Task ``BROKEN_TASK`` (admitted
    after step 1) fails every session before its first request."""
    if task.seed == BROKEN_TASK:
        raise RuntimeError(f"task {task.seed} is broken")
    CALLS["n"] += 1
    n = CALLS["n"]
    if n % 5 == 0:
        raise RuntimeError("flaky agent")
    if n % 7 == 0:
        client.chat.completions.create(model=task.model, messages=[{"role": "x"}])
    messages = [{"role": "user", "content": task.data["question"]}]
    seen = SEEN.setdefault(task.session_id, [])
    for turn in range(2):
        reply = client.chat.completions.create(model=task.model, messages=messages)
        seen.append(reply.choices[0].model_dump())
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"turn {turn} done"})
        if turn == 0 and task.seed in (2, 3):
            _wait_for_step_1()
    return float(task.seed % 2)


def _wait_for_step_1(timeout_s: float = 40.0) -> None:
    path = os.path.join(os.environ["AGENT_TEST_WORKDIR"], "metrics.jsonl")
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if os.path.exists(path) and any(
            json.loads(line).get("step", 0) >= 1 for line in open(path) if line.strip()
        ):
            time.sleep(0.3)  # the row is written after the publish
            return
        time.sleep(0.2)


def cut_short(client: openai.OpenAI, task) -> float:
    """Asks for at most 3 tokens (the turn is cut at ``max_tokens``), then goes on with a
    user message: the template's closing of that turn is added between the turns."""
    messages = [{"role": "user", "content": task.data["question"]}]
    seen = SEEN.setdefault(task.session_id, [])
    reply = client.chat.completions.create(model=task.model, messages=messages, max_tokens=3)
    seen.append(reply.choices[0].model_dump())
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "go on"})
    reply = client.chat.completions.create(model=task.model, messages=messages)
    seen.append(reply.choices[0].model_dump())
    return 1.0
