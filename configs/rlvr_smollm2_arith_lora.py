"""GRPO on SmolLM2-135M-Instruct arithmetic with rank-16 LoRA on every projection.

The real-model job of ``rlvr_smollm2_arith`` with only low-rank adapters trained
(docs/LORA.md): the base stays frozen, the optimizer holds adapter moments only, and
each step publishes the adapters (19.5 MB) instead of the whole model (538 MB fp32).

    python launch/tpu_pod.py --config configs/rlvr_smollm2_arith_lora.py --workdir runs/arith_lora

The variant ``lora`` of ``configs/rlvr_smollm2_arith.py`` (``--config
configs/rlvr_smollm2_arith.py:lora``): the same as ``--config.learner.lora.rank=16
--config.learner.lr=5e-5``. QLoRA: ``--config.learner.lora.base_dtype=int8`` (or int4).
The learning rate is 10x full fine-tuning's (LoRA's usual ratio), not calibrated here.
"""

import ml_collections

from configs import rlvr_smollm2_arith


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg  # one variant: this file names it
    return rlvr_smollm2_arith.get_config("lora")
