"""Per-token log-probabilities of targets under the processed sampling distribution.

The learner scores ``log q(target)`` where q is the temperature / top-k / top-p
distribution the engine sampled from (``processed_log_softmax``), never the
full-vocabulary softmax unless sampling used it (importance ratios of an
unchanged policy must be 1). KL terms use the tempered full-vocabulary softmax
instead (``full_vocab=True``); see ``algorithms.distributions`` for both.
Logits for a [B, T] batch of a 49k vocabulary would be [B, T, V] floats; we
compute them ``chunk`` tokens at a time, and the backward pass recomputes each
chunk's logits (as ``jax.checkpoint`` would), so neither pass holds more than
[B, chunk, V] logits. The backward is written by hand: the derivative of log
q(target), of the entropy and (with ``full_vocab``) of the full-vocabulary log
p(target) w.r.t. the logits in one elementwise pass, then the two products,
instead of differentiating the log-softmax, the entropy and the target gather
step by step (several more passes over [B, chunk, V] and a scatter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxflash.algorithms.distributions import (
    NEG_INF,
    entropy_from_logprobs,
    floor_logprobs,
    processed_log_softmax,
)
from jaxflash.models.caches.exact import EXACT_ROWS, row_blocks


def logits_from_hidden(h_btd: jax.Array, unembed_dv: jax.Array) -> jax.Array:
    """Logits = h @ unembed, accumulated and returned in float32.

    The one place logits are formed, shared by model, engine and learner so both
    sides round alike. Inputs are promoted to a common dtype (float32 weights give
    a float32 matmul; pass bfloat16 for a bfloat16 matmul).

    Args:
      h_btd: float [..., D] final-normed hidden states.
      unembed_dv: float [D, V].

    Returns:
      float32 [..., V].
    """
    return jnp.einsum("...d,dv->...v", h_btd, unembed_dv, preferred_element_type=jnp.float32)


def target_logprobs(
    h_btd: jax.Array,
    unembed_dv: jax.Array,
    target_ids_bt: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk: int = 256,
    valid_vocab_size: int | None = None,
    full_vocab: bool = False,
    exact: bool = False,
    loss_mask_bt: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """log q(target) and entropy of q at every position, chunked over time.

    q(v) ∝ exp(z_v / T) on the top-k / top-p kept set of valid ids, z = h @ unembed.

    Args:
      h_btd: float [B, T, D] final-normed hidden states (``forward``'s output).
      unembed_dv: float [D, V] (``unembed(params, config)``).
      target_ids_bt: int [B, T] token whose log-probability to take at each position.
      temperature: T > 0; a scalar, or [B] for one temperature per row.
      top_k: static int, 0 disables.
      top_p: static float in (0, 1], 1.0 disables.
      chunk: static; at most this many tokens per chunk: T is split into
        ceil(T / chunk) chunks of equal size (padding fewer than one token per chunk).
      valid_vocab_size: static; ids >= it are padded rows, outside every
        distribution (``ModelConfig.valid_vocab_size``).
      full_vocab: static; also return ``full_logp_bt`` = log softmax(z / T)[target]
        over the valid ids without top-k / top-p (the distribution KL terms use).
      exact: static; the exact mode (``ModelConfig.exact_numerics``): the B x T
        positions are flattened and scored in fixed blocks of ``EXACT_ROWS`` rows
        (``chunk`` is unused), the blocks the engine's ``exact_logits`` /
        ``exact_log_q`` use.
      loss_mask_bt: float [B, T] or None. Given, a chunk in which no row has a
        position with mask > 0 is not scored: its outputs read 0 and it has no
        gradient (a learner batch's prompt columns: their LM-head products and
        log-softmax are skipped, forward and backward). log q(target) of a scored chunk
        is bitwise that without it; entropy and gradients equal up to float summation
        order (the chunk compiles to other fused kernels inside ``lax.cond``; ~3e-7 on
        O(1) values, tests/models/test_models.py). Ignored by ``exact``.

    Returns:
      (logp_bt, entropy_bt) or, with ``full_vocab``, (logp_bt, entropy_bt,
      full_logp_bt): float32 [B, T]. A target outside the kept set reads
      ``LOGPROB_FLOOR`` (-100, zero gradient), never -1e30; entropy in nats.

    Raises:
      ValueError: mismatched shapes, chunk < 1, or a temperature that is neither
        scalar nor [B].
    """
    if h_btd.ndim != 3 or target_ids_bt.shape != h_btd.shape[:2]:
        raise ValueError(
            f"target_logprobs: h_btd {h_btd.shape} must be [B, T, D] and target_ids_bt "
            f"{target_ids_bt.shape} must be [B, T]"
        )
    if unembed_dv.ndim != 2 or unembed_dv.shape[0] != h_btd.shape[2]:
        raise ValueError(
            f"target_logprobs: unembed_dv {unembed_dv.shape} must be [D={h_btd.shape[2]}, V]"
        )
    if chunk < 1:
        raise ValueError(f"target_logprobs: chunk must be >= 1, got {chunk}")
    batch, time, _ = h_btd.shape
    temp = jnp.asarray(temperature, jnp.float32)
    if temp.ndim == 1 and temp.shape[0] == batch:
        temp = temp[:, None, None]  # [B, 1, 1] broadcasts over [B, chunk, V]
    elif temp.ndim != 0:
        raise ValueError(
            f"target_logprobs: temperature must be a scalar or [B={batch}], got {temp.shape}"
        )
    if exact:
        return _exact_target_logprobs(
            top_k, top_p, valid_vocab_size, full_vocab, h_btd, unembed_dv, target_ids_bt, temp
        )
    # As few chunks as ``chunk`` allows, of equal size: T = 72 at chunk 64 is two
    # chunks of 36, not 64 + 64 with 56 padded positions (each padded position costs
    # its LM-head product and log-softmax, forward and backward).
    n_chunks = -(-time // min(chunk, time))
    chunk = -(-time // n_chunks)
    pad = n_chunks * chunk - time
    h_pad = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
    ids_pad = jnp.pad(target_ids_bt, ((0, 0), (0, pad)))
    # [n, B, c, ...]: lax.map runs over the leading (chunk) axis.
    h_nbcd = h_pad.reshape(batch, n_chunks, chunk, -1).transpose(1, 0, 2, 3)
    ids_nbc = ids_pad.reshape(batch, n_chunks, chunk).transpose(1, 0, 2)

    operands = (h_nbcd, ids_nbc)
    if loss_mask_bt is not None:  # [n] bool: the chunk holds a loss position
        mask_pad = jnp.pad(loss_mask_bt > 0, ((0, 0), (0, pad)))
        operands += (mask_pad.reshape(batch, n_chunks, chunk).any(axis=(0, 2)),)

    def one_chunk(args):
        h_bcd, ids_bc, *needed = args

        def score():
            return _chunk_logprobs(
                top_k, top_p, valid_vocab_size, full_vocab, h_bcd, unembed_dv, ids_bc, temp
            )

        if not needed:
            return score()
        shapes = jax.eval_shape(score)
        return jax.lax.cond(
            needed[0], score, lambda: tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
        )

    outs_nbc = jax.lax.map(one_chunk, operands)
    return tuple(x.transpose(1, 0, 2).reshape(batch, -1)[:, :time] for x in outs_nbc)


def _pad_rows(x: jax.Array, value: float = 0.0) -> jax.Array:
    """``x`` [M, ...] padded with ``value`` rows to a multiple of ``EXACT_ROWS``."""
    pad = -x.shape[0] % EXACT_ROWS
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _row_temperature(temp: jax.Array, batch: int, time: int) -> jax.Array:
    """float32 [B·T, 1, 1] temperature per flattened position (scalar or [B, 1, 1])."""
    temp_bt = jnp.broadcast_to(jnp.reshape(temp, (-1, 1)), (batch, time))
    return temp_bt.reshape(-1, 1, 1).astype(jnp.float32)


def fixed_unembed(unembed_dv: jax.Array) -> jax.Array:
    """``unembed_dv`` [D, V] materialised as its own array before the exact mode's row blocks.

    A tied head is ``embed_vd.T``. Where ``row_blocks`` runs several blocks (a loop),
    XLA hoists that transpose out of the loop and the block's dot reads a row-major
    [D, V] (contracting dim 0); where it runs one block (a decode of <= EXACT_ROWS
    slots: the loop is inlined), XLA folds the transpose into the dot (contracting dim
    1 of [V, D]) and the CPU kernel sums in another order — SmolLM2-shaped logits
    differed by 2e-6 (fp32). The barrier keeps the transpose out of the dot on every
    side, so each block's dot is the same op.
    """
    return jax.lax.optimization_barrier(unembed_dv)


def _exact_target_logprobs(top_k, top_p, valid, full_vocab, h_btd, unembed_dv, ids_bt, temp):
    """``target_logprobs`` in the exact mode: [B·T] positions in fixed row blocks."""
    unembed_dv = fixed_unembed(unembed_dv)
    batch, time, d = h_btd.shape
    m = batch * time
    h_m1d = _pad_rows(h_btd.reshape(m, 1, d))
    ids_m1 = _pad_rows(ids_bt.reshape(m, 1))
    temp_m11 = _pad_rows(_row_temperature(temp, batch, time), 1.0)  # padding: T = 1, no 0/0

    def block(h_r1d, ids_r1, temp_r11):
        return _chunk_logprobs(top_k, top_p, valid, full_vocab, h_r1d, unembed_dv, ids_r1, temp_r11)

    outs = row_blocks(block, h_m1d, ids_m1, temp_m11)
    return tuple(x[:m].reshape(batch, time) for x in outs)


def exact_logits(h_md: jax.Array, unembed_dv: jax.Array) -> jax.Array:
    """float32 [M, V] logits of [M, D] hidden states in the exact mode's row blocks
    (the engine's side of ``target_logprobs(..., exact=True)``)."""
    m, unembed_dv = h_md.shape[0], fixed_unembed(unembed_dv)
    h_m1d = _pad_rows(h_md[:, None, :])
    return row_blocks(lambda h: logits_from_hidden(h, unembed_dv), h_m1d)[:m, 0]


def exact_log_q(
    logits_mv: jax.Array,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    valid_vocab_size: int | None = None,
) -> jax.Array:
    """float32 [M, V] ``processed_log_softmax`` of ``exact_logits`` in the exact mode's
    row blocks, as ``target_logprobs(..., exact=True)`` computes it."""
    m = logits_mv.shape[0]
    temp_m11 = _pad_rows(jnp.full((m, 1, 1), temperature, jnp.float32), 1.0)

    def block(z_r1v, temp_r11):
        return processed_log_softmax(
            z_r1v, temperature=temp_r11, top_k=top_k, top_p=top_p, valid_vocab_size=valid_vocab_size
        )

    return row_blocks(block, _pad_rows(logits_mv[:, None, :]), temp_m11)[:m, 0]


def _gather(logq_bcv: jax.Array, ids_bc: jax.Array) -> jax.Array:
    """log q(target), floored outside the support (see ``floor_logprobs``)."""
    return floor_logprobs(jnp.take_along_axis(logq_bcv, ids_bc[..., None], axis=-1)[..., 0])


def _distributions(top_k, top_p, valid_vocab_size, full_vocab, h_bcd, unembed_dv, temp):
    """(log q [B, c, V], full-vocabulary log p [B, c, V] or None) of one chunk."""
    logits_bcv = logits_from_hidden(h_bcd, unembed_dv)
    logq_bcv = processed_log_softmax(
        logits_bcv, temperature=temp, top_k=top_k, top_p=top_p, valid_vocab_size=valid_vocab_size
    )
    full_bcv = None
    if full_vocab:
        full_bcv = processed_log_softmax(
            logits_bcv, temperature=temp, valid_vocab_size=valid_vocab_size
        )
    return logq_bcv, full_bcv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _chunk_logprobs(top_k, top_p, valid_vocab_size, full_vocab, h_bcd, unembed_dv, ids_bc, temp):
    """(log q(target) [B, c], entropy of q [B, c][, full log p(target) [B, c]]) of
    one chunk; q per ``processed_log_softmax`` (temperature ``temp``: scalar or
    [B, 1, 1]); targets outside a support read LOGPROB_FLOOR."""
    logq_bcv, full_bcv = _distributions(
        top_k, top_p, valid_vocab_size, full_vocab, h_bcd, unembed_dv, temp
    )
    out = (_gather(logq_bcv, ids_bc), entropy_from_logprobs(logq_bcv))
    return out + ((_gather(full_bcv, ids_bc),) if full_vocab else ())


def _chunk_fwd(top_k, top_p, valid_vocab_size, full_vocab, h_bcd, unembed_dv, ids_bc, temp):
    out = _chunk_logprobs(
        top_k, top_p, valid_vocab_size, full_vocab, h_bcd, unembed_dv, ids_bc, temp
    )
    return out, (h_bcd, unembed_dv, ids_bc, temp, out[1])


def _target_grad(logq_bcv, ids_bc, onehot_bcv, g_bc):
    """d/dz of sum g * log q(target) for a softmax q over its kept set K (NEG_INF
    outside): g (delta_tj - q_j) for j in K when the target t is in K, else 0 (a
    floored target has zero gradient). Returns (dz [B, c, V], kept [B, c, V], q)."""
    kept_bcv = logq_bcv > NEG_INF / 2
    q_bcv = jnp.where(kept_bcv, jnp.exp(logq_bcv), 0.0)
    kept_t_bc = jnp.take_along_axis(kept_bcv, ids_bc[..., None], axis=-1)[..., 0]
    g_t_bc = jnp.where(kept_t_bc, g_bc, 0.0)[..., None]
    return jnp.where(onehot_bcv, g_t_bc, 0.0) - q_bcv * g_t_bc, kept_bcv, q_bcv


def _chunk_bwd(top_k, top_p, valid_vocab_size, full_vocab, res, cotangents):
    """With z = logits / T and q the processed distribution over the kept set K:
    d log q_t / dz_j = [t in K] (delta_tj - q_j) and dH / dz_j = -q_j (log q_j + H)
    for j in K, 0 outside K (the kept set is piecewise constant in z); the same
    for the full-vocabulary p over the valid ids."""
    h_bcd, unembed_dv, ids_bc, temp, ent_bc = res
    logq_bcv, full_bcv = _distributions(
        top_k, top_p, valid_vocab_size, full_vocab, h_bcd, unembed_dv, temp
    )
    onehot_bcv = jnp.arange(logq_bcv.shape[-1])[None, None, :] == ids_bc[..., None]
    dz_bcv, kept_bcv, q_bcv = _target_grad(logq_bcv, ids_bc, onehot_bcv, cotangents[0])
    log_term_bcv = jnp.where(kept_bcv, logq_bcv, 0.0) + ent_bc[..., None]
    dz_bcv = dz_bcv - cotangents[1][..., None] * q_bcv * log_term_bcv
    if full_vocab:
        dz_bcv = dz_bcv + _target_grad(full_bcv, ids_bc, onehot_bcv, cotangents[2])[0]
    dlogits_bcv = dz_bcv / temp
    f32 = jnp.float32
    dh_bcd = jnp.einsum("bcv,dv->bcd", dlogits_bcv, unembed_dv, preferred_element_type=f32)
    dw_dv = jnp.einsum("bcd,bcv->dv", h_bcd, dlogits_bcv, preferred_element_type=f32)
    return (
        dh_bcd.astype(h_bcd.dtype),
        dw_dv.astype(unembed_dv.dtype),
        None,
        jnp.zeros_like(temp),
    )


_chunk_logprobs.defvjp(_chunk_fwd, _chunk_bwd)
