"""One face for every key/value cache: what a decoder layer calls to store its new keys
and values and attend, without asking which kind of cache it has.

Two levels, each a small protocol:

- ``LayerCache``, one layer's part: ``attend(config, q_btnh, k_btkh, v_btkh, site) ->
  (attn_btnh, updated layer cache)``. Each kind owns its writes and its attention:

  ==========================  =====================================================
  ``NoCache``                 the learner's forward: causal self-attention over the T
                              tokens within segments (``attention.self_attention``,
                              O(T) memory off "dense"); nothing is stored.
  ``FreshPrefill(inner)``     a prefill into a cache that holds nothing a query may
                              see, each row one sequence from position 0: causal
                              self-attention over the T new tokens (O(T) memory),
                              then ``inner.write`` stores k/v.
  ``kv_cache.DenseSlice``     one layer of the stacked ``KVCache`` ([B, S, K, H]).
  ``kv_cache.DenseLayer``     one layer of ``LayerKVCache`` (keys [B, K, S, H],
                              values [B, K, H, S]).
  ``paged_kv_cache.PagedLayer``  one layer's page pool and the rows' ``PageTable``:
                              the pure-JAX reference path, or the TPU kernel when the
                              table says ``kernel``.
  ==========================  =====================================================

  The dense kinds write at ``site.positions_bt``, then ``attend_cached`` runs over the
  cache's S entries ([T, S] scores per head) with ``cache_visibility``: the engine's
  decode and short prefills, which the bit-for-bit goldens pin
  (tests/generation/test_engine_golden.py).
- ``ModelCache``, all L layers (``KVCache``, ``LayerKVCache``, ``PagedKVCache``):
  ``stacked`` (the params layout it pairs with), ``batch``, ``layers(fresh=) -> the
  layer caches`` (stacked: one ``LayerCache`` whose leaves carry a leading [L] axis,
  what ``lax.scan`` slices; unstacked: a tuple of L) and ``with_layers(layers)``
  (the cache rebuilt from what ``attend`` returned).
- ``SlotCache``, a ``ModelCache`` the generation engine decodes its slots in
  (``LayerKVCache``, ``PagedKVCache``; one row per slot): ``writable(pos_b)`` (which
  rows can store an entry at a position: a dense row up to S, a paged row where its
  page is mapped), ``write_prefill(prefill, row_g, slot_g, shared_pages_g)`` (prefill
  rows copied into slots; each kind owns how) and ``allocation()`` (what it holds, as
  allocated: ``Allocation``, read by ``sizing.kv_pool``). The engine never asks which
  kind it holds.

``Site`` says where the T new tokens sit: positions, packed segments (cache-free
only) and whether the layer attends within the sliding window. Layer caches are
pytrees (``flax.struct``), so they ride ``jit``, ``lax.scan`` and ``jax.checkpoint``
with exactly the leaves the raw arrays had (same programs as before the face).

Shapes: B batch, T new tokens, N query heads, K kv heads, H head dim, S cache length,
L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
from flax import struct

from jaxflash.models.caches.attention import cache_visibility, dense_attention, self_attention
from jaxflash.models.caches.exact import exact_attention, segment_offsets


@dataclasses.dataclass(frozen=True)
class Site:
    """Where one layer's T new tokens sit (built per layer; not a pytree).

    Attributes:
      positions_bt: int32 [B, T] absolute positions (RoPE angles; where k/v are written).
      sliding: the layer attends within ``config.sliding_window`` and uses
        ``config.rope_local_theta`` (a Python bool, or a traced bool inside the scan
        over mixed layers).
      segment_ids_bt: int32 [B, T] packed segments of a cache-free pass, or None.
    """

    positions_bt: jax.Array
    sliding: bool | jax.Array = False
    segment_ids_bt: jax.Array | None = None


class LayerCache(Protocol):
    """One layer's cache: stores the new tokens' k/v and attends (see the module doc)."""

    def attend(
        self, config: Any, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, site: Site
    ) -> tuple[jax.Array, LayerCache]:
        """(attn_btnh [B, T, N, H] compute dtype, this layer's updated cache).

        q_btnh [B, T, N, H] and k_btkh [B, T, K, H] have RoPE applied (k in the compute
        dtype); v_btkh [B, T, K, H].
        """
        ...


class ModelCache(Protocol):
    """All L layers' cache, as ``transformer.forward`` holds it (see the module doc)."""

    stacked: bool  # pairs with stacked params ([L, ...], scanned) or unstacked ones

    @property
    def batch(self) -> int: ...

    def layers(self, *, fresh: bool = False) -> Any:
        """The layer caches (``FreshPrefill``-wrapped with ``fresh``); ValueError when
        this kind cannot be prefilled fresh."""
        ...

    def with_layers(self, layers: Any) -> ModelCache: ...


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What a ``SlotCache`` holds, as allocated (``sizing.kv_pool.KvPool`` reads it).

    Attributes:
      kind: "dense" or "paged".
      attention: "dense" (a dense cache), "reference" (paged, the pure-JAX views) or
        "tpu_kernel" (paged, ``ragged_paged_attention``).
      rows: B, rows (engine slots).
      positions: S, positions a row can address.
      page_size: P (1 for a dense cache).
      pages: N, pages (dense: B x S one-position pages).
      token_bytes: K and V of one token over all layers, whole (unsplit), bytes.
      buffers: the K/V arrays, real or abstract (with their shardings): what the
        chips hold.
    """

    kind: str
    attention: str
    rows: int
    positions: int
    page_size: int
    pages: int
    token_bytes: int
    buffers: tuple[Any, ...]


class SlotCache(ModelCache, Protocol):
    """A ``ModelCache`` of one row per engine slot (see the module doc)."""

    def writable(self, pos_b: jax.Array) -> jax.Array:
        """bool [B]: row b can store an entry at position ``pos_b[b]`` (int32 [B])."""
        ...

    def write_prefill(
        self, prefill: Any, row_g: jax.Array, slot_g: jax.Array, shared_pages_g: Any = None
    ) -> SlotCache:
        """Rows ``row_g`` of a prefill's dense cache (a ``LayerKVCache`` of [N, ..., T]
        rows) written into rows ``slot_g`` at positions 0..T-1; out-of-range slots
        (padding) write nothing; a paged cache skips each entry's first
        ``shared_pages_g`` pages (int32 [G]: a shared prompt's, already in the pool)."""
        ...

    def allocation(self) -> Allocation: ...


def attend_cached(
    config, q_btnh: jax.Array, keys_bksh: jax.Array, values_bkhs: jax.Array, site: Site
) -> jax.Array:
    """Attention over a dense view of the cache ([T, S] scores per head): query at
    position p sees entries j <= p (and p - j < window on a sliding layer).

    Args:
      keys_bksh: [B, K, S, H]; values_bkhs: [B, K, H, S] (already holding the new tokens).

    Returns:
      [B, T, N, H] in the compute dtype.

    In the exact mode (``config.exact_numerics``) the cache's keys go through
    ``exact.exact_attention``, the learner's layout and order.
    """
    if config.exact_numerics:
        keys_bskh, values_bskh = keys_bksh.transpose(0, 2, 1, 3), values_bkhs.transpose(0, 3, 1, 2)
        return exact_attention(
            config, q_btnh, site.positions_bt, keys_bskh, values_bskh, sliding=site.sliding
        )
    visible_bts = cache_visibility(
        site.positions_bt, keys_bksh.shape[2], site.sliding, config.sliding_window
    )
    return dense_attention(q_btnh, keys_bksh, values_bkhs, visible_bts, config)


@struct.dataclass
class NoCache:
    """No cache (the learner's forward): causal within segments over the T tokens, as
    ``config.attention`` says; positions only set RoPE. A pytree without leaves."""

    def attend(self, config, q_btnh, k_btkh, v_btkh, site: Site):
        if config.exact_numerics:  # keys by position within each (packed) sequence
            offset_bt = segment_offsets(site.positions_bt)
            attn_btnh = exact_attention(
                config, q_btnh, site.positions_bt, k_btkh, v_btkh,
                offset_bt=offset_bt, sliding=site.sliding,
            )  # fmt: skip
            return attn_btnh, self
        attn_btnh = self_attention(
            q_btnh, k_btkh, v_btkh, config, segment_ids_bt=site.segment_ids_bt, sliding=site.sliding
        )
        return attn_btnh, self


@struct.dataclass
class FreshPrefill:
    """A dense layer cache that holds nothing a query may see, filled by a prefill whose
    rows are each one sequence at positions 0..T-1 (``forward(..., fresh_cache=True)``).

    Attention over the cache then equals causal self-attention over the T new tokens:
    ``self_attention`` computes it (O(T) memory: blockwise on CPU, XLA / cuDNN flash on
    GPU, splash on TPU) without the [T, S] scores, then ``inner.write`` stores k/v.
    The cache entries equal the dense path's bit for bit (k/v come before attention);
    later layers agree to float rounding.

    Attributes:
      inner: a ``DenseSlice`` or ``DenseLayer`` (anything with ``write(k, v, positions)``).
    """

    inner: Any

    def attend(self, config, q_btnh, k_btkh, v_btkh, site: Site):
        """(attn_btnh, the updated *inner* cache): a fresh layer is fresh only once.
        In the exact mode: the inner cache's write-then-attend (one attention order)."""
        if config.exact_numerics:
            return self.inner.attend(config, q_btnh, k_btkh, v_btkh, site)
        attn_btnh = self_attention(q_btnh, k_btkh, v_btkh, config, sliding=site.sliding)
        return attn_btnh, self.inner.write(k_btkh, v_btkh, site.positions_bt)
