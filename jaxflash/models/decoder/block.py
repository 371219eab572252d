"""One decoder block of every supported family: attention through the layer's cache
(``models.caches.cache_face``: the block never asks which kind it has) and the MLP (the gated
MLP, SwiGLU or GeGLU, or routed experts), with the pre/post norms and residuals each
family's ``ModelConfig`` asks for. ``models.decoder.transformer.forward`` runs the stack of them.

LoRA (``models.adapters.lora``): a projection adds its adapter's delta only where the layer's
params hold one (``lora.adapted_weights``); without LoRA no adapter code is traced.

Dimension letters as in ``models.decoder.transformer``. References: RMSNorm (arXiv 1910.07467),
SwiGLU / GeGLU (arXiv 2002.05202), RoPE (arXiv 2104.09864).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.models.adapters import lora
from jaxflash.models.caches.cache_face import LayerCache, Site
from jaxflash.models.caches.exact import row_blocks
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.moe import moe_mlp
from jaxflash.models.decoder.rope import apply_rope
from jaxflash.models.decoder.swiglu import swiglu


def rms_norm(x_btd: jax.Array, w_d: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x / sqrt(mean(x²) + eps) * (offset + w), in float32 over the last axis.

    ``offset`` is ``ModelConfig.norm_offset``: 0 (Llama, Qwen) or 1 (Gemma's (1 + w)).
    """
    x = x_btd.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    w = w_d.astype(jnp.float32)
    return x * (offset + w if offset else w)


def final_norm(params, config: ModelConfig, h_btd: jax.Array) -> jax.Array:
    """The final RMSNorm of float32 [B, T, D] (fixed row blocks in the exact mode)."""

    def norm(h):
        return rms_norm(h, params["final_norm_d"], config.rms_norm_eps, config.norm_offset)

    if not config.exact_numerics:
        return norm(h_btd)
    b, t, d = h_btd.shape
    return row_blocks(norm, h_btd.reshape(b * t, d)).reshape(b, t, d)


_ACTIVATIONS = {  # ModelConfig.mlp_activation -> the gate's nonlinearity
    "silu": jax.nn.silu,  # SwiGLU (Llama, Qwen, Mistral)
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GeGLU (Gemma)
}
_MLP_WEIGHTS = ("w_gate_ldf", "w_up_ldf", "w_down_lfd")


def _by_layer_type(sliding, local_value, full_value):
    """``local_value`` on a sliding layer, else ``full_value``; ``sliding`` is a Python
    bool (unrolled layers, or all layers alike) or a traced bool (mixed layers in the
    scan), where both values are computed and one is selected."""
    if isinstance(sliding, bool):
        return local_value() if sliding else full_value()
    return jnp.where(sliding, local_value(), full_value())


def _linear(spec: str, x, lp, name: str, adapted: frozenset[str], cd, **kwargs) -> jax.Array:
    """``einsum(spec, x, W)`` with W = ``lp[name]`` in the compute dtype (a quantized base
    dequantises here), plus the adapter's s·(x·A)·B where the layer has one."""
    y = jnp.einsum(spec, x, lp[name].astype(cd), **kwargs)
    return lora.add_delta(y, x, lp, name) if name in adapted else y


def gated_mlp(config: ModelConfig, x_btd, lp):
    """The dense MLP: (act(x W_gate) * (x W_up)) W_down, float32 [B, T, D].

    act is silu (SwiGLU) or gelu_tanh (GeGLU), per ``config.mlp_activation``; each
    projection adds its adapter where the layer has one. SwiGLU without MLP adapters
    is computed by ``models.decoder.swiglu``: the same forward ops, with the hand-written
    backward the learner's step is fast with (autodiff elsewhere).

    Args:
      x_btd: [B, T, D] normed input, compute dtype.
      lp: one layer's params (``w_gate_ldf`` [D, F], ``w_up_ldf`` [D, F],
        ``w_down_lfd`` [F, D], and any ``lora_gate`` / ``lora_up`` / ``lora_down``).
    """
    cd, adapted = config.jnp_compute_dtype, lora.adapted_weights(lp)
    if config.mlp_activation == "silu" and not adapted.intersection(_MLP_WEIGHTS):
        return swiglu(x_btd, *(lp[name].astype(cd) for name in _MLP_WEIGHTS))
    gate_btf = _linear("btd,df->btf", x_btd, lp, "w_gate_ldf", adapted, cd)
    up_btf = _linear("btd,df->btf", x_btd, lp, "w_up_ldf", adapted, cd)
    act_btf = _ACTIVATIONS[config.mlp_activation](gate_btf) * up_btf
    return _linear(
        "btf,fd->btd", act_btf, lp, "w_down_lfd", adapted, cd, preferred_element_type=jnp.float32
    )


