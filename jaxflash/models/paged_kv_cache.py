"""A paged key/value cache: one page pool per layer, a page table per row.

The dense ``LayerKVCache`` reserves S positions for every row (engine slot)
whatever its sequence's length. A ``PagedKVCache`` holds N pages of P positions
per layer, shared by all rows; row b's position p lives in page
``page_table_bm[b, p // P]`` at offset ``p % P``. The host decides which pages a
row owns (``generation.page_pool``): pages are taken as a sequence grows, returned
when it ends, and the full pages of a shared prompt are mapped into several rows
without copying.

Layout of one layer's pool: ``[N, P, 2K, H]`` with keys at the even and values at
the odd entries of the combined head axis — the layout of the TPU kernel
``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (one buffer per layer,
updated in place like ``LayerKVCache``'s). Entries of the page table that hold no
page carry the sentinel N (out of range): writes there are dropped, reads clip to
a real page whose (finite) contents are masked out.

``write_and_view`` is the pure-JAX path the engine decodes with on CPU and GPU: it
writes the new tokens' k/v into their pages, then gathers each row's pages into the
dense ``[B, K, S, H]`` / ``[B, K, H, S]`` views ``models.llama._attention`` reads,
so the attention is the dense engine's, operation for operation (same tokens and
logprobs; tests/test_paged_engine.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxflash.models.config import ModelConfig

PAGED_KV_LOGICAL_AXES = (None, None, "kv_heads", "head_dim")
"""Logical axes of one layer's pool ``[N, P, 2K, H]``: split by kv head (decided on K, so a
shard holds whole key/value pairs); pages are not split (a next step where K is small)."""


@struct.dataclass
class PageTable:
    """Which pages each row reads (a pytree; ``max_len`` is static).

    Attributes:
      table_bm: int32 [B, M] page ids, M = ceil(S / P); N (the pool size) where a
        row holds no page.
      max_len: S, positions a row can address (the dense cache's length; the views
        are cut to it so scores have the dense engine's shape).
      kernel: attend with the TPU kernel (``kernel_attention``) instead of the
        pure-JAX views; TPU only (static).
    """

    table_bm: jax.Array
    max_len: int = struct.field(pytree_node=False)
    kernel: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class PagedKVCache:
    """Per-layer page pools plus the rows' page table (a pytree).

    Attributes:
      kv_pages: L arrays [N, P, 2K, H] (keys even, values odd along 2K), compute dtype.
      pages: the ``PageTable`` of the rows.
    """

    kv_pages: tuple[jax.Array, ...]
    pages: PageTable

    @property
    def max_len(self) -> int:
        """S, positions each row can address."""
        return self.pages.max_len

    @property
    def batch(self) -> int:
        return self.pages.table_bm.shape[0]


def pages_per_row(max_len: int, page_size: int) -> int:
    """M = ceil(S / P), page-table entries per row."""
    return -(-max_len // page_size)


def init_paged_kv_cache(
    config: ModelConfig,
    batch: int,
    max_len: int,
    num_pages: int,
    page_size: int,
    *,
    kernel: bool = False,
) -> PagedKVCache:
    """Zero pools (L x [N, P, 2K, H]) and a page table of sentinels (no row owns a page).

    Raises:
      ValueError: a size < 1.
    """
    for name, value in (("batch", batch), ("max_len", max_len), ("num_pages", num_pages)):
        if value < 1:
            raise ValueError(f"init_paged_kv_cache: {name} must be >= 1, got {value}")
    if page_size < 1:
        raise ValueError(f"init_paged_kv_cache: page_size must be >= 1, got {page_size}")
    shape = (num_pages, page_size, 2 * config.n_kv_heads, config.head_dim)
    pools = tuple(jnp.zeros(shape, config.jnp_compute_dtype) for _ in range(config.n_layers))
    table = jnp.full((batch, pages_per_row(max_len, page_size)), num_pages, jnp.int32)
    pages = PageTable(table_bm=table, max_len=max_len, kernel=kernel)
    return PagedKVCache(kv_pages=pools, pages=pages)


def interleave_kv(k_btkh: jax.Array, v_btkh: jax.Array) -> jax.Array:
    """[B, T, 2K, H]: keys at even, values at odd head entries."""
    b, t, k, h = k_btkh.shape
    return jnp.stack([k_btkh, v_btkh], axis=3).reshape(b, t, 2 * k, h)


def write_pages(
    pool_npch: jax.Array, table_bm: jax.Array, kv_btch: jax.Array, positions_bt: jax.Array
) -> jax.Array:
    """Scatter T tokens' combined k/v per row into their pages.

    Args:
      pool_npch: [N, P, 2K, H] one layer's pool.
      table_bm: int32 [B, M] page table.
      kv_btch: [B, T, 2K, H] from ``interleave_kv``.
      positions_bt: int [B, T] absolute positions; outside [0, M*P), or in a table
        entry that holds no page, nothing is written.

    Returns:
      The updated pool (pool dtype).
    """
    num_pages, page_size = pool_npch.shape[:2]
    m = table_bm.shape[1]
    inside_bt = (positions_bt >= 0) & (positions_bt < m * page_size)
    pos_bt = jnp.where(inside_bt, positions_bt, 0)
    page_bt = jnp.take_along_axis(table_bm, pos_bt // page_size, axis=1)
    page_bt = jnp.where(inside_bt, page_bt, num_pages)  # N: dropped
    return pool_npch.at[page_bt, pos_bt % page_size].set(
        kv_btch.astype(pool_npch.dtype), mode="drop"
    )


def gather_views(pool_npch: jax.Array, pages: PageTable) -> tuple[jax.Array, jax.Array]:
    """Each row's pages as the dense layouts: keys [B, K, S, H], values [B, K, H, S]."""
    b, m = pages.table_bm.shape
    _, page_size, two_k, h = pool_npch.shape
    rows_bmpch = jnp.take(pool_npch, pages.table_bm, axis=0, mode="clip")
    rows_bsch = rows_bmpch.reshape(b, m * page_size, two_k, h)[:, : pages.max_len]
    k_bksh = rows_bsch[:, :, 0::2].transpose(0, 2, 1, 3)
    v_bkhs = rows_bsch[:, :, 1::2].transpose(0, 2, 3, 1)
    return k_bksh, v_bkhs


def write_and_view(
    pool_npch: jax.Array,
    pages: PageTable,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    positions_bt: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write the new tokens' k/v, then read every row's pages (the pure-JAX path).

    Returns:
      (updated pool [N, P, 2K, H], keys [B, K, S, H], values [B, K, H, S]).
    """
    pool_npch = write_pages(pool_npch, pages.table_bm, interleave_kv(k_btkh, v_btkh), positions_bt)
    k_bksh, v_bkhs = gather_views(pool_npch, pages)
    return pool_npch, k_bksh, v_bkhs


def kernel_supported(config: ModelConfig) -> bool:
    """Whether ``ragged_paged_attention`` can tile this model's heads (jax 0.10.2 needs the
    2K combined heads, over the dtype's packing, to be 1, 2, 4 or a multiple of 8: not
    SmolLM2's 3 kv heads in float32, for one)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (  # noqa: PLC0415
        kernel,
    )

    dtype = config.jnp_compute_dtype
    try:
        kernel.get_min_heads_per_blk(config.n_heads, 2 * config.n_kv_heads, dtype, dtype)
    except (ValueError, AssertionError):
        return False
    return True


def kernel_attention(
    pool_npch: jax.Array,
    pages: PageTable,
    q_btnh: jax.Array,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    positions_bt: jax.Array,
    *,
    scale: float,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' k/v, then attend with ``ragged_paged_attention`` (TPU).

    Each row's T tokens must sit at consecutive positions ending at
    ``positions_bt[b, -1]`` (decode: T = 1), so the row's keys are its first
    ``positions_bt[b, -1] + 1`` positions — the kernel reads only those pages,
    where the pure-JAX path reads all M of every row. Online softmax in float32:
    equal to the reference within float rounding, not bit for bit.

    Returns:
      (updated pool [N, P, 2K, H], attention output [B, T, N, H] in q's dtype).
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (  # noqa: PLC0415
        ragged_paged_attention,
    )

    pool_npch = write_pages(pool_npch, pages.table_bm, interleave_kv(k_btkh, v_btkh), positions_bt)
    b, t, n, h = q_btnh.shape
    out = ragged_paged_attention(
        q_btnh.reshape(b * t, n, h).astype(pool_npch.dtype),
        pool_npch,
        (positions_bt[:, -1] + 1).astype(jnp.int32),
        pages.table_bm,
        jnp.arange(b + 1, dtype=jnp.int32) * t,
        jnp.full((1,), b, jnp.int32),
        sm_scale=scale,
        sliding_window=sliding_window,
    )
    return pool_npch, out.reshape(b, t, n, h)
