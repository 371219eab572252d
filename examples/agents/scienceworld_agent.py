"""A ScienceWorld agent over the stock ``openai`` client: it drives the simulator itself.

What a user with a ScienceWorld agent would write: the agent owns the simulator (here
jaxflash's pooled wrapper, ``jaxflash.envs.scienceworld``: the same task subset,
split, action parsing and partial-credit reward as the built-in environment, and its
JVMs reused across episodes), shows the model each observation as a user message
(after a system line and one example exchange), asks
``client.chat.completions.create`` for the next action and steps the simulator
with the reply, until the task ends or ``MAX_TURNS`` actions were taken. Reward: the
score the episode's actions earned, /100, one reward per model turn (its score
change; ``AgentResult.turn_rewards``), so step-level advantages work too.

A simulator failure (a JVM that crashed or hung past the wrapper's watchdog) raises
out of the agent: the episode fails as ``raised``, counted, and the run goes on.

Config: ``configs/agent_scienceworld.py`` (``env.name = "agent"``).
"""

from __future__ import annotations

from jaxflash.envs.agent_contract import AgentResult, AgentTask
from jaxflash.envs.scienceworld import ScienceWorldConfig, ScienceWorldEnv

MAX_TURNS = 6
"""Actions per episode (the config's ``max_turns`` must allow as many requests)."""

MAX_TOKENS = 16
"""Response budget of one action (3-8 tokens)."""

SYSTEM = "You play a text adventure. Reply with exactly one action, a few words, nothing else."

# One short example exchange before the episode: the agent's own prompt design. On
# SmolLM2-135M-Instruct it turns prose replies into actions ("go to kitchen") in about
# half the samples; without it none of 8 samples was an action (docs/RESULTS.md).
EXAMPLE = [
    {
        "role": "user",
        "content": "This room is called the hallway. You also see:\n\t"
        "A door to the kitchen (that is open)",
    },
    {"role": "assistant", "content": "go to kitchen"},
    {"role": "user", "content": "You move to the kitchen."},
    {"role": "assistant", "content": "look around"},
]


def tasks(seed: int, split: str) -> dict:
    """Episode group ``seed``: the seed of the simulator's (task, variation) of ``split``."""
    return {"seed": seed, "split": split}


def solve(client, task: AgentTask) -> AgentResult:
    """Play one ScienceWorld episode; the model picks every action."""
    env = ScienceWorldEnv(ScienceWorldConfig(split=task.data["split"], max_turns=MAX_TURNS))
    try:
        first = {"role": "user", "content": env.reset(task.data["seed"])}
        messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, first]
        rewards, info = [], {}
        for _ in range(MAX_TURNS):
            reply = client.chat.completions.create(
                model=task.model, messages=messages, max_tokens=MAX_TOKENS
            )
            action = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": action})
            result = env.step(action)
            rewards.append(result.reward)
            info = result.info
            if result.terminated:
                break
            messages.append({"role": "user", "content": result.observation})
    finally:
        env.close()
    return AgentResult(
        reward=sum(rewards),
        turn_rewards=rewards,
        metrics={
            "score": float(max(info.get("score", 0), 0)),
            "success": float(bool(info.get("success", False))),
            "invalid_actions": float(sum(1 for r in rewards if r < 0)),
        },
    )
