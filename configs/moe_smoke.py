"""MoE smoke run: a tiny random-init Qwen3-MoE (8 experts, top-2), the whole loop.

    python launch/tpu_pod.py --config configs/moe_smoke.py --workdir runs/moe_smoke

configs/smoke.py with the ``tiny_moe`` preset: the engine routes tokens while it
samples, the learner step adds the router load-balancing loss (metric
``router_aux_loss``) and its experts are split over the ``expert`` mesh axis
(colocated: fsdp 2 x expert 4 on 8 CPU devices, 2 of the 8 experts per device;
``--config.mesh.colocated=False``: fsdp 3 x expert 2 on devices 0-5, generation
slices 6 and 7). It checks plumbing, not learning (the model is random). For a real
Qwen3-MoE checkpoint: ``--config.model.source=hf --config.model.path=DIR``.
"""

import ml_collections

from configs import smoke


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = smoke.get_config()
    c.total_steps = 2
    colocated = c.mesh.get_ref("colocated")
    c.mesh.learner = ml_collections.ConfigDict(
        {"fsdp": 3 - colocated.to_int(), "expert": 2 + 2 * colocated.to_int()}
    )
    c.model.preset = "tiny_moe"
    # Switch-style load balancing (arXiv 2101.03961) on the trained tokens; 0 = off.
    c.learner.router_aux_loss_coef = 0.01
    return c
