"""Key/value cache indexed by absolute position, one slot per batch row.

Two layouts with the same semantics: ``KVCache`` stacks the layers into one
``[L, B, S, K, H]`` array per k/v (layer, batch row = engine slot, cache position,
key/value head, head dim) for the ``lax.scan`` forward; ``LayerKVCache`` keeps L
separate buffers per k/v for the unrolled forward the engine decodes with, so each
layer's buffer is updated in place (a donated stacked cache inside a scan is copied
out of and back into the stack at every step), and stores them in the layouts the
attention products read — keys ``[B, K, S, H]``, values ``[B, K, H, S]`` — so no
step transposes the whole cache (XLA on CPU did, for both, at every layer and step:
about 15 % of a decode step). A forward pass with a cache
writes each token's k/v at its row's absolute position ``positions_bt[b, t]`` (a
per-row scatter), then every query at position p attends to cache entries j <= p.
Entries past p are never read, so a slot is reused for a new sequence without
clearing: writing the new prompt from position 0 overwrites everything a query can
see. Rows of one batch may sit at different positions (continuous batching).

Both are ``models.caches.cache_face.ModelCache``s: ``layers()`` hands ``transformer.forward`` one
``DenseSlice`` (stacked over L, what the scan slices) or L ``DenseLayer``s, each owning
its writes (``write``) and its attention (``attend``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxflash.models.caches.cache_face import Allocation, FreshPrefill, Site, attend_cached
from jaxflash.models.config.model_config import ModelConfig

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

    stacked = True  # pairs with stacked params (the scanned forward); not a field

    @property
    def max_len(self) -> int:
        """S, number of positions each row can hold."""
        return self.k_lbskh.shape[2]

    @property
    def batch(self) -> int:
        """B, rows."""
        return self.k_lbskh.shape[1]

    def layers(self, *, fresh: bool = False) -> DenseSlice | FreshPrefill:
        """One ``DenseSlice`` over all L layers (leaves [L, B, S, K, H]; the scan slices it)."""
        layer = DenseSlice(k_bskh=self.k_lbskh, v_bskh=self.v_lbskh)
        return FreshPrefill(layer) if fresh else layer

    def with_layers(self, layers: DenseSlice) -> KVCache:
        """The cache from the scan's stacked updated slices."""
        return KVCache(k_lbskh=layers.k_bskh, v_lbskh=layers.v_bskh)


class LayerKVCache(NamedTuple):
    """Per-layer key/value cache: one buffer per layer and k/v (a pytree).

    Attributes:
      k_bksh: L arrays [B, K, S, H], keys after RoPE, compute dtype.
      v_bkhs: L arrays [B, K, H, S], values, compute dtype.
    """

    k_bksh: tuple[jax.Array, ...]
    v_bkhs: tuple[jax.Array, ...]

    stacked = False  # pairs with unstacked params (the unrolled forward); not a field

    @property
    def max_len(self) -> int:
        """S, number of positions each row can hold."""
        return self.k_bksh[0].shape[2]

    @property
    def batch(self) -> int:
        """B, rows."""
        return self.k_bksh[0].shape[0]

    def layers(self, *, fresh: bool = False) -> tuple[DenseLayer | FreshPrefill, ...]:
        """L ``DenseLayer``s (``FreshPrefill``-wrapped with ``fresh``)."""
        layers = (DenseLayer(k, v) for k, v in zip(self.k_bksh, self.v_bkhs, strict=True))
        return tuple(FreshPrefill(layer) if fresh else layer for layer in layers)

    def with_layers(self, layers: tuple[DenseLayer, ...]) -> LayerKVCache:
        return LayerKVCache(tuple(c.k_bksh for c in layers), tuple(c.v_bkhs for c in layers))

    # The engine's slots (``cache_face.SlotCache``): one row per slot.

    def writable(self, pos_b: jax.Array) -> jax.Array:
        """bool [B]: every row holds positions 0..S-1."""
        return pos_b < self.max_len

    def write_prefill(
        self, prefill: LayerKVCache, row_g: jax.Array, slot_g: jax.Array, shared_pages_g=None
    ) -> LayerKVCache:
        """Rows ``row_g`` of ``prefill`` ([N, K, T, H] keys) into rows ``slot_g`` at
        positions 0..T-1; out-of-range slots (padding) write nothing. Nothing is shared
        (``shared_pages_g`` is a paged cache's)."""
        del shared_pages_g
        t = prefill.max_len

        def k_rows(dst_bksh, src_nksh):
            return dst_bksh.at[slot_g, :, :t].set(src_nksh[row_g], mode="drop")

        def v_rows(dst_bkhs, src_nkhs):
            return dst_bkhs.at[slot_g, :, :, :t].set(src_nkhs[row_g], mode="drop")

        return LayerKVCache(
            k_bksh=tuple(map(k_rows, self.k_bksh, prefill.k_bksh)),
            v_bkhs=tuple(map(v_rows, self.v_bkhs, prefill.v_bkhs)),
        )

    def allocation(self) -> Allocation:
        """Every row reserves S positions: B x S one-position "pages"."""
        b, k, s, h = self.k_bksh[0].shape
        item = jnp.dtype(self.k_bksh[0].dtype).itemsize
        return Allocation(
            kind="dense",
            attention="dense",
            rows=int(b),
            positions=int(s),
            page_size=1,
            pages=int(b * s),
            token_bytes=2 * len(self.k_bksh) * k * h * item,
            buffers=(*self.k_bksh, *self.v_bkhs),
        )


