"""FLOPs on paper, where XLA's cost analysis cannot count them.

``compiled.cost_analysis()`` counts the body of a ``while`` loop once, whatever its
trip count (checked here: a ``fori_loop`` / ``scan`` of 10 matmuls reports the FLOPs
of one), and nothing inside a Mosaic (Pallas TPU) kernel. The learner step runs its
micro-batches in a ``lax.scan``, its layers in another, and attention in the splash
kernel, so XLA reports about one micro-batch of one layer (tests/sizing/test_tpu_compile.py
measures it). The plan uses these paper FLOPs for the train step's roofline.

Counting (per token, forward): 2 x the weights a token multiplies (every ``w_*``
matrix, routed experts at k / E, the LM head; the embedding lookup is no matmul),
plus causal attention: QK^T and AV over a mean context of (T + 1) / 2 positions,
4 x context x heads x head_dim per layer. Training multiplies the forward by
3 (forward + backward: the backward takes two matmuls per forward one), plus one
forward where ``remat_policy="full"`` recomputes each layer, plus one for the KL
reference model. Sliding-window layers are counted at the full context (an upper
bound). Kaplan et al. (arXiv 2001.08361, 6N per token) and Chinchilla
(arXiv 2203.15556, appendix F) count the same way.
"""

from __future__ import annotations

import jax

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.transformer import abstract_params


def matmul_params(model: ModelConfig) -> float:
    """Weights one token multiplies: every ``w_*`` matrix (routed experts at k / E),
    plus the LM head (the embedding, transposed, when tied)."""
    total = 0.0
    params = abstract_params(model)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["layers"])[0]:
        name = str(path[-1].key)
        if not name.startswith("w_") or name.startswith("w_router"):
            continue
        n = float(leaf.size)
        if model.n_experts and name.endswith(("_ledf", "_lefd")):  # [L, E, ...]: routed
            n *= model.n_experts_per_token / model.n_experts
        total += n
    return total + model.vocab_size * model.d_model


def forward_flops_per_token(model: ModelConfig, context: float) -> float:
    """FLOPs of one token's forward at a mean attention context of ``context`` positions."""
    attention = 4.0 * context * model.n_heads * model.head_dim * model.n_layers
    return 2.0 * matmul_params(model) + attention


def train_step_flops(model: ModelConfig, *, batch: int, seq_len: int, kl: bool = False) -> float:
    """FLOPs of one learner step over [batch, seq_len] (every row full length).

    Args:
      model: its ``remat`` / ``remat_policy`` decide the recompute.
      batch, seq_len: the compiled step's rows and length.
      kl: the KL reference model's forward runs inside the step.
    """
    passes = 3.0 + (1.0 if model.remat and model.remat_policy == "full" else 0.0)
    passes += 1.0 if kl else 0.0
    return passes * batch * seq_len * forward_flops_per_token(model, (seq_len + 1) / 2)
