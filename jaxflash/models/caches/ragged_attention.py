"""The TPU kernel ``ragged_paged_attention`` over one shard of a paged KV pool.

``attend`` runs ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (jax
0.10.2) for the rows of one shard: queries [B, T, N, H], the shard's pool
[N_pages, P, 2K, H] (``models.caches.paged_kv_cache``'s layout) and a page table of
*local* page ids. ``models.caches.paged_kv_cache.kernel_attention`` calls it, under
``shard_map`` on a multi-chip mesh.

Block sizes are ours, not the kernel's tuned table: its lookup reads
``jax.devices()[0]`` (the CPU when compiling for abstract chips) and has no
entries for v5e. The rule (``block_sizes``):

- heads: the smallest head block the kernel can tile (its own
  ``get_min_heads_per_blk``);
- KV pages per block: ``KV_TOKENS_PER_BLOCK // P`` pages (at least 1, at most a
  row's M). The kernel issues one DMA per page of a block whether or not the row
  reaches it (pages past a row's length re-read its page 0), so a row of L
  positions reads ceil(ceil(L / P) / pages_per_block) * pages_per_block pages: a
  small block wastes little on short rows, a large one makes fewer loop steps;
  512 tokens per block is a middle of the kernel's tuned v6e entries (4-16 pages
  of 128);
- queries per block: ``QUERIES_PER_BLOCK`` (the kernel's default), at most the
  shard's query tokens;
- VMEM limit: twice what the blocks need (double-buffered KV pages, q and output
  blocks, float32 accumulators), at least ``MIN_VMEM_LIMIT_BYTES`` (the scoped
  default of v5e; every TPU generation from v4 on has at least that much VMEM).
- rows per call: the kernel prefetches its whole page table into SMEM (scalar
  memory, 1 MiB on v5p). 256 rows x 1,024 pages (32k positions in pages of 32) are
  1 MiB of int32 and the compiler refuses the program ("Ran out of memory in memory
  space smem", Llama-3.1-8B's engine on v5p, libtpu 0.0.42.1). ``attend`` therefore
  calls the kernel on chunks of at most ``rows_per_call`` rows, whose tables take at
  most ``SMEM_TABLE_BYTES``; the pool is shared, the outputs are concatenated.

The kernel never reads a page-table entry past a row's length, except page 0 of
the row (the padding of its last block). ``attend`` therefore maps entries that
hold no page (the local sentinel) to page 0 of the shard, and gives rows without
a first page (idle slots) a length of T, so every DMA stays inside the pool and an
idle slot costs one block of reads; their outputs are junk that no caller reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.models.config.model_config import ModelConfig

KV_TOKENS_PER_BLOCK = 512
QUERIES_PER_BLOCK = 32
MIN_VMEM_LIMIT_BYTES = 16 << 20
SMEM_TABLE_BYTES = 512 << 10
"""Page-table bytes one kernel call may prefetch into SMEM (half of v5p's 1 MiB: the
kernel's other scalars and Mosaic's own need the rest)."""


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Static tiling of one ``ragged_paged_attention`` call.

    Attributes:
      q_heads, kv_heads: query heads and combined (2 x kv) heads per head block.
      kv_pages: KV pages per flash-attention block (``num_kv_pages_per_block``).
      queries: query tokens per block (``num_queries_per_block``).
      vmem_limit_bytes: the kernel's scoped VMEM limit.
    """

    q_heads: int
    kv_heads: int
    kv_pages: int
    queries: int
    vmem_limit_bytes: int


def _kernel_module():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (  # noqa: PLC0415
        kernel,
    )

    return kernel


def head_blocks(n_q_heads: int, n_kv_heads: int, dtype) -> tuple[int, int]:
    """(query heads, combined kv heads) per head block: the kernel's own choice.

    Raises:
      ValueError: the kernel cannot tile these heads (jax 0.10.2 needs 2K over the
        dtype's packing to be 1, 2, 4 or a multiple of 8, and K to divide N).
    """
    if n_kv_heads < 1 or n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads do not split over {n_kv_heads} kv heads")
    try:
        return _kernel_module().get_min_heads_per_blk(n_q_heads, 2 * n_kv_heads, dtype, dtype)
    except (ValueError, AssertionError) as err:
        raise ValueError(
            f"ragged_paged_attention cannot tile {n_q_heads} query / {n_kv_heads} kv heads "
            f"in {jnp.dtype(dtype).name}: {err}"
        ) from None