LAYER_K_LOGICAL_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")
"""Logical axes of one layer's ``LayerKVCache.k_bksh`` buffer."""
LAYER_V_LOGICAL_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")
"""Logical axes of one layer's ``LayerKVCache.v_bkhs`` buffer."""


def _check_size(config: ModelConfig, batch: int, max_len: int, what: str) -> None:
    if batch < 1:
        raise ValueError(f"{what}: batch must be >= 1, got {batch}")
    if not 1 <= max_len <= config.max_seq_len:
        raise ValueError(
            f"{what}: max_len must be in [1, max_seq_len={config.max_seq_len}], got {max_len}"
        )


def init_layer_kv_cache(config: ModelConfig, batch: int, max_len: int) -> LayerKVCache:
    """A zero ``LayerKVCache``: L buffers [B, K, S, H] (keys) and [B, K, H, S] (values).

    Raises:
      ValueError: batch < 1, or max_len outside [1, config.max_seq_len].
    """
    _check_size(config, batch, max_len, "init_layer_kv_cache")
    b, k, s, h = batch, config.n_kv_heads, max_len, config.head_dim
    dtype = config.jnp_compute_dtype
    return LayerKVCache(
        k_bksh=tuple(jnp.zeros((b, k, s, h), dtype) for _ in range(config.n_layers)),
        v_bkhs=tuple(jnp.zeros((b, k, h, s), dtype) for _ in range(config.n_layers)),
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


def write_layer_rows(
    k_bksh: jax.Array, v_bkhs: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, positions_bt
) -> tuple[jax.Array, jax.Array]:
    """``write_rows`` for one layer of a ``LayerKVCache`` (keys [B, K, S, H], values
    [B, K, H, S]); positions outside [0, S) are not written.

    Returns:
      (k_bksh, v_bkhs) updated (cache dtype).
    """
    batch, kv_heads, seq, head_dim = k_bksh.shape
    pos_bt = jnp.where((positions_bt >= 0) & (positions_bt < seq), positions_bt, seq)
    b_bt1 = jnp.broadcast_to(jnp.arange(batch)[:, None], pos_bt.shape)[..., None]
    k_11k = jnp.arange(kv_heads)[None, None, :]
    s_bt1 = pos_bt[..., None]
    k_bksh = k_bksh.at[b_bt1, k_11k, s_bt1].set(k_btkh.astype(k_bksh.dtype), mode="drop")
    h_111h = jnp.arange(head_dim)[None, None, None, :]
    v_bkhs = v_bkhs.at[b_bt1[..., None], k_11k[..., None], h_111h, s_bt1[..., None]].set(
        v_btkh.astype(v_bkhs.dtype), mode="drop"
    )
    return k_bksh, v_bkhs


# ------------------------------------------------------------------ layer caches


@struct.dataclass
class DenseSlice:
    """One layer of a ``KVCache`` (a ``cache_face.LayerCache``; leaves gain a leading
    [L] while the forward scans over them).

    Attributes:
      k_bskh, v_bskh: [B, S, K, H] keys (after RoPE) and values, compute dtype.
    """

    k_bskh: jax.Array
    v_bskh: jax.Array

    def write(self, k_btkh: jax.Array, v_btkh: jax.Array, positions_bt: jax.Array) -> DenseSlice:
        """The new tokens' k/v written at ``positions_bt`` (``write_rows``)."""
        return DenseSlice(
            write_rows(self.k_bskh, k_btkh, positions_bt),
            write_rows(self.v_bskh, v_btkh, positions_bt),
        )

    def attend(self, config, q_btnh, k_btkh, v_btkh, site: Site):
        """Write, then attend over the S entries (``cache_face.attend_cached``)."""
        new = self.write(k_btkh, v_btkh, site.positions_bt)
        keys_bksh, values_bkhs = new.k_bskh.transpose(0, 2, 1, 3), new.v_bskh.transpose(0, 2, 3, 1)
        return attend_cached(config, q_btnh, keys_bksh, values_bkhs, site), new


@struct.dataclass
class DenseLayer:
    """One layer of a ``LayerKVCache`` (a ``cache_face.LayerCache``), stored in the
    layouts the attention products read.

    Attributes:
      k_bksh: [B, K, S, H] keys after RoPE; v_bkhs: [B, K, H, S] values; compute dtype.
    """

    k_bksh: jax.Array
    v_bkhs: jax.Array

    def write(self, k_btkh: jax.Array, v_btkh: jax.Array, positions_bt: jax.Array) -> DenseLayer:
        """The new tokens' k/v written at ``positions_bt`` (``write_layer_rows``)."""
        return DenseLayer(*write_layer_rows(self.k_bksh, self.v_bkhs, k_btkh, v_btkh, positions_bt))

    def attend(self, config, q_btnh, k_btkh, v_btkh, site: Site):
        """Write, then attend over the S entries (``cache_face.attend_cached``)."""
        new = self.write(k_btkh, v_btkh, site.positions_bt)
        return attend_cached(config, q_btnh, new.k_bksh, new.v_bkhs, site), new
