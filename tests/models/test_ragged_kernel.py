"""``models.caches.ragged_attention.attend`` (the TPU decode/prefill kernel's wrapper) on CPU.

The Mosaic kernel ``ragged_paged_attention`` cannot run here: jax 0.10.2 can
interpret neither it under ``pltpu.force_tpu_interpret_mode`` (``'ReshapeTransform'
object has no attribute 'indices'``) nor under ``pallas_call(interpret=True)``
(``'TypedInt' object has no attribute 'shape'``); ``test_tpu_compile.py`` compiles it
for abstract v5e chips. What is checked here is everything around the kernel, against
a float64 attention over the pages: the wrapper's arguments in the kernel's contract
(the kernel's own ``ref_ragged_paged_attention`` stands in for it), idle slots and
unmapped page-table entries, rows of several queries, sliding windows and the
row chunking that keeps a call's page table within SMEM. The last test is the kernel
itself, interpreted, expected to fail until jax can interpret it (strict: once it
passes, the marker must go and the kernel is tested for real).
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu_kernel

from jaxflash.models.caches import ragged_attention

N_HEADS, KV_HEADS, HEAD_DIM, PAGE, PAGES = 4, 2, 128, 4, 12
SCALE = 0.125


def _case(t: int, seed: int = 0):
    """Four rows of T queries over a 12-page pool, M = 4 pages per row:
    row 0 spans 3 pages (10 positions), row 1 fills its 4 pages (16), row 2 is an
    idle slot (no first page), row 3 sits inside its first page (T positions)."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((PAGES, PAGE, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((4, t, N_HEADS, HEAD_DIM)).astype(np.float32)
    sentinel = PAGES  # any id >= N_pages holds no page
    table = np.array(
        [[5, 2, 9, sentinel], [1, 7, 3, 11], [sentinel] * 4, [8, sentinel, sentinel, sentinel]],
        np.int32,
    )
    ends = np.array([9, 15, 0, t - 1])
    positions = ends[:, None] - np.arange(t)[::-1][None]
    return q, pool, table, positions


def _reference(q, pool, table, positions, window=None):
    """float64 attention of each mapped row over its first positions[b, -1] + 1 keys."""
    b, t, n, h = q.shape
    out = np.zeros((b, t, n, h))
    for r in range(b):
        if table[r, 0] >= PAGES:
            continue
        kv_len = positions[r, -1] + 1
        pages = pool[table[r, : -(-kv_len // PAGE)]].astype(np.float64)
        keys = pages[:, :, 0::2].reshape(-1, KV_HEADS, h)[:kv_len]
        values = pages[:, :, 1::2].reshape(-1, KV_HEADS, h)[:kv_len]
        keys, values = (np.repeat(x, n // KV_HEADS, axis=1) for x in (keys, values))
        scores = np.einsum("tnh,snh->nts", q[r].astype(np.float64), keys) * SCALE
        key_pos = np.arange(kv_len)[None, None]
        query_pos = positions[r][None, :, None]
        masked = key_pos > query_pos
        if window is not None:
            masked |= key_pos <= query_pos - window
        scores = np.where(masked, -np.inf, scores)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[r] = np.einsum("nts,snh->tnh", weights, values)
    return out


@pytest.fixture
def reference_kernel(monkeypatch):
    """Stand the kernel's reference in for the kernel, recording each call's arguments."""
    calls = []

    def kernel(q, kv, kv_lens, table, cu_q_lens, num_seqs, **kw):
        calls.append(dict(rows=table.shape[0], kv_lens=np.asarray(kv_lens), table=table, **kw))
        tiling = ("num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes")
        for name in tiling:
            kw.pop(name)
        return tpu_kernel.ref_ragged_paged_attention(
            q, kv, kv_lens, table, cu_q_lens, num_seqs, **kw
        )

    module = types.SimpleNamespace(
        ragged_paged_attention=kernel, get_min_heads_per_blk=tpu_kernel.get_min_heads_per_blk
    )
    monkeypatch.setattr(ragged_attention, "_kernel_module", lambda: module)
    return calls


@pytest.mark.parametrize("t, window", [(1, None), (3, None), (1, 6)])
def test_attend_maps_rows_into_the_kernel_contract(reference_kernel, t, window):
    q, pool, table, positions = _case(t)
    out = ragged_attention.attend(
        jnp.asarray(q), jnp.asarray(pool), jnp.asarray(table), jnp.asarray(positions),
        scale=SCALE, sliding_window=window,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == jnp.float32
    want = _reference(q, pool, table, positions, window)
    live = np.array([0, 1, 3])  # row 2 is an idle slot: junk that no caller reads
    np.testing.assert_allclose(np.asarray(out)[live], want[live], atol=2e-5, rtol=2e-5)
    (call,) = reference_kernel
    # Every DMA stays inside the pool: unmapped entries read page 0, the idle slot
    # attends over T positions of page 0.
    assert np.asarray(call["table"]).max() < PAGES
    np.testing.assert_array_equal(call["kv_lens"], [10, 16, t, t])
    assert call["num_kv_pages_per_block"] <= table.shape[1]
    assert call["num_queries_per_block"] <= 4 * t
    assert call["vmem_limit_bytes"] >= ragged_attention.MIN_VMEM_LIMIT_BYTES


def test_attend_chunks_rows_so_each_page_table_fits_smem(reference_kernel, monkeypatch):
    # 32 bytes of table per call = 2 rows of M = 4 int32 entries: 4 rows in 2 calls.
    monkeypatch.setattr(ragged_attention, "SMEM_TABLE_BYTES", 32)
    q, pool, table, positions = _case(2, seed=1)
    out = ragged_attention.attend(
        jnp.asarray(q), jnp.asarray(pool), jnp.asarray(table), jnp.asarray(positions),
        scale=SCALE, sliding_window=None,
    )  # fmt: skip
    assert [c["rows"] for c in reference_kernel] == [2, 2]
    want = _reference(q, pool, table, positions)
    live = np.array([0, 1, 3])
    np.testing.assert_allclose(np.asarray(out)[live], want[live], atol=2e-5, rtol=2e-5)


def test_attend_names_heads_the_kernel_cannot_tile():
    q, pool, table, positions = _case(1)
    with pytest.raises(ValueError, match="head_dim % 128"):
        ragged_attention.attend(
            jnp.asarray(q[..., :64]), jnp.asarray(pool[..., :64]), jnp.asarray(table),
            jnp.asarray(positions), scale=SCALE, sliding_window=None,
        )  # fmt: skip


@pytest.mark.xfail(
    strict=True,
    reason="jax 0.10.2 cannot interpret ragged_paged_attention on CPU "
    "('ReshapeTransform' object has no attribute 'indices')",
)
def test_the_kernel_interpreted_matches_the_reference():
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

    q, pool, table, positions = _case(1)
    kv_lens = jnp.asarray([10, 16], jnp.int32)
    rows = (jnp.asarray(q[[0, 1], 0]), jnp.asarray(pool), kv_lens, jnp.asarray(table[:2]))
    run = functools.partial(
        tpu_kernel.ragged_paged_attention,
        *rows,
        jnp.arange(3, dtype=jnp.int32),
        jnp.asarray([2], jnp.int32),
        sm_scale=SCALE,
    )
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = jax.block_until_ready(
            run(num_kv_pages_per_block=2, num_queries_per_block=1, vmem_limit_bytes=16 << 20)
        )
    want = _reference(q, pool, table, positions)[[0, 1], 0]
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
