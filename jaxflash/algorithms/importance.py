"""Importance-weight statistics and effective sample size, per replay cycle.

The importance weight of a token is w = pi_theta(y) / mu(y) (mu: the behaviour
policy whose logprobs were stored with the sample). Two effective sample sizes,
normalised to (0, 1] (1 = every weight equal, i.e. on-policy):

    ESS_token = (sum_i w_i)^2 / (N * sum_i w_i^2)       over the N valid tokens
    ESS_seq   = (sum_b W_b)^2 / (B * sum_b W_b^2),  W_b = prod_t w_bt

(Kish's effective sample size; FreshPER, arXiv 2604.16918, motivates its age decay
by the decay of exactly this quantity as the policy drifts from the behaviour
policy.) ESS_seq is computed in log space, so long sequences do not overflow.

Split in two so the learner can produce per-sample sufficient statistics inside
its jitted step and the host can aggregate them by cycle label:
``per_sample_ratio_stats`` (jnp or numpy, [B] outputs) and ``ratio_metrics_by_cycle``
(numpy, host). Log-ratios are clamped to [-20, 20] before exp, as the policy
losses do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

MAX_LOG_RATIO = 20.0
RATIO_STAT_KEYS = ("tokens", "sum_w", "sum_w2", "max_w", "min_w", "seq_log_w")


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + float(np.log(np.sum(np.exp(x - m))))


def effective_sample_size(log_w_n: np.ndarray) -> float:
    """Normalised Kish ESS (sum w)^2 / (n sum w^2) of weights given as log w.

    Args:
      log_w_n: float [n] log importance weights (finite).

    Returns:
      float in (0, 1]; 1.0 for equal weights.

    Raises:
      ValueError: an empty or non-finite input.
    """
    lw = np.asarray(log_w_n, np.float64).reshape(-1)
    if lw.size == 0 or not np.all(np.isfinite(lw)):
        raise ValueError("effective_sample_size: needs >= 1 finite log-weight")
    return float(np.exp(2.0 * _logsumexp(lw) - _logsumexp(2.0 * lw) - np.log(lw.size)))


def per_sample_ratio_stats(log_ratio_bt, mask_bt) -> dict:
    """Per-sequence sufficient statistics of w = exp(log_ratio) over valid tokens.

    Args:
      log_ratio_bt: float [B, T], log pi - log mu (masked positions ignored, NaN ok).
      mask_bt: [B, T], > 0 on tokens that carry loss.

    Returns:
      float32 [B] each: ``tokens`` (valid count), ``sum_w``, ``sum_w2``,
      ``max_w`` (-inf for a row without tokens), ``min_w`` (+inf likewise),
      ``seq_log_w`` (sum of log w). Works under jit.
    """
    valid = jnp.asarray(mask_bt) > 0
    lr = jnp.where(valid, jnp.asarray(log_ratio_bt, jnp.float32), 0.0)
    lr = jnp.clip(lr, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    w = jnp.exp(lr)
    return {
        "tokens": jnp.sum(valid, axis=-1).astype(jnp.float32),
        "sum_w": jnp.sum(jnp.where(valid, w, 0.0), axis=-1),
        "sum_w2": jnp.sum(jnp.where(valid, w * w, 0.0), axis=-1),
        "max_w": jnp.max(jnp.where(valid, w, -jnp.inf), axis=-1),
        "min_w": jnp.min(jnp.where(valid, w, jnp.inf), axis=-1),
        "seq_log_w": jnp.sum(lr, axis=-1),
    }


def ratio_metrics_by_cycle(
    stats: Mapping[str, np.ndarray],
    cycle_b: np.ndarray,
    names: Sequence[str] = ("fresh", "replay"),
) -> dict[str, float]:
    """Host aggregation of ``per_sample_ratio_stats`` by cycle label.

    Args:
      stats: the dict of [B] arrays (jax or numpy; padding rows have 0 tokens).
      cycle_b: int [B], index into ``names`` per row (0 fresh, 1 replay by default).
      names: metric prefix per cycle label.

    Returns:
      Per cycle c with at least one token: ``{c}_ratio_mean`` (token mean of w),
      ``{c}_ratio_max``, ``{c}_ratio_min``, ``{c}_ess_token``, ``{c}_ess_seq``
      (over rows with tokens); always ``{c}_ratio_tokens`` and ``{c}_sequences``.

    Raises:
      ValueError: missing keys, lengths that differ, or a label outside names.
    """
    missing = sorted(set(RATIO_STAT_KEYS) - set(stats))
    if missing:
        raise ValueError(f"ratio_metrics_by_cycle: stats lack {missing}")
    s = {k: np.asarray(stats[k], np.float64) for k in RATIO_STAT_KEYS}
    cycle_b = np.asarray(cycle_b)
    if any(v.shape != cycle_b.shape for v in s.values()):
        raise ValueError(
            f"ratio_metrics_by_cycle: cycle_b shape {cycle_b.shape} != stats shape "
            f"{s['tokens'].shape}"
        )
    if cycle_b.size and (cycle_b.min() < 0 or cycle_b.max() >= len(names)):
        raise ValueError(f"ratio_metrics_by_cycle: labels must be in [0, {len(names)})")
    out: dict[str, float] = {}
    for label, name in enumerate(names):
        rows = (cycle_b == label) & (s["tokens"] > 0)
        n_tok = float(s["tokens"][rows].sum())
        out[f"{name}_ratio_tokens"] = n_tok
        out[f"{name}_sequences"] = float(rows.sum())
        if n_tok == 0:
            continue
        sum_w, sum_w2 = float(s["sum_w"][rows].sum()), float(s["sum_w2"][rows].sum())
        out[f"{name}_ratio_mean"] = sum_w / n_tok
        out[f"{name}_ratio_max"] = float(s["max_w"][rows].max())
        out[f"{name}_ratio_min"] = float(s["min_w"][rows].min())
        out[f"{name}_ess_token"] = sum_w * sum_w / (n_tok * sum_w2)
        out[f"{name}_ess_seq"] = effective_sample_size(s["seq_log_w"][rows])
    return out
