"""One decoder layer's attention, given what it has for a cache: the dispatch of
``models.block.decoder_layer``.

Four cases, picked by the cache the layer gets (``layer_attention``):

- no cache (the learner's forward): ``attention.self_attention`` over the T tokens,
  causal within segments, as ``ModelConfig.attention`` says (O(T) memory off
  "dense").
- a *fresh* cache (the engine's long prefill, ``forward(..., fresh_cache=True)``):
  the cache holds nothing a query may see and each row is one sequence from
  position 0, so attention over the cache equals causal self-attention over the T
  new tokens. ``self_attention`` computes it (O(T) memory: blockwise on CPU, XLA /
  cuDNN flash on GPU, splash on TPU), then k/v are written into the cache at
  ``positions_bt``. Same cache entries as the dense path bit for bit (k/v are
  computed before attention); later layers agree to float rounding.
- a paged cache on the TPU kernel: ``paged_kv_cache.kernel_attention`` writes and
  attends (``ragged_paged_attention``; reads only each row's pages).
- any other cache (``KVCache`` slice, ``LayerKVCache`` layer, a paged layer on the
  reference path): k/v are written at ``positions_bt``, then ``dense_attention``
  runs over the cache's S entries ([T, S] scores per head) with
  ``cache_visibility``. The engine's decode and short prefills take this path, which
  the bit-for-bit goldens pin (tests/test_engine_golden.py).

Shapes: B batch, T new tokens, N query heads, K kv heads, H head dim, S cache length.
"""

from __future__ import annotations

import jax

from jaxflash.models.attention import (
    attention_scale,
    cache_visibility,
    dense_attention,
    self_attention,
)
from jaxflash.models.kv_cache import write_layer_rows, write_rows
from jaxflash.models.paged_kv_cache import PageTable, kernel_attention, write_and_view


def layer_attention(
    config,
    q_btnh: jax.Array,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    positions_bt: jax.Array,
    cache_k,
    cache_v,
    *,
    layer_cache: bool = False,
    sliding: bool | jax.Array = False,
    segment_ids_bt: jax.Array | None = None,
    fresh: bool = False,
):
    """Attention of one layer's T new tokens, and the layer's updated cache.

    Args:
      config: ``ModelConfig`` (heads, compute dtype, window, ``attention``).
      q_btnh: [B, T, N, H] queries; k_btkh, v_btkh: [B, T, K, H] keys and values
        (RoPE applied to q and k; k in the compute dtype).
      positions_bt: int32 [B, T] absolute positions (where k/v are written).
      cache_k, cache_v: None and None (no cache); a ``KVCache`` layer's [B, S, K, H]
        keys and values; with ``layer_cache`` a ``LayerKVCache`` layer's keys
        [B, K, S, H] and values [B, K, H, S]; or a paged layer's pool
        [N_pages, P, 2K, H] and its ``PageTable``.
      layer_cache: the cache is a ``LayerKVCache`` layer.
      sliding: this layer attends within ``config.sliding_window`` (bool or traced).
      segment_ids_bt: int32 [B, T] packed segments (cache-free pass only).
      fresh: the cache is fresh (see the module docstring): attend over the new
        tokens with ``self_attention``, then write them. A dense (not paged) cache.

    Returns:
      (attn_btnh [B, T, N, H] compute dtype, cache_k, cache_v) with the cache updated
      (None, None without a cache).

    Raises:
      ValueError: ``fresh`` with no cache or with a paged cache.
    """
    if cache_k is None:  # causal within segments (models.attention); positions feed RoPE
        attn_btnh = self_attention(
            q_btnh, k_btkh, v_btkh, config, segment_ids_bt=segment_ids_bt, sliding=sliding
        )
        return attn_btnh, None, None
    paged = isinstance(cache_v, PageTable)
    if fresh:
        if paged:
            raise ValueError("layer_attention: fresh=True needs a dense cache, got a paged one")
        attn_btnh = self_attention(q_btnh, k_btkh, v_btkh, config, sliding=sliding)
        cache_k, cache_v = _write(cache_k, cache_v, k_btkh, v_btkh, positions_bt, layer_cache)
        return attn_btnh, cache_k, cache_v
    if paged and cache_v.kernel:  # TPU: ragged_paged_attention
        window = config.sliding_window if sliding is True else None
        cache_k, attn_btnh = kernel_attention(
            cache_k, cache_v, q_btnh, k_btkh, v_btkh, positions_bt,
            scale=attention_scale(config, config.head_dim), sliding_window=window,
        )  # fmt: skip
        return attn_btnh, cache_k, cache_v
    if paged:  # a PagedKVCache layer on the reference path: (pool, page table)
        cache_k, keys_bksh, values_bkhs = write_and_view(
            cache_k, cache_v, k_btkh, v_btkh, positions_bt
        )
    else:
        cache_k, cache_v = _write(cache_k, cache_v, k_btkh, v_btkh, positions_bt, layer_cache)
        if layer_cache:
            keys_bksh, values_bkhs = cache_k, cache_v
        else:
            keys_bksh, values_bkhs = cache_k.transpose(0, 2, 1, 3), cache_v.transpose(0, 2, 3, 1)
    visible_bts = cache_visibility(positions_bt, keys_bksh.shape[2], sliding, config.sliding_window)
    attn_btnh = dense_attention(q_btnh, keys_bksh, values_bkhs, visible_bts, config)
    return attn_btnh, cache_k, cache_v


def _write(cache_k, cache_v, k_btkh, v_btkh, positions_bt, layer_cache: bool):
    """k/v of the new tokens written at ``positions_bt`` into a dense cache layer."""
    if layer_cache:
        return write_layer_rows(cache_k, cache_v, k_btkh, v_btkh, positions_bt)
    return write_rows(cache_k, k_btkh, positions_bt), write_rows(cache_v, v_btkh, positions_bt)
