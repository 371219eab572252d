"""Per-token KL estimators (Schulman's k1/k2/k3) and entropy, with masks.

For tokens y ~ pi (the sampled responses) and a reference policy pi_ref, with
log-ratio d = log pi(y) - log pi_ref(y) and ratio rho = pi_ref(y)/pi(y) = exp(-d):
  k1 = d                       unbiased for KL(pi || pi_ref), high variance, can be < 0
  k2 = d^2 / 2                 biased, low variance; its gradient is that of KL
  k3 = (rho - 1) - log rho     unbiased, low variance, always >= 0
Each is a per-token array, 0 behind the mask; reduce it with
``aggregation.aggregate``. Like the policy losses, masked inputs are selected
away with ``jnp.where`` before arithmetic, so a NaN there reaches neither the
value nor the gradient, while a NaN at a valid position propagates (loudly).

References: J. Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxflash.algorithms.distributions import entropy_from_logprobs

KLFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps k3 finite for a wildly off reference token


def _log_ratio(logp_bt: jax.Array, ref_logp_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    logp_bt, ref_logp_bt, mask_bt = map(jnp.asarray, (logp_bt, ref_logp_bt, mask_bt))
    for name, x in (("ref_logp_bt", ref_logp_bt), ("mask_bt", mask_bt)):
        if x.shape != logp_bt.shape:
            raise ValueError(f"{name} shape {x.shape} must equal logp_bt shape {logp_bt.shape}")
    valid = mask_bt > 0
    logp = jnp.where(valid, logp_bt.astype(jnp.float32), 0.0)
    ref = jnp.where(valid, ref_logp_bt.astype(jnp.float32), 0.0)
    return logp - ref  # 0 behind the mask, so every estimator below is 0 there too


def kl_k1(logp_bt: jax.Array, ref_logp_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """k1 = log pi - log pi_ref per token. Args: float [B, T] each; returns float32 [B, T]."""
    return _log_ratio(logp_bt, ref_logp_bt, mask_bt)


def kl_k2(logp_bt: jax.Array, ref_logp_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """k2 = (log pi - log pi_ref)^2 / 2 per token. Shapes as ``kl_k1``."""
    return 0.5 * _log_ratio(logp_bt, ref_logp_bt, mask_bt) ** 2


def kl_k3(logp_bt: jax.Array, ref_logp_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """k3 = exp(-d) - 1 + d, d = log pi - log pi_ref, per token (>= 0). Shapes as ``kl_k1``.

    d is clamped to [-20, 20] inside exp only, so the value stays finite.
    """
    d = _log_ratio(logp_bt, ref_logp_bt, mask_bt)
    # expm1 keeps the estimate accurate (and exactly 0) for tiny d.
    return jnp.expm1(-jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)) + d


KL_ESTIMATORS: dict[str, KLFn] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(
    logp_bt: jax.Array, ref_logp_bt: jax.Array, mask_bt: jax.Array, *, estimator: str = "k3"
) -> jax.Array:
    """``KL_ESTIMATORS[estimator](logp_bt, ref_logp_bt, mask_bt)``; the error lists names."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose from {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp_bt, ref_logp_bt, mask_bt)


def sampled_entropy(logp_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """One-sample entropy estimate -log pi(y_t) per token (unbiased for y ~ pi).

    Args:
      logp_bt: float [B, T] log-probabilities of the sampled tokens.
      mask_bt: [B, T], > 0 where valid.

    Returns:
      float32 [B, T] in nats, 0 behind the mask.
    """
    logp_bt, mask_bt = jnp.asarray(logp_bt), jnp.asarray(mask_bt)
    if mask_bt.shape != logp_bt.shape:
        raise ValueError(f"mask_bt shape {mask_bt.shape} must equal logp_bt shape {logp_bt.shape}")
    valid = mask_bt > 0
    return -jnp.where(valid, logp_bt.astype(jnp.float32), 0.0)


def token_entropy(logq_btv: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """Exact entropy of each position's processed distribution, masked.

    Args:
      logq_btv: float [B, T, V] from ``distributions.processed_log_softmax`` (same
        temperature / top-k / top-p as sampling, so it is the sampled entropy).
      mask_bt: [B, T], > 0 where valid.

    Returns:
      float32 [B, T] in nats, 0 behind the mask.
    """
    logq_btv, mask_bt = jnp.asarray(logq_btv), jnp.asarray(mask_bt)
    if logq_btv.shape[:-1] != mask_bt.shape:
        raise ValueError(
            f"mask_bt shape {mask_bt.shape} must equal logq_btv shape[:-1] {logq_btv.shape[:-1]}"
        )
    valid = mask_bt > 0
    logq_btv = jnp.where(valid[..., None], logq_btv.astype(jnp.float32), 0.0)
    return jnp.where(valid, entropy_from_logprobs(logq_btv), 0.0)
