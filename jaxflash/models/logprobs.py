"""Per-token log-probabilities of targets under the processed sampling distribution.

The learner scores ``log q(target)`` where q is the temperature / top-k / top-p
distribution the engine sampled from (``processed_log_softmax``), never the
full-vocabulary softmax unless sampling used it (importance ratios of an
unchanged policy must be 1). KL terms use the tempered full-vocabulary softmax
instead (``full_vocab=True``); see ``algorithms.distributions`` for both.
Logits for a [B, T] batch of a 49k vocabulary would be [B, T, V] floats; we
compute them ``chunk`` tokens at a time under
``jax.checkpoint`` so neither the forward nor the backward pass holds more than
[B, chunk, V] logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.algorithms.distributions import (
    entropy_from_logprobs,
    floor_logprobs,
    processed_log_softmax,
)


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
      chunk: static tokens per chunk (T is padded up to a multiple of it).
      valid_vocab_size: static; ids >= it are padded rows, outside every
        distribution (``ModelConfig.valid_vocab_size``).
      full_vocab: static; also return ``full_logp_bt`` = log softmax(z / T)[target]
        over the valid ids without top-k / top-p (the distribution KL terms use).

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
    chunk = min(chunk, time)
    n_chunks = -(-time // chunk)
    pad = n_chunks * chunk - time
    h_pad = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
    ids_pad = jnp.pad(target_ids_bt, ((0, 0), (0, pad)))
    # [n, B, c, ...]: lax.map runs over the leading (chunk) axis.
    h_nbcd = h_pad.reshape(batch, n_chunks, chunk, -1).transpose(1, 0, 2, 3)
    ids_nbc = ids_pad.reshape(batch, n_chunks, chunk).transpose(1, 0, 2)

    # checkpoint: the backward pass recomputes each chunk's logits instead of
    # keeping all n chunks' [B, c, V] residuals alive at once.
    @jax.checkpoint
    def one_chunk(args):
        h_bcd, ids_bc = args
        logits_bcv = logits_from_hidden(h_bcd, unembed_dv)
        logq_bcv = processed_log_softmax(
            logits_bcv,
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            valid_vocab_size=valid_vocab_size,
        )
        out = [_gather(logq_bcv, ids_bc), entropy_from_logprobs(logq_bcv)]
        if full_vocab:
            full_bcv = processed_log_softmax(
                logits_bcv, temperature=temp, valid_vocab_size=valid_vocab_size
            )
            out.append(_gather(full_bcv, ids_bc))
        return tuple(out)

    outs_nbc = jax.lax.map(one_chunk, (h_nbcd, ids_nbc))
    return tuple(x.transpose(1, 0, 2).reshape(batch, -1)[:, :time] for x in outs_nbc)


def _gather(logq_bcv: jax.Array, ids_bc: jax.Array) -> jax.Array:
    """log q(target), floored outside the support (see ``floor_logprobs``)."""
    return floor_logprobs(jnp.take_along_axis(logq_bcv, ids_bc[..., None], axis=-1)[..., 0])
