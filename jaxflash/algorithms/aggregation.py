"""Per-token losses -> one scalar, with an explicit mode and global normalisers.

A batch split into micro-batches must give the same loss and gradient as the
whole batch. Averaging each micro-batch by its own token count and then weighting
micro-batches by their sample share does not: sequences with token losses [1, 1]
and [0]*8 give 0.5 that way and 0.2 as a true token mean ("Micro-batch
invariance", tests/algorithms/test_aggregation.py). So every mode divides a
*sum* by a normaliser counted over the whole batch (``batch_normalizers``) and
passed in; summing the per-micro-batch results then equals the full-batch result
exactly (up to float addition order), for values and gradients alike.

Modes (n_b valid tokens of sequence b, N = num_tokens, S = num_sequences):
  token-mean               sum_bt l_bt / N
  seq-mean-token-sum       sum_b (sum_t l_bt) / S
  seq-mean-token-mean      sum_b (sum_t l_bt / n_b) / S
  seq-mean-token-sum-norm  sum_bt l_bt / (S * max_tokens)   (Dr. GRPO, arXiv 2503.20783)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _check(loss_bt: jax.Array, mask_bt: jax.Array) -> None:
    if loss_bt.ndim != 2:
        raise ValueError(f"loss_bt must be [B, T], got shape {loss_bt.shape}")
    if mask_bt.shape != loss_bt.shape:
        raise ValueError(f"mask_bt shape {mask_bt.shape} must equal loss_bt shape {loss_bt.shape}")


def batch_normalizers(mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Global normalisers of a full batch: (valid tokens, sequences with >= 1 valid token).

    Args:
      mask_bt: [B, T], > 0 where a token carries loss. Call it on the *whole*
        batch (before splitting into micro-batches).

    Returns:
      (num_tokens, num_sequences): float32 scalars.
    """
    valid_bt = jnp.asarray(mask_bt) > 0
    num_tokens = jnp.sum(valid_bt).astype(jnp.float32)
    num_sequences = jnp.sum(jnp.any(valid_bt, axis=-1)).astype(jnp.float32)
    return num_tokens, num_sequences


def aggregate(
    loss_bt: jax.Array,
    mask_bt: jax.Array,
    mode: str,
    *,
    num_tokens: jax.Array | float | None = None,
    num_sequences: jax.Array | float | None = None,
    max_tokens: int | None = None,
) -> jax.Array:
    """Reduces per-token losses to a scalar under ``mode`` (see module docstring).

    Args:
      loss_bt: float [B, T] per-token loss. Values behind the mask may be NaN/Inf:
        they are selected away with ``jnp.where`` and never reach the sum or the
        gradient.
      mask_bt: [B, T], > 0 where the token carries loss.
      mode: one of ``AGGREGATION_MODES``.
      num_tokens: total valid tokens of the *full* batch (token-mean). Defaults to
        this call's count, which is right only when the call sees the full batch.
      num_sequences: total sequences with a valid token in the full batch (the
        seq-mean-* modes). Same default rule. Empty (all-masked) rows never count.
      max_tokens: the constant length normaliser of seq-mean-token-sum-norm
        (Dr. GRPO uses the generation budget); required for that mode only.

    Returns:
      float32 scalar. A zero normaliser (nothing valid) gives 0, not NaN.

    Raises:
      ValueError: unknown mode, shape mismatch, or missing/invalid max_tokens.
    """
    loss_bt = jnp.asarray(loss_bt)
    mask_bt = jnp.asarray(mask_bt)
    _check(loss_bt, mask_bt)
    valid_bt = mask_bt > 0
    l_bt = jnp.where(valid_bt, loss_bt.astype(jnp.float32), 0.0)
    local_tokens, local_seqs = batch_normalizers(valid_bt)
    n_tok = local_tokens if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
    n_seq = local_seqs if num_sequences is None else jnp.asarray(num_sequences, jnp.float32)
    if mode == "token-mean":
        return jnp.sum(l_bt) / jnp.maximum(n_tok, 1.0)
    if mode == "seq-mean-token-sum":
        return jnp.sum(l_bt) / jnp.maximum(n_seq, 1.0)
    if mode == "seq-mean-token-mean":
        len_b = jnp.sum(valid_bt, axis=-1).astype(jnp.float32)
        seq_b = jnp.sum(l_bt, axis=-1) / jnp.maximum(len_b, 1.0)
        return jnp.sum(seq_b) / jnp.maximum(n_seq, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if max_tokens is None or max_tokens < 1:
            raise ValueError(
                f"aggregate mode 'seq-mean-token-sum-norm' needs max_tokens >= 1, got {max_tokens}"
            )
        return jnp.sum(l_bt) / (jnp.maximum(n_seq, 1.0) * float(max_tokens))
    raise ValueError(f"unknown aggregation mode {mode!r}; choose from {AGGREGATION_MODES}")
