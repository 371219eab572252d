"""Bring your own agent: a ScienceWorld agent written against the stock ``openai`` client,
trained through the run's OpenAI-compatible endpoint (``env.name = "agent"``).

The agent (``examples/agents/scienceworld_agent.py``) drives the ScienceWorld simulator
itself and asks the policy for each action with ``client.chat.completions.create``;
jaxflash records the ids the engine sampled for every request of the session and
trains on them with the agent's per-turn rewards (the score change /100). Same tasks,
split, turn budget, model and learner as ``configs/agentic_scienceworld.py`` (the
built-in environment), so the two runs are comparable.

Launch (from the repo root), asynchronous on disjoint slices (alpha = 1):

    python launch/tpu_pod.py --config configs/agent_scienceworld.py --workdir runs/sw_agent \
        --config.mesh.colocated=False --config.rollout.async_ratio=1

Needs ``pip install 'jaxflash[scienceworld,agents]'`` (``make env``) and Java >= 11.
The curve of a short run: docs/RESULTS.md ("ScienceWorld").
"""

import ml_collections

from configs import agentic_scienceworld

VARIANTS = agentic_scienceworld.VARIANTS


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = agentic_scienceworld.get_config(arg)
    c.env.name = "agent"
    # max_turns = the agent's MAX_TURNS, max_tokens_per_turn its MAX_TOKENS; the
    # deadline covers a simulator step (and a JVM start) between two requests.
    c.env.options = (
        '{"agent": "examples.agents.scienceworld_agent:solve", '
        '"tasks": "examples.agents.scienceworld_agent:tasks", '
        '"max_turns": 6, "max_tokens_per_turn": 16, "step_timeout_s": 120.0}'
    )
    return c
