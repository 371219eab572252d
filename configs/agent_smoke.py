"""Agent smoke run: a tiny random-init model behind the OpenAI-compatible endpoint, the
tool-calling math agent of ``configs/agent_math_tools.py`` driving it, the whole loop.

    python launch/tpu_pod.py --config configs/agent_smoke.py --workdir runs/agent_smoke \
        --config.mesh.colocated=False --config.rollout.async_ratio=1

A random model never writes a valid tool call or the right number: this checks the
plumbing (sessions, recorded ids, masks, counters), not learning.
"""

import json

import ml_collections

from configs import agent_math_tools


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = agent_math_tools.get_config()
    c.total_steps = 2
    c.mesh.num_cpu_devices = 8
    colocated = c.mesh.get_ref("colocated")
    # Colocated: learner fsdp 4 x tensor 2 on all 8 devices; disjoint: 3 x 2 + 2 slices.
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 3 + colocated.to_int(), "tensor": 2})
    c.model.source = "random"
    c.model.preset = "tiny"
    c.model.remat = False
    c.env.options = json.dumps(
        {**agent_math_tools.AGENT_OPTIONS, "max_turns": 2, "max_tokens_per_turn": 8,
         "step_timeout_s": 60.0}
    )  # fmt: skip
    c.env.max_context_tokens = 512
    c.env.eval_seeds = 2
    c.rollout.prompts_per_step = 2
    c.rollout.group_size = 2
    c.rollout.group_redundancy = 1
    c.rollout.num_slots = 8
    c.rollout.temperature = 1.0
    c.learner.lr = 1e-3
    c.eval.every = 2
    c.eval.temperature = 1.0
    return c
