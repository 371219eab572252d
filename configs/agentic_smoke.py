"""Agentic smoke run: a tiny random-init model plays FrozenLake, the whole loop.

    python launch/tpu_pod.py --config configs/agentic_smoke.py --workdir runs/agentic_smoke

About a minute on 2 CPU cores (45 s after the imports). Same code path as
configs/agentic_frozenlake.py (``runtime.loop`` with the environment manager); a
random model rarely writes a
valid ``<answer>`` so most turns are invalid actions (penalty -0.01) -- it checks
plumbing (episodes, masks, redundancy, counters), not learning. Asynchronous on
disjoint slices with ``--config.mesh.colocated=False --config.rollout.async_ratio=1``.
"""

import ml_collections

from configs import agentic_frozenlake


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = agentic_frozenlake.get_config()
    c.total_steps = 2
    c.mesh.num_cpu_devices = 8
    colocated = c.mesh.get_ref("colocated")
    # Colocated: learner fsdp 4 x tensor 2 on all 8 devices; disjoint: 3 x 2 + 2 slices.
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 3 + colocated.to_int(), "tensor": 2})
    c.model.source = "random"
    c.model.preset = "tiny"
    c.model.remat = False
    c.env.options = '{"size": 3, "max_turns": 2, "max_tokens_per_turn": 8}'
    c.env.max_context_tokens = 256
    c.env.eval_seeds = 4
    c.rollout.prompts_per_step = 2
    c.rollout.group_size = 2
    c.rollout.group_redundancy = 1  # 3 episodes per group, the first 2 kept
    c.rollout.num_slots = 8
    c.learner.lr = 1e-3
    c.eval.every = 2
    c.eval.samples_per_prompt = 1
    return c
