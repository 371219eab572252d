"""Rotary position embeddings (RoPE, arXiv 2104.09864) with Llama 3.1 scaling.

Rotate-half convention (HF Llama's): dim i < H/2 pairs with dim i + H/2. Shared by
the learner's forward and the engine's prefill and cached decode (through
``transformer.forward``), so both rotate identically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.models.config.model_config import ModelConfig


def llama3_inv_freq(inv_freq_h: jax.Array, config: ModelConfig) -> jax.Array:
    """Llama 3.1 RoPE scaling of the inverse frequencies (HF ``rope_type: llama3``).

    With wavelength w = 2π / f, L = rope_original_max_len, s = rope_scaling_factor:
    w > L / low_freq_factor -> f / s (long wavelengths stretched); w < L /
    high_freq_factor -> f (kept); in between f · ((1 - a) / s + a) with
    a = (L / w - low) / (high - low) (arXiv 2407.21783, and Meta's reference code).

    Args:
      inv_freq_h: float32 [H/2] unscaled inverse frequencies.
      config: supplies the four llama3 parameters.

    Returns:
      float32 [H/2].
    """
    c = config
    factor, low, high = c.rope_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor
    old_len = float(c.rope_original_max_len)
    wavelen_h = 2 * jnp.pi / inv_freq_h
    scaled_h = jnp.where(wavelen_h > old_len / low, inv_freq_h / factor, inv_freq_h)
    smooth_h = (old_len / wavelen_h - low) / (high - low)
    smoothed_h = (1 - smooth_h) * scaled_h / factor + smooth_h * scaled_h
    medium_h = (wavelen_h >= old_len / high) & (wavelen_h <= old_len / low)
    return jnp.where(medium_h, smoothed_h, scaled_h)


def apply_rope(
    x_btnh: jax.Array,
    positions_bt: jax.Array,
    theta: float,
    config: ModelConfig | None = None,
) -> jax.Array:
    """Rotate-half RoPE (HF Llama convention), computed in float32.

    Dim i < H/2 pairs with dim i + H/2, rotated by angle p * f_i, f_i = theta^(-2i/H)
    (scaled by ``llama3_inv_freq`` when ``config.rope_scaling == "llama3"``).

    Args:
      x_btnh: [B, T, N, H] queries or keys.
      positions_bt: int [B, T] absolute positions.
      theta: base frequency.
      config: optional; only its rope_scaling fields are read.

    Returns:
      float32 [B, T, N, H].
    """
    half = x_btnh.shape[-1] // 2
    inv_freq_h = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x_btnh.shape[-1])
    if config is not None and config.rope_scaling == "llama3":
        inv_freq_h = llama3_inv_freq(inv_freq_h, config)
    angle_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq_h
    cos, sin = jnp.cos(angle_bth)[:, :, None, :], jnp.sin(angle_bth)[:, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
