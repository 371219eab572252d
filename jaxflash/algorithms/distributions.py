"""The sampling distribution, shared by the engine (sampling + behaviour logprobs)
and the learner (recomputed logprobs), so both score the same distribution.

Temperature, top-k and top-p turn logits z into a *processed* distribution
    q(v) ∝ exp(z_v / T)  for v in the kept set, 0 elsewhere.
The engine samples from q and records log q(token); the learner must score the
same q (not the full-vocabulary softmax), otherwise the importance ratio of an
unchanged policy is not 1 ("Importance ratios", tests/test_distributions.py).

Top-k keeps every token whose scaled logit is >= the k-th largest (ties kept on
both sides alike). Top-p keeps, in descending order, each token whose cumulative
probability *before* it is < p (so the most likely token is always kept), computed
after top-k, as in HF/vLLM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite stand-in for -inf: keeps exp() at 0 without NaN in gradients


def processed_log_softmax(
    logits_xv: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.Array:
    """Log-probabilities of the processed sampling distribution.

    Args:
      logits_xv: float [..., V] raw logits (any leading dims).
      temperature: T > 0, scalar or broadcastable to [..., 1].
      top_k: static int; 0 disables. Must be <= V.
      top_p: static float in (0, 1]; 1.0 disables.

    Returns:
      float32 [..., V]: log q(v); entries outside the kept set equal NEG_INF
      (-1e30), so exp() is exactly 0 there and sums over kept entries are 1.

    Raises:
      ValueError: if top_k is outside [0, V], top_p is outside (0, 1], or a
        Python-number temperature is <= 0.
    """
    vocab = logits_xv.shape[-1]
    if top_k < 0 or top_k > vocab:
        raise ValueError(f"top_k must be in [0, vocab={vocab}], got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    # Python numbers are checked eagerly; arrays may be traced, so they are the caller's job.
    if isinstance(temperature, int | float) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits_xv.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    keep = jnp.ones(z.shape, dtype=bool)
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        keep = z >= kth
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


def entropy_from_logprobs(logq_xv: jax.Array) -> jax.Array:
    """Entropy -sum q log q of a processed distribution.

    Args:
      logq_xv: float [..., V] as returned by ``processed_log_softmax``.

    Returns:
      float32 [...] entropy in nats; masked entries (NEG_INF) contribute 0.
    """
    q = jnp.exp(logq_xv)
    return -jnp.sum(jnp.where(q > 0, q * logq_xv, 0.0), axis=-1)
