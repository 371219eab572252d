"""The exact mode's building blocks (``ModelConfig.exact_numerics``): every token's
logits computed with the same operations in the same order whatever batch it rides in.

XLA picks a matmul's kernel, blocking and reduction order from its shapes, so a
token's result depends on the rows around it: on CPU row 0 of ``x[:M] @ W`` differs
between M = 1, 2..63 and >= 64. The engine's decode has B slot rows, its prefill N x T
bucket rows, the learner b x T micro-batch rows: the same token meets three shapes.
Two rules remove that dependence:

- **Fixed row blocks** (``row_blocks``): every per-token computation (norms,
  projections, MLP, LM head, log-softmax) runs on blocks of exactly ``EXACT_ROWS``
  rows in a ``lax.map``, the tokens flattened and zero-padded to a whole number of
  blocks. Each compiled dot then has one shape on every side, and a row's result
  does not depend on the other rows of its block (checked bitwise on CPU for fp32
  and bf16 at every row position).
- **One attention layout and order** (``exact_attention``): a query attends over its
  own sequence's keys in blocks of ``EXACT_KEYS`` *positions* (block c holds
  positions c·EXACT_KEYS ..), in position order, with an online softmax (arXiv
  2205.14135) whose statistics are float32. The learner's rows (packed or not), a
  prefill bucket and a dense or paged decode cache all present the keys this way;
  blocks past the query's position are masked, and a fully masked block leaves the
  running max, sum and output bit-for-bit unchanged (factor exp(0) = 1, added
  terms exactly 0), so the key length (T, bucket, S) does not matter either.

Cost: padding to whole blocks, a sequential ``lax.map`` over row blocks (weights
read once per block), attention over every key block of the key array (no causal
skip) with a gather per block. docs/CONSISTENCY.md has the measured cost.

Shapes: B batch, T tokens, N query heads, K kv heads, G = N / K, H head dim, S keys,
R = EXACT_ROWS, C = EXACT_KEYS, M rows (tokens) flattened.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

EXACT_ROWS = 8  # rows per block: the decode's slot count is padded up to it
EXACT_KEYS = 64  # key positions per attention block


def row_blocks(fn: Callable, *xs_m: jax.Array, rows: int = EXACT_ROWS):
    """``fn`` applied to fixed blocks of ``rows`` rows of every ``xs_m`` (leading axis M).

    Args:
      fn: maps arrays with leading axis ``rows`` to a pytree of arrays with leading
        axis ``rows`` (a row's outputs must depend only on that row's inputs).
      xs_m: arrays with the same leading M; zero rows pad M up to a multiple of
        ``rows`` (their outputs are dropped).

    Returns:
      ``fn``'s pytree with leading axis M.
    """
    m = xs_m[0].shape[0]
    n = -(-m // rows)

    def blocks(x):
        x = jnp.pad(x, [(0, n * rows - m)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n, rows, *x.shape[1:])

    out = jax.lax.map(lambda args: fn(*args), tuple(blocks(x) for x in xs_m))
    return jax.tree.map(lambda y: y.reshape(n * rows, *y.shape[2:])[:m], out)


def exact_attention(
    config,
    q_btnh: jax.Array,
    positions_bt: jax.Array,
    keys_bskh: jax.Array,
    values_bskh: jax.Array,
    *,
    offset_bt: jax.Array | None = None,
    sliding: bool | jax.Array = False,
) -> jax.Array:
    """Causal grouped-query attention in the exact mode's one layout and order.

    Query (b, t) at position p sees the keys of positions 0..p of its sequence (and
    p - j < window on a sliding layer), which sit at indices ``offset + j`` of row b.

    Args:
      config: ``ModelConfig`` (group size, compute dtype, query scale, window).
      q_btnh: [B, T, N, H] queries (RoPE applied).
      positions_bt: int32 [B, T] query positions (< 0: a padding query, output 0).
      keys_bskh, values_bskh: [B, S, K, H] every key and value the rows hold.
      offset_bt: int32 [B, T] index of the query's sequence position 0 in its row
        (a packed learner row's segment start); None: 0 (a cache indexed by position).
      sliding: this layer attends within ``config.sliding_window`` (bool or traced).

    Returns:
      [B, T, N, H] in the compute dtype.
    """
    from jaxflash.models.caches.attention import attention_scale  # same floor

    b, t, n, h = q_btnh.shape
    s, k, g = keys_bskh.shape[1], config.n_kv_heads, config.group_size
    cd, f32 = config.jnp_compute_dtype, jnp.float32
    scale, window = attention_scale(config, h), config.sliding_window
    n_blocks = -(-s // EXACT_KEYS)
    offset_bt = jnp.zeros_like(positions_bt) if offset_bt is None else offset_bt
    row_bt = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    keys_bskh, values_bskh = keys_bskh.astype(cd), values_bskh.astype(cd)

    def block(q_rnh, row_r, pos_r, off_r):
        q_rkgh = q_rnh.reshape(-1, k, g, h).astype(cd)

        def step(carry, c):
            m_rkg, l_rkg, acc_rkgh = carry
            key_pos_c = c * EXACT_KEYS + jnp.arange(EXACT_KEYS, dtype=jnp.int32)
            idx_rc = off_r[:, None] + key_pos_c[None, :]
            visible_rc = (key_pos_c[None, :] <= pos_r[:, None]) & (idx_rc < s) & (idx_rc >= 0)
            if window is not None and sliding is not False:
                near_rc = pos_r[:, None] - key_pos_c[None, :] < window
                visible_rc = visible_rc & (near_rc if sliding is True else near_rc | ~sliding)
            idx_rc = jnp.clip(idx_rc, 0, s - 1)
            k_rckh = keys_bskh[row_r[:, None], idx_rc]
            v_rckh = jnp.where(visible_rc[..., None, None], values_bskh[row_r[:, None], idx_rc], 0)
            scores = jnp.einsum("rkgh,rckh->rkgc", q_rkgh, k_rckh, preferred_element_type=f32)
            scores = jnp.where(visible_rc[:, None, None], scores * scale, -jnp.inf)
            m_new = jnp.maximum(m_rkg, jnp.max(scores, axis=-1))
            base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet: nothing to shift
            p_rkgc = jnp.exp(scores - base[..., None])
            fix = jnp.exp(m_rkg - base)  # exactly 1 after a fully masked block
            l_new = l_rkg * fix + jnp.sum(p_rkgc, axis=-1)
            pv = jnp.einsum(
                "rkgc,rckh->rkgh", p_rkgc.astype(cd), v_rckh, preferred_element_type=f32
            )
            return (m_new, l_new, acc_rkgh * fix[..., None] + pv), None

        r = q_rnh.shape[0]
        init = (
            jnp.full((r, k, g), -jnp.inf, f32),
            jnp.zeros((r, k, g), f32),
            jnp.zeros((r, k, g, h), f32),
        )
        (_, l_rkg, acc_rkgh), _ = jax.lax.scan(step, init, jnp.arange(n_blocks, dtype=jnp.int32))
        out = acc_rkgh / jnp.where(l_rkg > 0, l_rkg, 1.0)[..., None]
        return out.reshape(r, n, h).astype(cd)

    # Each row block is recomputed in the backward pass from its inputs, so the
    # gathered key blocks are never all held at once.
    out_mnh = row_blocks(
        jax.checkpoint(block),
        q_btnh.reshape(b * t, n, h),
        row_bt.reshape(-1),
        positions_bt.reshape(-1).astype(jnp.int32),
        offset_bt.reshape(-1).astype(jnp.int32),
    )
    return out_mnh.reshape(b, t, n, h)


def segment_offsets(positions_bt: jax.Array) -> jax.Array:
    """int32 [B, T] index of each token's sequence start in its row: index - position
    (packed segments restart their positions at 0; an unpacked row gives 0)."""
    t = positions_bt.shape[1]
    return jnp.arange(t, dtype=jnp.int32)[None, :] - positions_bt.astype(jnp.int32)
