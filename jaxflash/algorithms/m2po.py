"""M2PO's second-moment mask: drop the most off-policy tokens until M2 <= tau.

For token log-ratios d_i = log pi_theta(y_i) - log mu(y_i) (mu: the behaviour
policy that sampled the token) the second moment over the N valid tokens is

    M2 = (1/N) sum_i d_i^2.

M2PO masks tokens in decreasing order of d_i^2 until the mean d^2 of the tokens
kept is at most ``threshold`` (tau_M2): the smallest number k of masked tokens
such that (sum_i d_i^2 - sum of the k largest) / (N - k) <= tau. Only extreme
outliers are removed, instead of clipping every token whose ratio leaves a trust
region; the kept tokens then take the unclipped importance-weighted gradient
(``policy_loss.m2po_loss``). Equal d^2 values are masked in position order
(row-major), so the mask is deterministic.

The statistic is over *all* tokens passed in: the paper's mask is batch-level. A
learner that splits a batch into micro-batches must compute this mask once over
the whole batch (e.g. from the proximal logprobs of a logprob pass) and fold it
into the loss mask; the registered loss computes it over the tokens of its call.

Written from the paper's text and AReaL's M2PO description (arXiv 2510.01161).
The authors' released training code instead caps |d| at one global bound on the
tokens whose ratio moves against the advantage; that variant is not built here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

M2PO_DEFAULT_THRESHOLD = 0.04  # tau_M2 of the authors' training script (M2_budget=0.04)


def m2po_mask(
    log_ratio_bt: jax.Array, mask_bt: jax.Array, *, threshold: float = M2PO_DEFAULT_THRESHOLD
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Tokens kept by the M2PO second-moment constraint.

    Args:
      log_ratio_bt: float [B, T] (or any shape), log pi - log mu per token.
      mask_bt: same shape, > 0 on tokens that carry loss. Masked positions never
        enter the statistic (a NaN behind the mask is harmless); non-finite
        log-ratios at valid positions are left out of the statistic and kept, so
        they still surface in the loss and its ``nonfinite_count``.
      threshold: tau_M2 >= 0, bound on the mean squared log-ratio of kept tokens.

    Returns:
      (keep_bt bool, stats): ``keep_bt`` true on valid tokens kept (a subset of
      the mask); stats float32 scalars ``m2_before`` (M2 over the finite valid
      tokens), ``m2_after`` (over those kept), ``m2_masked`` (tokens removed).

    Raises:
      ValueError: shapes differ or a negative threshold.

    References: M2PO, Zheng et al., arXiv 2510.01161.
    """
    log_ratio_bt, mask_bt = jnp.asarray(log_ratio_bt), jnp.asarray(mask_bt)
    if log_ratio_bt.shape != mask_bt.shape:
        raise ValueError(
            f"m2po_mask: log_ratio shape {log_ratio_bt.shape} != mask shape {mask_bt.shape}"
        )
    if isinstance(threshold, int | float) and not threshold >= 0:
        raise ValueError(f"m2po_mask: threshold must be >= 0, got {threshold}")
    valid = mask_bt > 0
    lr = jnp.where(valid, log_ratio_bt.astype(jnp.float32), 0.0)
    finite = valid & jnp.isfinite(lr)
    d2 = jnp.where(finite, jnp.square(jnp.where(finite, lr, 0.0)), 0.0).reshape(-1)
    ranked = finite.reshape(-1)
    n = jnp.sum(ranked).astype(jnp.float32)
    # Descending d^2 among ranked tokens; others sort last (d^2 >= 0 > -1).
    order = jnp.argsort(-jnp.where(ranked, d2, -1.0), stable=True)
    top_sums = jnp.concatenate([jnp.zeros(1, jnp.float32), jnp.cumsum(d2[order])])  # [N + 1]
    total = top_sums[-1]
    k = jnp.arange(top_sums.size, dtype=jnp.float32)
    remaining = n - k
    mean_after = (total - top_sums) / jnp.maximum(remaining, 1.0)
    ok = (mean_after <= threshold) | (remaining <= 0)
    k_star = jnp.argmax(ok)  # first k that satisfies the bound (k <= n always does)
    rank = jnp.zeros(d2.size, jnp.int32).at[order].set(jnp.arange(d2.size, dtype=jnp.int32))
    drop = ranked & (rank < k_star)
    keep = valid & ~drop.reshape(valid.shape)
    kept = ranked & ~drop
    n_kept = jnp.sum(kept).astype(jnp.float32)
    stats = {
        "m2_before": total / jnp.maximum(n, 1.0),
        "m2_after": jnp.sum(jnp.where(kept, d2, 0.0)) / jnp.maximum(n_kept, 1.0),
        "m2_masked": k_star.astype(jnp.float32),
    }
    return keep, jax.tree.map(jax.lax.stop_gradient, stats)
