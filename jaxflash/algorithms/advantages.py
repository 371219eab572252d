"""Group advantage estimators: rewards of G samples per prompt -> one advantage each.

Every estimator has the signature
    ``fn(rewards_bg, *, mask_bg=None, eps=1e-6, residue_rtol=1e-5, ...) -> adv_bg``
and is chosen by name from ``ADVANTAGE_ESTIMATORS`` (tunix/optax style). Inputs are
float32 ``[B, G]`` (B prompts, G samples each); ``mask_bg`` marks the samples that
exist (1) versus missing ones (0: failed, filtered, not yet returned). Missing
samples get advantage 0 and never enter a mean or a standard deviation, and a NaN
behind the mask never leaks (``jnp.where`` before arithmetic).

Rounding residue. In float32 the mean of ``[0.35] * 7`` is not exactly 0.35, so a
group (or a leave-one-out set) of equal rewards has a "standard deviation" of
~1e-8, and dividing by it (plus eps) turns a 0.35 gap into -3e5. A deviation or a
standard deviation at most ``residue_rtol * max|r|`` (over the valid rewards in
the group; 1e-5 is ~80 float32 ulps) is therefore treated as exactly zero: such a
deviation becomes 0, and such a std means "do not rescale" (divide by 1). All-equal
groups give exactly 0 under every estimator (tests/algorithms/test_advantages.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

AdvantageFn = Callable[..., jax.Array]


def _prepare(rewards_bg: jax.Array, mask_bg: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Validates shapes; returns (rewards with 0 where missing, bool valid_bg)."""
    rewards_bg = jnp.asarray(rewards_bg)
    if rewards_bg.ndim != 2:
        raise ValueError(f"rewards_bg must be [B, G], got shape {rewards_bg.shape}")
    if mask_bg is None:
        valid_bg = jnp.ones(rewards_bg.shape, dtype=bool)
    else:
        mask_bg = jnp.asarray(mask_bg)
        if mask_bg.shape != rewards_bg.shape:
            raise ValueError(
                f"mask_bg shape {mask_bg.shape} must equal rewards_bg shape {rewards_bg.shape}"
            )
        valid_bg = mask_bg > 0
    return jnp.where(valid_bg, rewards_bg.astype(jnp.float32), 0.0), valid_bg


def _tolerance(r_bg: jax.Array, valid_bg: jax.Array, rtol: float) -> jax.Array:
    """[B, 1] residue threshold: rtol times the largest |reward| in the group."""
    return rtol * jnp.max(jnp.where(valid_bg, jnp.abs(r_bg), 0.0), axis=-1, keepdims=True)


def _snap(x: jax.Array, tol: jax.Array) -> jax.Array:
    """Rounding residue -> exactly 0."""
    return jnp.where(jnp.abs(x) <= tol, 0.0, x)