def kernel_supported(config: ModelConfig, head_shards: int = 1) -> bool:
    """Whether the kernel tiles the heads one chip holds when kv heads split ``head_shards``
    ways, and their size (jax 0.10.2 needs H to be a multiple of 128: its float32
    statistics are 128 lanes wide). Not SmolLM2 (3 kv heads of 64); Qwen2.5-1.5B's 2
    heads of 128 in bfloat16, yes."""
    n, k = config.n_heads, config.n_kv_heads
    if n % head_shards or k % head_shards or config.head_dim % 128:
        return False
    try:
        head_blocks(n // head_shards, k // head_shards, config.jnp_compute_dtype)
    except ValueError:
        return False
    return True


def block_sizes(
    *,
    num_tokens: int,
    pages_per_row: int,
    page_size: int,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype,
) -> KernelBlocks:
    """The tiling rule of the module docstring, for one shard's shapes.

    Args:
      num_tokens: query tokens of the call (rows x T).
      pages_per_row: M, page-table entries per row.
      page_size: P, positions per page.
      n_q_heads, n_kv_heads: heads of the shard.
      head_dim: H.
      dtype: the pool's (and the queries') dtype.

    Raises:
      ValueError: see ``head_blocks``; head_dim not a multiple of 128.
    """
    if head_dim % 128:
        raise ValueError(f"ragged_paged_attention needs head_dim % 128 == 0, got {head_dim}")
    q_heads, kv_heads = head_blocks(n_q_heads, n_kv_heads, dtype)
    kv_pages = max(1, min(pages_per_row, KV_TOKENS_PER_BLOCK // page_size))
    queries = max(1, min(num_tokens, QUERIES_PER_BLOCK))
    item = jnp.dtype(dtype).itemsize
    ratio = n_q_heads // n_kv_heads
    need = (
        2 * kv_pages * page_size * kv_heads * head_dim * item  # double-buffered KV pages
        + 2 * 2 * queries * q_heads * head_dim * item  # q and output blocks, double-buffered
        + queries * q_heads * head_dim * 4  # float32 accumulator
        + 2 * (kv_heads // 2) * queries * ratio * 128 * 4  # running max and sum
    )
    mib = 1 << 20
    limit = max(MIN_VMEM_LIMIT_BYTES, -(-2 * need // mib) * mib)
    return KernelBlocks(q_heads, kv_heads, kv_pages, queries, limit)


def rows_per_call(pages_per_row: int) -> int:
    """Rows one kernel call takes: as many as keep its int32 page table [rows, M] within
    ``SMEM_TABLE_BYTES`` (at least 1). E.g. M = 1,024 (32k positions, pages of 32): 128.
    """
    return max(1, SMEM_TABLE_BYTES // (4 * max(1, pages_per_row)))


def pages_read(kv_len: np.ndarray, page_size: int, kv_pages_per_block: int) -> np.ndarray:
    """Pages the kernel DMAs for rows of ``kv_len`` positions (per head block): whole
    blocks of ``kv_pages_per_block`` pages up to ceil(kv_len / P) (module docstring)."""
    pages = -(-np.asarray(kv_len) // page_size)
    return -(-pages // kv_pages_per_block) * kv_pages_per_block


def attend(
    q_btnh: jax.Array,
    pool_npch: jax.Array,
    table_bm: jax.Array,
    positions_bt: jax.Array,
    *,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:
    """Attention of B rows of T queries over their pages, by the TPU kernel.

    Each row's T tokens sit at consecutive positions ending at ``positions_bt[b, -1]``
    and are already written to the pool, so the row's keys are its first
    ``positions_bt[b, -1] + 1`` positions. Online softmax in float32: equal to the
    pure-JAX reference within float rounding, not bit for bit. One kernel call per
    ``rows_per_call(M)`` rows (each call's page table is prefetched into SMEM).

    Args:
      q_btnh: [B, T, N, H] queries (cast to the pool's dtype).
      pool_npch: [N_pages, P, 2K, H] this shard's pool (keys even, values odd).
      table_bm: int32 [B, M] local page ids; any id >= N_pages holds no page.
      positions_bt: int [B, T] absolute positions of the queries.
      scale: softmax scale.
      sliding_window: attend to the last ``sliding_window`` positions only, or None.

    Returns:
      [B, T, N, H] in q's dtype.

    Raises:
      ValueError: the kernel cannot tile the heads (``head_blocks``).
    """
    b, t, n, h = q_btnh.shape
    num_pages, page_size, two_k, _ = pool_npch.shape
    mapped_bm = table_bm < num_pages
    # Every DMA inside the pool: unmapped entries read page 0 (never past a row's length
    # for a running row); a row without a first page (an idle slot) attends over T.
    table_bm = jnp.where(mapped_bm, table_bm, 0).astype(jnp.int32)
    kv_len_b = jnp.where(mapped_bm[:, 0], positions_bt[:, -1] + 1, t).astype(jnp.int32)
    out_dtype, q_btnh = q_btnh.dtype, q_btnh.astype(pool_npch.dtype)
    rows = rows_per_call(table_bm.shape[1])  # the page table of a call fits SMEM
    outs = []
    for lo in range(0, b, rows):
        r = min(rows, b - lo)
        blocks = block_sizes(
            num_tokens=r * t, pages_per_row=table_bm.shape[1], page_size=page_size,
            n_q_heads=n, n_kv_heads=two_k // 2, head_dim=h, dtype=pool_npch.dtype,
        )  # fmt: skip
        outs.append(
            _kernel_module().ragged_paged_attention(
                q_btnh[lo : lo + r].reshape(r * t, n, h),
                pool_npch,
                kv_len_b[lo : lo + r],
                table_bm[lo : lo + r],
                jnp.arange(r + 1, dtype=jnp.int32) * t,
                jnp.full((1,), r, jnp.int32),
                sm_scale=scale,
                sliding_window=sliding_window,
                num_kv_pages_per_block=blocks.kv_pages,
                num_queries_per_block=blocks.queries,
                vmem_limit_bytes=blocks.vmem_limit_bytes,
            )
        )
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out.reshape(b, t, n, h).astype(out_dtype)
