"""Smoke run: a tiny random-init model of the SmolLM2 architecture, the whole loop.

    python launch/tpu_pod.py --config configs/smoke.py --workdir runs/smoke

About a minute on 2 CPU cores. Same code path as the real job; the model is
random, so it is rewarded for capitalised word pieces (a toy reward with a learning
signal) — it checks plumbing, not arithmetic.

Variant ``async`` (``--config configs/smoke.py:async``, also ``configs/smoke_async.py``):
disjoint slices, learner fsdp 3 x tensor 2 on devices 0-5 + two one-device generation
servers (6 and 7), alpha = 2 (samples up to 2 policy versions old); queue scheduling,
weights published while generation continues. About a minute too.
"""

import ml_collections

from configs import rlvr_smollm2_arith

VARIANTS = (None, "async")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg not in VARIANTS:
        raise ValueError(f"configs/smoke.py: variant {arg!r}, known {VARIANTS}")
    c = rlvr_smollm2_arith.get_config()
    c.total_steps = 3
    c.mesh.num_cpu_devices = 8
    # Colocated: learner fsdp 4 x tensor 2 on all 8 devices, generation on device 0.
    # --config.mesh.colocated=False: learner 3 x 2 on devices 0-5, slices 6 and 7.
    colocated = c.mesh.get_ref("colocated")
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 3 + colocated.to_int(), "tensor": 2})
    c.model.source = "random"
    c.model.preset = "tiny"
    c.model.remat = False
    c.data.eval_size = 8
    c.rollout.prompts_per_step = 4
    c.rollout.group_size = 2
    c.rollout.max_new_tokens = 8
    c.rollout.num_slots = 8
    c.learner.micro_batch_size = 4
    c.learner.lr = 1e-3
    c.eval.every = 2
    # Every step, two kept (35 MB each): the resume and preemption tests rely on it.
    c.checkpoint.every = 1
    c.checkpoint.max_to_keep = 2
    # A random model never solves arithmetic: a dense toy reward gives GRPO a signal.
    c.reward.fn = "uppercase_fraction"
    # A random model rarely emits EOS within 8 tokens: keep truncated samples' rewards
    # (the default penalty would zero every reward and leave nothing to learn).
    c.rollout.truncation = "none"

    if arg == "async":
        c.total_steps = 4
        c.mesh.colocated = False  # learner 3 x 2 on devices 0-5, slices 6 and 7
        c.rollout.async_ratio = 2
        c.eval.every = 4  # at step 0 and the last step
    return c
