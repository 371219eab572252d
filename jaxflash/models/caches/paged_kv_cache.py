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

A ``PagedKVCache`` is a ``models.caches.cache_face.ModelCache``: its ``layers()`` are L
``PagedLayer``s (a pool and the shared page table) that write and attend in one of
two ways. ``write_and_view`` is the pure-JAX path the engine decodes with on CPU and
GPU: it writes the new tokens' k/v into their pages, then gathers each row's pages
into the dense ``[B, K, S, H]`` / ``[B, K, H, S]`` views ``cache_face.attend_cached``
reads, so the attention is the dense engine's, operation for operation (same tokens
and logprobs; tests/generation/test_paged_engine.py). With ``PageTable.kernel``,
``kernel_attention`` writes, then attends with the TPU kernel
(``models.caches.ragged_attention``), which reads only each row's pages.

On a mesh (``PoolLayout``, from ``pool_layout``) the pool splits two ways: kv heads
over the axes the rules give ``kv_heads`` (when they divide K), and pages over every
other mesh axis of size > 1, the G *slot groups*. Rows (slots) split over the same
axes, so group g holds pages [g N/G, (g+1) N/G) and rows [g B/G, (g+1) B/G), and
the host gives a row pages of its own group only (``generation.page_pool``). Writes
and reads then run inside ``shard_map`` on the chips that hold the row: there a page
id becomes local (id - g N/G); ids outside the group's range (the sentinel N
among them) become the local sentinel N/G. Each chip holds 1/G of the pages (of its
heads), and no collective moves the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from jaxflash.models.caches import ragged_attention
from jaxflash.models.caches.attention import attention_scale
from jaxflash.models.caches.cache_face import Allocation, Site, attend_cached
from jaxflash.models.caches.pool_layout import PoolLayout, local_page_ids
from jaxflash.models.config.model_config import ModelConfig


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
      layout: the pool's split over the engine's mesh (static); None on one device.
    """

    table_bm: jax.Array
    max_len: int = struct.field(pytree_node=False)
    kernel: bool = struct.field(pytree_node=False, default=False)
    layout: PoolLayout | None = struct.field(pytree_node=False, default=None)


@struct.dataclass
class PagedKVCache:
    """Per-layer page pools plus the rows' page table (a pytree).

    Attributes:
      kv_pages: L arrays [N, P, 2K, H] (keys even, values odd along 2K), compute dtype.
      pages: the ``PageTable`` of the rows.
    """

    kv_pages: tuple[jax.Array, ...]
    pages: PageTable

    stacked = False  # pairs with unstacked params (the unrolled forward); not a field

    @property
    def max_len(self) -> int:
        """S, positions each row can address."""
        return self.pages.max_len

    @property
    def batch(self) -> int:
        return self.pages.table_bm.shape[0]

    def layers(self, *, fresh: bool = False) -> tuple[PagedLayer, ...]:
        """L ``PagedLayer``s (each layer's pool with the shared page table).

        Raises:
          ValueError: ``fresh``: a fresh prefill writes into a dense cache only (the
            engine prefills densely and places the pages, ``generation.engine.kernels``).
        """
        if fresh:
            raise ValueError(
                "forward: fresh_cache=True needs a KVCache or LayerKVCache, got PagedKVCache"
            )
        return tuple(PagedLayer(pool, self.pages) for pool in self.kv_pages)

    def with_layers(self, layers: tuple[PagedLayer, ...]) -> PagedKVCache:
        return PagedKVCache(kv_pages=tuple(c.pool_npch for c in layers), pages=self.pages)

    # The engine's slots (``cache_face.SlotCache``): one row per slot.

    def writable(self, pos_b: jax.Array) -> jax.Array:
        """bool [B]: position ``pos_b[b]`` is one row b addresses and its page is mapped.
        The slot loop maps pages ahead of every block (``generation.page_pool``), so an
        unmapped page stops the slot instead of letting it write into nothing."""
        num_pages, page_size = self.kv_pages[0].shape[:2]
        index_b1 = (pos_b // page_size)[:, None]
        page_b = jnp.take_along_axis(self.pages.table_bm, index_b1, axis=1)[:, 0]
        return (pos_b < self.max_len) & (page_b < num_pages)

    def write_prefill(
        self, prefill: Any, row_g: jax.Array, slot_g: jax.Array, shared_pages_g=None
    ) -> PagedKVCache:
        """Rows ``row_g`` of a prefill's dense cache (a ``LayerKVCache``: keys
        [N, K, T, H], values [N, K, H, T]) into the pages of rows ``slot_g`` (this
        cache's page table), skipping each entry's first ``shared_pages_g`` pages (a
        shared prompt's, already in the pool; None: none); padding entries (slot B)
        write nothing. On a split pool each slot group writes its own rows' pages
        (``write_rows``)."""
        table_bm = self.pages.table_bm
        num_pages, page_size = self.kv_pages[0].shape[:2]
        table_gm = jnp.take(table_bm, slot_g, axis=0, mode="fill", fill_value=num_pages)
        t = prefill.max_len
        pos_gt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (slot_g.shape[0], t))
        if shared_pages_g is not None:
            pos_gt = jnp.where(pos_gt >= (shared_pages_g * page_size)[:, None], pos_gt, -1)

        def write(pool, k_nksh, v_nkhs):
            k_gtkh = k_nksh[row_g].transpose(0, 2, 1, 3)
            v_gtkh = v_nkhs[row_g].transpose(0, 3, 1, 2)
            kv_gtch = interleave_kv(k_gtkh, v_gtkh)
            return write_rows(pool, self.pages.layout, table_gm, kv_gtch, pos_gt)

        pools = tuple(map(write, self.kv_pages, prefill.k_bksh, prefill.v_bkhs))
        return self.replace(kv_pages=pools)

    def allocation(self) -> Allocation:
        """N pages of P positions per layer; the attention path the table says."""
        n, p, two_k, h = self.kv_pages[0].shape
        item = jnp.dtype(self.kv_pages[0].dtype).itemsize
        return Allocation(
            kind="paged",
            attention="tpu_kernel" if self.pages.kernel else "reference",
            rows=int(self.pages.table_bm.shape[0]),
            positions=int(self.pages.max_len),
            page_size=int(p),
            pages=int(n),
            token_bytes=len(self.kv_pages) * two_k * h * item,
            buffers=tuple(self.kv_pages),
        )


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
    layout: PoolLayout | None = None,
) -> PagedKVCache:
    """Zero pools (L x [N, P, 2K, H]) and a page table of sentinels (no row owns a page).

    Raises:
      ValueError: a size < 1, or ``layout``'s G groups not dividing num_pages or batch.
    """
    for name, value in (("batch", batch), ("max_len", max_len), ("num_pages", num_pages)):
        if value < 1:
            raise ValueError(f"init_paged_kv_cache: {name} must be >= 1, got {value}")
    if page_size < 1:
        raise ValueError(f"init_paged_kv_cache: page_size must be >= 1, got {page_size}")
    groups = 1 if layout is None else layout.groups
    if num_pages % groups or batch % groups:
        raise ValueError(
            f"init_paged_kv_cache: num_pages={num_pages} and batch={batch} must both be "
            f"divisible by the {groups} slot groups of mesh axes {layout.group_axes}"
        )
    shape = (num_pages, page_size, 2 * config.n_kv_heads, config.head_dim)
    pools = tuple(jnp.zeros(shape, config.jnp_compute_dtype) for _ in range(config.n_layers))
    table = jnp.full((batch, pages_per_row(max_len, page_size)), num_pages, jnp.int32)
    pages = PageTable(table_bm=table, max_len=max_len, kernel=kernel, layout=layout)
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


def write_rows(
    pool_npch: jax.Array,
    layout: PoolLayout | None,
    table_xm: jax.Array,
    kv_xtch: jax.Array,
    positions_xt: jax.Array,
) -> jax.Array:
    """``write_pages`` for rows that every group sees (the start program's new samples,
    [X, M] rows of the global table): each group writes the tokens whose pages it
    holds, in place; nothing crosses chips."""
    if layout is None:
        return write_pages(pool_npch, table_xm, kv_xtch, positions_xt)

    def local(pool, table, kv, pos):
        table = local_page_ids(table, layout.page_offset(pool.shape[0]), pool.shape[0])
        return write_pages(pool, table, kv, pos)

    specs = (layout.pool_spec, PartitionSpec(), layout.spec(None, None, "heads"), PartitionSpec())
    return layout.shard(local, specs, layout.pool_spec)(pool_npch, table_xm, kv_xtch, positions_xt)


def gather_views(
    pool_npch: jax.Array, table_bm: jax.Array, max_len: int
) -> tuple[jax.Array, jax.Array]:
    """Each row's pages as the dense layouts: keys [B, K, S, H], values [B, K, H, S]
    (S = ``max_len``; entries that hold no page clip to a real page, masked later)."""
    b, m = table_bm.shape
    _, page_size, two_k, h = pool_npch.shape
    rows_bmpch = jnp.take(pool_npch, table_bm, axis=0, mode="clip")
    rows_bsch = rows_bmpch.reshape(b, m * page_size, two_k, h)[:, :max_len]
    k_bksh = rows_bsch[:, :, 0::2].transpose(0, 2, 1, 3)
    v_bkhs = rows_bsch[:, :, 1::2].transpose(0, 2, 3, 1)
    return k_bksh, v_bkhs


def _per_group(pages: PageTable, fn: Callable, pool_npch, rows: tuple, out_rows: tuple):
    """Run ``fn(pool, local table, *rows)`` on each shard of ``pages.layout`` (rows split
    over groups, their head axis 2 over heads), or once without a layout.

    ``rows`` and ``out_rows`` pair each [B, ...] array with its spec dims after B.
    """
    layout = pages.layout
    arrays = [a for a, _ in rows]
    if layout is None:
        return fn(pool_npch, pages.table_bm, *arrays)

    def local(pool, table, *arrays):
        table = local_page_ids(table, layout.page_offset(pool.shape[0]), pool.shape[0])
        return fn(pool, table, *arrays)

    in_specs = (
        layout.pool_spec,
        layout.spec("groups", None),
        *(layout.spec("groups", *dims) for _, dims in rows),
    )
    out_specs = (layout.pool_spec, *(layout.spec("groups", *dims) for dims in out_rows))
    return layout.shard(local, in_specs, out_specs)(pool_npch, pages.table_bm, *arrays)


def write_and_view(
    pool_npch: jax.Array,
    pages: PageTable,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    positions_bt: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write the new tokens' k/v, then read every row's pages (the pure-JAX path).

    On a mesh both run per shard (``PoolLayout``): the views come out split over the
    slot groups and kv heads.

    Returns:
      (updated pool [N, P, 2K, H], keys [B, K, S, H], values [B, K, H, S]).
    """

    def fn(pool, table, k, v, pos):
        pool = write_pages(pool, table, interleave_kv(k, v), pos)
        return (pool, *gather_views(pool, table, pages.max_len))

    rows = (
        (k_btkh, (None, "heads", None)),
        (v_btkh, (None, "heads", None)),
        (positions_bt, (None,)),
    )
    views = (("heads", None, None), ("heads", None, None))
    return _per_group(pages, fn, pool_npch, rows, views)


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

    Per shard on a mesh (``PoolLayout``): each chip writes and reads only its own
    pages, for its own rows and heads. Each row's T tokens must sit at consecutive
    positions ending at ``positions_bt[b, -1]`` (decode: T = 1); the kernel reads
    only the pages up to that position (``models.caches.ragged_attention.attend``), where
    the pure-JAX path reads all M of every row. Equal to the reference within float
    rounding, not bit for bit.

    Returns:
      (updated pool [N, P, 2K, H], attention output [B, T, N, H] in q's dtype).

    Raises:
      ValueError: the kernel cannot tile one shard's heads.
    """

    def fn(pool, table, q, k, v, pos):
        pool = write_pages(pool, table, interleave_kv(k, v), pos)
        out = ragged_attention.attend(
            q, pool, table, pos, scale=scale, sliding_window=sliding_window
        )
        return pool, out

    heads = (None, "heads", None)
    rows = ((q_btnh, heads), (k_btkh, heads), (v_btkh, heads), (positions_bt, (None,)))
    return _per_group(pages, fn, pool_npch, rows, (heads,))


def kernel_supported(config: ModelConfig, layout: PoolLayout | None = None) -> bool:
    """Whether the TPU kernel tiles the heads of one shard of ``layout``
    (``models.caches.ragged_attention.kernel_supported``)."""
    return ragged_attention.kernel_supported(config, 1 if layout is None else layout.head_shards)


@struct.dataclass
class PagedLayer:
    """One layer of a ``PagedKVCache`` (a ``cache_face.LayerCache``).

    Attributes:
      pool_npch: [N, P, 2K, H] the layer's page pool (keys even, values odd along 2K).
      pages: the rows' ``PageTable`` (shared by every layer; ``kernel`` picks the path).
    """

    pool_npch: jax.Array
    pages: PageTable

    def attend(self, config, q_btnh, k_btkh, v_btkh, site: Site):
        """Write the new tokens' k/v into their pages and attend: with the TPU kernel
        when ``pages.kernel`` (``kernel_attention``), else over the gathered dense views
        (``write_and_view``, then ``cache_face.attend_cached``)."""
        if self.pages.kernel:
            if config.exact_numerics:
                raise ValueError(
                    "PagedLayer: ModelConfig.exact_numerics needs the reference paged path; "
                    "the TPU kernel (EngineConfig.paged_kernel) has its own reduction order"
                )
            window = config.sliding_window if site.sliding is True else None
            pool_npch, attn_btnh = kernel_attention(
                self.pool_npch, self.pages, q_btnh, k_btkh, v_btkh, site.positions_bt,
                scale=attention_scale(config, config.head_dim), sliding_window=window,
            )  # fmt: skip
            return attn_btnh, PagedLayer(pool_npch, self.pages)
        pool_npch, keys_bksh, values_bkhs = write_and_view(
            self.pool_npch, self.pages, k_btkh, v_btkh, site.positions_bt
        )
        attn_btnh = attend_cached(config, q_btnh, keys_bksh, values_bkhs, site)
        return attn_btnh, PagedLayer(pool_npch, self.pages)
