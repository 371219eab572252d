"""Key/value cache indexed by absolute position, one slot per batch row.

Two layouts with the same semantics: ``KVCache`` stacks the layers into one
``[L, B, S, K, H]`` array per k/v (layer, batch row = engine slot, cache position,
key/value head, head dim) for the ``lax.scan`` forward; ``LayerKVCache`` keeps L
separate ``[B, S, K, H]`` buffers for the unrolled forward the engine decodes with,
so each layer's buffer is updated in place (a donated stacked cache inside a scan is
copied out of and back into the stack at every step). A forward pass with a cache
writes each token's k/v at its row's absolute position ``positions_bt[b, t]`` (a
per-row scatter), then every query at position p attends to cache entries j <= p.
Entries past p are never read, so a slot is reused for a new sequence without
clearing: writing the new prompt from position 0 overwrites everything a query can
see. Rows of one batch may sit at different positions (continuous batching).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxflash.models.config import ModelConfig

KV_CACHE_LOGICAL_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
"""Logical axis names of ``k_lbskh`` and ``v_lbskh`` (for sharding rules)."""


class KVCache(NamedTuple):
    """Per-layer key/value cache (a pytree).

    Attributes:
      k_lbskh: [L, B, S, K, H] keys after RoPE, compute dtype.
      v_lbskh: [L, B, S, K, H] values, compute dtype.
    """

    k_lbskh: jax.Array
    v_lbskh: jax.Array

    @property
    def max_len(self) -> int:
        """S, number of positions each row can hold."""
        return self.k_lbskh.shape[2]


class LayerKVCache(NamedTuple):
    """Per-layer key/value cache: one buffer per layer (a pytree).

    Attributes:
      k_bskh: L arrays [B, S, K, H], keys after RoPE, compute dtype.
      v_bskh: L arrays [B, S, K, H], values, compute dtype.
    """

    k_bskh: tuple[jax.Array, ...]
    v_bskh: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        """S, number of positions each row can hold."""
        return self.k_bskh[0].shape[1]


def _check_size(config: ModelConfig, batch: int, max_len: int, what: str) -> None:
    if batch < 1:
        raise ValueError(f"{what}: batch must be >= 1, got {batch}")
    if not 1 <= max_len <= config.max_seq_len:
        raise ValueError(
            f"{what}: max_len must be in [1, max_seq_len={config.max_seq_len}], got {max_len}"
        )


def init_layer_kv_cache(config: ModelConfig, batch: int, max_len: int) -> LayerKVCache:
    """A zero ``LayerKVCache``: L separate [B, S, K, H] buffers per k/v.

    Raises:
      ValueError: batch < 1, or max_len outside [1, config.max_seq_len].
    """
    _check_size(config, batch, max_len, "init_layer_kv_cache")
    shape = (batch, max_len, config.n_kv_heads, config.head_dim)
    dtype = config.jnp_compute_dtype
    return LayerKVCache(
        k_bskh=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
        v_bskh=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
    )


def init_kv_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
    """A zero cache for ``batch`` rows of ``max_len`` positions.

    Args:
      config: model configuration (L, K, H, compute dtype).
      batch: B, rows (engine slots).
      max_len: S, positions per row; at most config.max_seq_len.

    Returns:
      KVCache with zeros of shape [L, B, S, K, H] in config.compute_dtype.

    Raises:
      ValueError: batch < 1, or max_len outside [1, config.max_seq_len].
    """
    _check_size(config, batch, max_len, "init_kv_cache")
    shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
    zeros = jnp.zeros(shape, config.jnp_compute_dtype)
    return KVCache(k_lbskh=zeros, v_lbskh=zeros)


def write_rows(cache_bskh: jax.Array, new_btkh: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """Scatter new entries into one layer's cache at each row's positions.

    Args:
      cache_bskh: [B, S, K, H] one layer of the cache.
      new_btkh: [B, T, K, H] keys or values of the T new tokens.
      positions_bt: int [B, T] absolute positions. Positions outside [0, S) are
        not written (a padding token may carry position -1 or S).

    Returns:
      [B, S, K, H] the updated layer (cache dtype).
    """
    batch, seq = cache_bskh.shape[:2]
    # Map out-of-range positions to S and drop them: negative indices would
    # otherwise wrap around to the end of the row.
    pos_bt = jnp.where((positions_bt >= 0) & (positions_bt < seq), positions_bt, seq)
    rows_bt = jnp.broadcast_to(jnp.arange(batch)[:, None], pos_bt.shape)
    return cache_bskh.at[rows_bt, pos_bt].set(new_btkh.astype(cache_bskh.dtype), mode="drop")
