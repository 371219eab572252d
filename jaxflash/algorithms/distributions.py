"""The sampling distribution, shared by the engine (sampling + behaviour logprobs)
and the learner (recomputed logprobs), so both score the same distribution.

Temperature, top-k and top-p turn logits z into a *processed* distribution
    q(v) ∝ exp(z_v / T)  for v in the kept set, 0 elsewhere.
The engine samples from q and records log q(token); the learner must score the
same q (not the full-vocabulary softmax), otherwise the importance ratio of an
unchanged policy is not 1 ("Importance ratios", tests/algorithms/test_distributions.py).

Top-k keeps every token whose scaled logit is >= the k-th largest (ties kept on
both sides alike). Top-p keeps, in descending order, each token whose cumulative
probability *before* it is < p (so the most likely token is always kept), computed
after top-k, as in HF/vLLM.

Padded vocabularies: checkpoints pad their embedding to a multiple of 64/128 rows
beyond the tokenizer's ids (``ModelConfig.valid_vocab_size``). Ids >= that size
are removed here, before top-k / top-p, so they are never sampled and the engine
and the learner — both calling this function — score the same distribution
(importance ratios of an unchanged policy stay exactly 1).

Which distribution each quantity is defined on (no loss, metric or ratio carries
the -1e30 stand-in for log 0):

- behaviour and policy logprobs for importance ratios: log q, the processed
  distribution above (the one sampled from). A target *outside* q's support
  (possible for stale samples, or a reference model) reads ``LOGPROB_FLOOR``
  (-100 nats, probability ~4e-44) instead of -1e30, with zero gradient.
- KL to a reference model: the temperature-scaled full-vocabulary softmax
  ``log softmax(z / T)`` over valid ids, for the policy and the reference alike
  (``processed_log_softmax(z, temperature=T, valid_vocab_size=...)`` without
  top-k / top-p), so the reference never reads -1e30 for a token outside its
  own nucleus and the estimate is the KL between the two tempered models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite stand-in for -inf: keeps exp() at 0 without NaN in gradients
LOGPROB_FLOOR = -100.0  # log-probability read for a target outside the support (see above)


def processed_log_softmax(
    logits_xv: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    valid_vocab_size: int | None = None,
) -> jax.Array:
    """Log-probabilities of the processed sampling distribution.

    Args:
      logits_xv: float [..., V] raw logits (any leading dims).
      temperature: T > 0, scalar or broadcastable to [..., 1].
      top_k: static int; 0 disables. Must be <= V.
      top_p: static float in (0, 1]; 1.0 disables.
      valid_vocab_size: static; ids >= it are padding and get NEG_INF before
        top-k / top-p. None (or V) keeps every id.

    Returns:
      float32 [..., V]: log q(v); entries outside the kept set equal NEG_INF
      (-1e30), so exp() is exactly 0 there and sums over kept entries are 1.

    Raises:
      ValueError: if top_k is outside [0, V], top_p is outside (0, 1],
        valid_vocab_size is outside [1, V], or a Python-number temperature is <= 0.
    """
    vocab = logits_xv.shape[-1]
    if valid_vocab_size is not None and not 1 <= valid_vocab_size <= vocab:
        raise ValueError(f"valid_vocab_size must be in [1, vocab={vocab}], got {valid_vocab_size}")
    if top_k < 0 or top_k > vocab:
        raise ValueError(f"top_k must be in [0, vocab={vocab}], got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    # Python numbers are checked eagerly; arrays may be traced, so they are the caller's job.
    if isinstance(temperature, int | float) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits_xv.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    keep = jnp.ones(z.shape, dtype=bool)
    if valid_vocab_size is not None and valid_vocab_size < vocab:
        keep = jnp.broadcast_to(jnp.arange(vocab) < valid_vocab_size, z.shape)
        z = jnp.where(keep, z, NEG_INF)  # padding never reaches the top-k / top-p sets
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        keep = keep & (z >= kth)
    if top_p < 1.0:
        masked = jnp.where(keep, z, NEG_INF)
        order = jnp.argsort(-masked, axis=-1)
        sorted_z = jnp.take_along_axis(masked, order, axis=-1)
        sorted_p = jax.nn.softmax(sorted_z, axis=-1)
        cum_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = cum_before < top_p
        # Scatter the sorted decision back to vocabulary order.
        inv = jnp.argsort(order, axis=-1)
        keep = keep & jnp.take_along_axis(keep_sorted, inv, axis=-1)
    masked = jnp.where(keep, z, NEG_INF)
    logq = jax.nn.log_softmax(masked, axis=-1)
    return jnp.where(keep, logq, NEG_INF)


def floor_logprobs(logp_x: jax.Array) -> jax.Array:
    """Read log-probabilities of targets: NEG_INF (outside the support) -> LOGPROB_FLOOR.

    Args:
      logp_x: float [...] values gathered from ``processed_log_softmax``.

    Returns:
      float32 [...]: unchanged inside the support (a kept entry is > -1e29 in
      float32), LOGPROB_FLOOR outside it; the gradient there is 0.
    """
    logp_x = logp_x.astype(jnp.float32)
    return jnp.where(logp_x > NEG_INF / 2, logp_x, LOGPROB_FLOOR)


def entropy_from_logprobs(logq_xv: jax.Array) -> jax.Array:
    """Entropy -sum q log q of a processed distribution.

    Args:
      logq_xv: float [..., V] as returned by ``processed_log_softmax``.

    Returns:
      float32 [...] entropy in nats; masked entries (NEG_INF) contribute 0.
    """
    q = jnp.exp(logq_xv)
    return -jnp.sum(jnp.where(q > 0, q * logq_xv, 0.0), axis=-1)
