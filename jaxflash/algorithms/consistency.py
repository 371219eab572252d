"""Engine–learner consistency on tokens sampled by the current policy version.

For those tokens μ (the behaviour logprob the engine recorded) and π (the learner's
logprob under the same weights) are the same distribution in exact arithmetic; what
separates them is numerics (vLLM RFC #48305 lists the sources). Measured each step:

    gap_mean, gap_max  = mean / max |log π − log μ|
    kl_k3              = mean (r − 1) − log r,  r = π / μ   (k3 estimate of KL(μ‖π),
                                                            Schulman 2020; tokens ~ μ)
    prob_corr          = Pearson correlation of the token probabilities μ and π
    set_miss_frac      = fraction whose sampled token is outside the learner's
                         top-k / top-p set (log π at the floor): a lower bound on
                         the fraction whose sampling sets differ (the engine's set
                         always holds the token it drew; its other members are not
                         recorded)

All are computed from per-micro-batch sums (``consistency_sums``, summed by the
learner step's combine-by-name rule, none carries ``_max`` / ``_min``) and finished
once per step (``consistency_metrics``), so they do not depend on how the batch was
split. Mixture-of-experts routing disagreements are counted beside them
(``router_mismatch_on_policy_frac``, ``learner.scoring``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.algorithms.distributions import LOGPROB_FLOOR


def consistency_sums(logp_bt: jax.Array, mu_bt: jax.Array, current_bt: jax.Array) -> dict:
    """Sums over the current version's tokens (float32 scalars; gradient stopped).

    Args:
      logp_bt: float32 [b, T] learner log π(target) under the sampling distribution.
      mu_bt: float32 [b, T] behaviour log μ(target) the engine recorded.
      current_bt: bool [b, T] loss-masked tokens sampled by the learner's version.

    Returns:
      ``consistency_<x>_sum`` for x in gap, k3, p, q, pp, qq, pq, miss.
    """
    logp_bt = jax.lax.stop_gradient(logp_bt)
    d_bt = logp_bt - mu_bt
    p_bt, q_bt = jnp.exp(mu_bt), jnp.exp(logp_bt)  # μ and π of each token
    terms = {
        "gap": jnp.abs(d_bt),
        "k3": jnp.expm1(d_bt) - d_bt,  # (r - 1) - log r with log r = d; 0 at r = 1
        "p": p_bt,
        "q": q_bt,
        "pp": p_bt * p_bt,
        "qq": q_bt * q_bt,
        "pq": p_bt * q_bt,
        "miss": (logp_bt <= LOGPROB_FLOOR).astype(jnp.float32),
    }
    return {
        f"consistency_{k}_sum": jnp.sum(jnp.where(current_bt, v, 0.0)) for k, v in terms.items()
    }


def consistency_metrics(aux: dict, tokens: jax.Array) -> dict:
    """The step's consistency metrics from the summed ``aux`` of every micro-batch.

    Args:
      aux: the step's combined ``consistency_sums``.
      tokens: float32 [] current-version tokens (0: every metric reads 0, corr 1).

    Returns:
      ``logprob_gap_on_policy_mean``, ``kl_k3_on_policy``, ``prob_corr_on_policy``,
      ``sampling_set_miss_frac_on_policy``.
    """
    n = jnp.maximum(tokens, 1.0)
    s = {k: aux[f"consistency_{k}_sum"] for k in ("gap", "k3", "p", "q", "pp", "qq", "pq", "miss")}
    cov = s["pq"] / n - (s["p"] / n) * (s["q"] / n)
    var_p = jnp.maximum(s["pp"] / n - (s["p"] / n) ** 2, 0.0)
    var_q = jnp.maximum(s["qq"] / n - (s["q"] / n) ** 2, 0.0)
    denom = jnp.sqrt(var_p * var_q)
    # Both constant (e.g. one token, or greedy decoding's q = 1): equal sides correlate 1.
    corr = jnp.where(denom > 0, cov / jnp.where(denom > 0, denom, 1.0), 1.0)
    out = {
        "logprob_gap_on_policy_mean": s["gap"] / n,
        "kl_k3_on_policy": s["k3"] / n,
        "prob_corr_on_policy": jnp.clip(corr, -1.0, 1.0),
        "sampling_set_miss_frac_on_policy": s["miss"] / n,
    }
    return out