def _group_centered(
    r_bg: jax.Array, valid_bg: jax.Array, tol: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(r - group mean) with residue snapped to 0, and the valid count n [B, 1]."""
    n_b1 = jnp.sum(valid_bg, axis=-1, keepdims=True).astype(jnp.float32)
    mean_b1 = jnp.sum(r_bg, axis=-1, keepdims=True) / jnp.maximum(n_b1, 1.0)
    centered_bg = jnp.where(valid_bg, r_bg - mean_b1, 0.0)
    return _snap(centered_bg, tol), n_b1


def _divide_by_std(x: jax.Array, std: jax.Array, tol: jax.Array, eps: float) -> jax.Array:
    """x / (std + eps), except that a residue std (<= tol) means no rescaling."""
    return jnp.where(std <= tol, x, x / (std + eps))


def grpo_advantages(
    rewards_bg: jax.Array,
    *,
    mask_bg: jax.Array | None = None,
    eps: float = 1e-6,
    residue_rtol: float = 1e-5,
) -> jax.Array:
    """GRPO group-normalised advantage A_i = (r_i - mean_g) / (std_g + eps).

    std is the unbiased (ddof=1) standard deviation over the valid samples of the
    group, as in TRL / verl / tunix. A group with fewer than 2 valid samples or a
    residue-only std is not rescaled (and its deviations are 0 anyway).

    Args:
      rewards_bg: float [B, G] scalar rewards.
      mask_bg: optional [B, G], > 0 where the sample exists.
      eps: added to std before dividing.
      residue_rtol: relative threshold below which deviations / std count as zero.

    Returns:
      float32 [B, G]; 0 for missing samples and for all-equal groups.

    References: DeepSeekMath, arXiv 2402.03300.
    """
    r_bg, valid_bg = _prepare(rewards_bg, mask_bg)
    tol_b1 = _tolerance(r_bg, valid_bg, residue_rtol)
    centered_bg, n_b1 = _group_centered(r_bg, valid_bg, tol_b1)
    var_b1 = jnp.sum(centered_bg**2, axis=-1, keepdims=True) / jnp.maximum(n_b1 - 1.0, 1.0)
    return _divide_by_std(centered_bg, jnp.sqrt(var_b1), tol_b1, eps)


def dr_grpo_advantages(
    rewards_bg: jax.Array,
    *,
    mask_bg: jax.Array | None = None,
    eps: float = 1e-6,
    residue_rtol: float = 1e-5,
) -> jax.Array:
    """Dr. GRPO advantage A_i = r_i - mean_g (no std division: no difficulty bias).

    Args/Returns: as ``grpo_advantages`` (eps is accepted for a uniform signature
    and unused).

    References: Understanding R1-Zero-Like Training, arXiv 2503.20783.
    """
    del eps
    r_bg, valid_bg = _prepare(rewards_bg, mask_bg)
    centered_bg, _ = _group_centered(r_bg, valid_bg, _tolerance(r_bg, valid_bg, residue_rtol))
    return centered_bg


def rloo_advantages(
    rewards_bg: jax.Array,
    *,
    mask_bg: jax.Array | None = None,
    eps: float = 1e-6,
    residue_rtol: float = 1e-5,
    std_normalize: bool = False,
) -> jax.Array:
    """RLOO leave-one-out advantage A_i = r_i - mean_{j != i} r_j.

    With ``std_normalize`` the advantage is further divided by (std_{j != i} + eps),
    the unbiased std of the *other* valid samples; when those others are all equal
    that std is rounding residue and counts as zero (no rescaling), so rewards
    [0.35]*7 + [0] give the odd sample about -0.35, not -3e5.

    Args/Returns: as ``grpo_advantages``. A sample with no other valid sample in
    its group gets 0.

    References: Back to Basics: REINFORCE-style optimization, arXiv 2402.14740.
    """
    r_bg, valid_bg = _prepare(rewards_bg, mask_bg)
    tol_b1 = _tolerance(r_bg, valid_bg, residue_rtol)
    n_b1 = jnp.sum(valid_bg, axis=-1, keepdims=True).astype(jnp.float32)
    n_others_bg = n_b1 - 1.0
    has_others_bg = valid_bg & (n_others_bg >= 1.0)
    baseline_bg = (jnp.sum(r_bg, axis=-1, keepdims=True) - r_bg) / jnp.maximum(n_others_bg, 1.0)
    adv_bg = _snap(jnp.where(has_others_bg, r_bg - baseline_bg, 0.0), tol_b1)
    if not std_normalize:
        return adv_bg
    # Two-pass std of the others, O(G^2) per group: tiny for any realistic G and far
    # more accurate than E[x^2] - E[x]^2, whose cancellation leaves ~sqrt(ulp) residue.
    others_bgg = valid_bg[:, None, :] & ~jnp.eye(r_bg.shape[1], dtype=bool)[None]
    dev_bgg = jnp.where(others_bgg, r_bg[:, None, :] - baseline_bg[:, :, None], 0.0)
    var_bg = jnp.sum(dev_bgg**2, axis=-1) / jnp.maximum(n_others_bg - 1.0, 1.0)
    return _divide_by_std(adv_bg, jnp.sqrt(var_bg), tol_b1, eps)


def reinforce_pp_advantages(
    rewards_bg: jax.Array,
    *,
    mask_bg: jax.Array | None = None,
    eps: float = 1e-6,
    residue_rtol: float = 1e-5,
) -> jax.Array:
    """REINFORCE++-baseline: group-mean baseline, then batch-level normalisation.

    A_i = (r_i - mean_g) / (std_batch + eps), std_batch the population std of the
    centred values over all valid samples of the batch. Their batch mean is zero
    by construction (each group's centred values sum to 0), so subtracting it, as
    the paper does, is skipped: that keeps all-equal groups exactly 0 instead of
    shifting them by rounding residue. The paper normalises over tokens (each
    sample weighted by its length); here samples are weighted equally, since only
    per-sample rewards are given.

    Args/Returns: as ``grpo_advantages``. Note the result depends on the whole
    batch, so call it on the full batch, not per micro-batch.

    References: REINFORCE++, arXiv 2501.03262.
    """
    r_bg, valid_bg = _prepare(rewards_bg, mask_bg)
    tol_b1 = _tolerance(r_bg, valid_bg, residue_rtol)
    centered_bg, _ = _group_centered(r_bg, valid_bg, tol_b1)
    n = jnp.maximum(jnp.sum(valid_bg).astype(jnp.float32), 1.0)
    std = jnp.sqrt(jnp.sum(centered_bg**2) / n)
    return _divide_by_std(centered_bg, std, jnp.max(tol_b1), eps)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}


def get_advantage_estimator(name: str) -> AdvantageFn:
    """Looks up ``ADVANTAGE_ESTIMATORS[name]``; the error lists the valid names."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