def decoder_layer(config: ModelConfig, h_btd, lp, cache: LayerCache, site: Site, replay_btk=None):
    """One decoder block.

    Args:
      config: ``ModelConfig`` (hashable, static).
      h_btd: float32 [B, T, D] the residual stream.
      lp: one layer's params (a slice of ``params["layers"]``).
      cache: this layer's ``cache_face.LayerCache`` (``NoCache`` for a cache-free pass):
        it stores the new k/v and attends.
      site: where the T tokens sit: positions (RoPE, cache writes), the layer's sliding
        flag (window and ``config.rope_local_theta``), packed segments.
      replay_btk: MoE only: int [B, T, k] recorded experts to replay, -1 where none
        (``moe.route``); None routes live.

    Returns:
      (h_btd float32 [B, T, D], the updated layer cache, (router logits float32
      [B, T, E], live top-k experts int32 [B, T, k]) or None for a dense MLP).

    In the exact mode (``config.exact_numerics``, dense models only) the per-token parts
    before and after attention run on fixed blocks of rows (``caches.exact.row_blocks``),
    the same ops whatever B and T are.
    """
    if not config.exact_numerics:
        q_btnh, k_btkh, v_btkh = _qkv(config, h_btd, lp, site.positions_bt, site.sliding)
        attn_btnh, cache = cache.attend(config, q_btnh, k_btkh, v_btkh, site)
        h_btd, router = _after_attention(config, h_btd, attn_btnh, lp, replay_btk)
        return h_btd, cache, router
    b, t, d = h_btd.shape  # the exact mode refuses experts: no router, no replay
    h_m1d = h_btd.reshape(b * t, 1, d)
    q, k, v = row_blocks(
        lambda h, p: _qkv(config, h, lp, p, site.sliding), h_m1d, site.positions_bt.reshape(-1, 1)
    )
    q_btnh, k_btkh, v_btkh = (x.reshape(b, t, *x.shape[2:]) for x in (q, k, v))
    attn_btnh, cache = cache.attend(config, q_btnh, k_btkh, v_btkh, site)
    attn_m1nh = attn_btnh.reshape(b * t, 1, *attn_btnh.shape[2:])
    h_m1d = row_blocks(lambda h, a: _after_attention(config, h, a, lp)[0], h_m1d, attn_m1nh)
    return h_m1d.reshape(b, t, d), cache, None


def _qkv(config: ModelConfig, h_btd, lp, positions_bt, sliding):
    """(q_btnh, k_btkh, v_btkh) of the normed residual stream, RoPE applied (k in the
    compute dtype)."""
    cd, eps, off = config.jnp_compute_dtype, config.rms_norm_eps, config.norm_offset
    adapted = lora.adapted_weights(lp)
    x_btd = rms_norm(h_btd, lp["attn_norm_ld"], eps, off).astype(cd)
    q_btnh = _linear("btd,dnh->btnh", x_btd, lp, "w_q_ldnh", adapted, cd)
    k_btkh = _linear("btd,dkh->btkh", x_btd, lp, "w_k_ldkh", adapted, cd)
    v_btkh = _linear("btd,dkh->btkh", x_btd, lp, "w_v_ldkh", adapted, cd)
    if config.qkv_bias:
        q_btnh = q_btnh + lp["b_q_lnh"].astype(cd)
        k_btkh = k_btkh + lp["b_k_lkh"].astype(cd)
        v_btkh = v_btkh + lp["b_v_lkh"].astype(cd)
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

    return rope(q_btnh), rope(k_btkh).astype(cd), v_btkh


def _after_attention(config: ModelConfig, h_btd, attn_btnh, lp, replay_btk=None):
    """(h_btd after the attention output and the MLP with their residuals, the router's
    (logits, live experts) or None)."""
    cd, eps, off = config.jnp_compute_dtype, config.rms_norm_eps, config.norm_offset
    adapted = lora.adapted_weights(lp)
    attn_btd = _linear(
        "btnh,nhd->btd", attn_btnh, lp, "w_o_lnhd", adapted, cd, preferred_element_type=jnp.float32
    )
    if config.sandwich_norm:
        attn_btd = rms_norm(attn_btd, lp["post_attn_norm_ld"], eps, off)
    h_btd = h_btd + attn_btd
    x_btd = rms_norm(h_btd, lp["mlp_norm_ld"], eps, off).astype(cd)
    router = None
    if config.is_moe:  # routed experts replace the dense MLP (models.decoder.moe)
        names = ("w_router_lde", "w_gate_ledf", "w_up_ledf", "w_down_lefd")
        mlp_btd, *router = moe_mlp(
            x_btd,
            *(lp[n].astype(cd) for n in names),
            top_k=config.n_experts_per_token,
            norm_topk_prob=config.norm_topk_prob,
            replay_btk=replay_btk,
        )
        router = tuple(router)
    else:
        mlp_btd = gated_mlp(config, x_btd, lp)
    if config.sandwich_norm:
        mlp_btd = rms_norm(mlp_btd, lp["post_mlp_norm_ld"], eps, off)
    return h_btd + mlp_btd, router
