"""One decoder block of every supported family: attention (``models.layer_attention``)
and the MLP (SwiGLU, GeGLU or routed experts), with the pre/post norms and residuals
each family's ``ModelConfig`` asks for. ``models.llama.forward`` runs the stack of them.

Dimension letters as in ``models.llama``. References: RMSNorm (arXiv 1910.07467),
SwiGLU / GeGLU (arXiv 2002.05202), RoPE (arXiv 2104.09864).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.models import lora
from jaxflash.models.config import ModelConfig
from jaxflash.models.layer_attention import layer_attention
from jaxflash.models.moe import moe_mlp
from jaxflash.models.rope import apply_rope
from jaxflash.models.swiglu import swiglu


def rms_norm(x_btd: jax.Array, w_d: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x / sqrt(mean(x²) + eps) * (offset + w), in float32 over the last axis.

    ``offset`` is ``ModelConfig.norm_offset``: 0 (Llama, Qwen) or 1 (Gemma's (1 + w)).
    """
    x = x_btd.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    w = w_d.astype(jnp.float32)
    return x * (offset + w if offset else w)


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _gelu_tanh_mlp(x_btd, w_gate_df, w_up_df, w_down_fd):
    """GeGLU MLP (Gemma): (gelu_tanh(x W_gate) * (x W_up)) W_down, float32 [B, T, D]."""
    gate_btf = jnp.einsum("btd,df->btf", x_btd, w_gate_df)
    up_btf = jnp.einsum("btd,df->btf", x_btd, w_up_df)
    act_btf = jax.nn.gelu(gate_btf, approximate=True) * up_btf
    return jnp.einsum("btf,fd->btd", act_btf, w_down_fd, preferred_element_type=jnp.float32)


def _by_layer_type(sliding, local_value, full_value):
    """``local_value`` on a sliding layer, else ``full_value``; ``sliding`` is a Python
    bool (unrolled layers, or all layers alike) or a traced bool (mixed layers in the
    scan), where both values are computed and one is selected."""
    if isinstance(sliding, bool):
        return local_value() if sliding else full_value()
    return jnp.where(sliding, local_value(), full_value())


def decoder_layer(
    config: ModelConfig,
    h_btd,
    lp,
    positions_bt,
    cache_k,
    cache_v,
    layer_cache=False,
    sliding: bool | jax.Array = False,
    segment_ids_bt=None,
    fresh=False,
):
    """One decoder block; returns (h_btd, (k cache layer, v cache layer) or (None, None),
    router logits float32 [B, T, E] or None for a dense MLP).

    The cache layer is [B, S, K, H] for both (a ``KVCache`` slice) or, with
    ``layer_cache``, keys [B, K, S, H] and values [B, K, H, S] (``LayerKVCache``).
    ``sliding``: this layer attends within ``config.sliding_window`` and uses
    ``config.rope_local_theta`` (a bool, or a traced bool inside the layer scan).
    ``segment_ids_bt``: packed segments of a cache-free pass (``forward``).
    ``fresh``: the cache is fresh (``forward``'s ``fresh_cache``). Attention itself is
    ``models.layer_attention``.
    """
    cd, eps, off = config.jnp_compute_dtype, config.rms_norm_eps, config.norm_offset

    def w(name):
        return lp[name].astype(cd)

    x_btd = rms_norm(h_btd, lp["attn_norm_ld"], eps, off).astype(cd)
    q_btnh = lora.add_delta(
        jnp.einsum("btd,dnh->btnh", x_btd, w("w_q_ldnh")), x_btd, lp, "w_q_ldnh"
    )
    k_btkh = lora.add_delta(
        jnp.einsum("btd,dkh->btkh", x_btd, w("w_k_ldkh")), x_btd, lp, "w_k_ldkh"
    )
    v_btkh = lora.add_delta(
        jnp.einsum("btd,dkh->btkh", x_btd, w("w_v_ldkh")), x_btd, lp, "w_v_ldkh"
    )
    if config.qkv_bias:
        q_btnh, k_btkh, v_btkh = q_btnh + w("b_q_lnh"), k_btkh + w("b_k_lkh"), v_btkh + w("b_v_lkh")
    if config.qk_norm:  # per head, over H, before RoPE (Qwen3, Gemma 3)
        q_btnh = rms_norm(q_btnh, lp["q_norm_lh"], eps, off)
        k_btkh = rms_norm(k_btkh, lp["k_norm_lh"], eps, off)

    def rope(x):
        if config.rope_local_theta is None:
            return apply_rope(x, positions_bt, config.rope_theta, config)
        return _by_layer_type(
            sliding,
            lambda: apply_rope(x, positions_bt, config.rope_local_theta),
            lambda: apply_rope(x, positions_bt, config.rope_theta, config),
        )

    q_btnh = rope(q_btnh)
    k_btkh = rope(k_btkh).astype(cd)
    attn_btnh, cache_k, cache_v = layer_attention(
        config, q_btnh, k_btkh, v_btkh, positions_bt, cache_k, cache_v,
        layer_cache=layer_cache, sliding=sliding, segment_ids_bt=segment_ids_bt, fresh=fresh,
    )  # fmt: skip
    attn_btd = jnp.einsum(
        "btnh,nhd->btd", attn_btnh, w("w_o_lnhd"), preferred_element_type=jnp.float32
    )
    attn_btd = lora.add_delta(attn_btd, attn_btnh, lp, "w_o_lnhd")  # no-op without adapters
    if config.sandwich_norm:
        attn_btd = rms_norm(attn_btd, lp["post_attn_norm_ld"], eps, off)
    h_btd = h_btd + attn_btd
    x_btd = rms_norm(h_btd, lp["mlp_norm_ld"], eps, off).astype(cd)
    router_bte = None
    if config.is_moe:
        mlp_btd, router_bte = moe_mlp(
            x_btd,
            *(w(n) for n in ("w_router_lde", "w_gate_ledf", "w_up_ledf", "w_down_lefd")),
            top_k=config.n_experts_per_token,
            norm_topk_prob=config.norm_topk_prob,
        )
    elif lora.has_mlp_adapters(lp):
        act = jax.nn.silu if config.mlp_activation == "silu" else _gelu_tanh
        mlp_btd = lora.glu_mlp(x_btd, lp, cd, act)
    else:
        mlp = swiglu if config.mlp_activation == "silu" else _gelu_tanh_mlp
        mlp_btd = mlp(x_btd, w("w_gate_ldf"), w("w_up_ldf"), w("w_down_lfd"))
    if config.sandwich_norm:
        mlp_btd = rms_norm(mlp_btd, lp["post_mlp_norm_ld"], eps, off)
    h_btd = h_btd + mlp_btd
    return h_btd, (cache_k, cache_v), router_bte
