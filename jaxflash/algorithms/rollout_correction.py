"""Rollout correction: truncated / masked importance sampling against the behaviour policy.

Every loss here is decoupled PPO (arXiv 2110.00641) with a different per-token
weight w: the PPO clip is taken against the proximal policy (r = pi/pi_old,
``old_logp_bt``, recomputed by the learner) and w corrects for the behaviour
policy mu that sampled the tokens (``behaviour_logp_bt``: the engine's logprobs,
possibly several versions old), through the importance ratio

    rho_t = pi_old(y_t) / mu(y_t),   loss_t = w_t * ppo_clip_t(r),   w constant.

Train-inference mismatch and staleness both make rho != 1; the variants differ in
how they aggregate rho and whether they truncate (bias, bounded variance) or mask
(drop outliers, count them):

| name        | w                                              | hyper-parameters         |
|-------------|------------------------------------------------|--------------------------|
| ``tis``     | min(rho_t, C)      (token TIS, ``policy_loss``) | tis_cap                  |
| ``seq_tis`` | min(prod_t rho_t, C), per sequence              | tis_cap                  |
| ``token_mis``| rho_t * 1[lo <= rho_t <= hi]                    | mis_upper, mis_lower     |
| ``seq_mis`` | rho_b * 1[lo <= rho_b <= hi], rho_b = prod rho  | mis_upper, mis_lower     |
| ``geo_mis`` | 1[lo <= (prod_t rho_t)^(1/n_b) <= hi]           | mis_upper, mis_lower     |
| ``icepop``  | rho_t * 1[alpha <= rho_t <= beta]               | icepop_low, icepop_high  |

``mis_lower=None`` is 1 / ``mis_upper`` (verl's default). Products are formed in
log space (sum of log rho over the valid tokens), so long sequences never
overflow. With pi_old = mu (``ratio_against="behaviour"``) every rho is 1 and the
correction vanishes, so the learner config requires ``ratio_against="proximal"``.

Metrics (besides ``policy_loss``'s): ``masked_frac`` (tokens whose weight is 0 by
the mask), ``is_truncated_frac`` (tokens whose weight was truncated) and
``is_weight_mean`` (mean w over the valid tokens).

References:
  verl rollout correction (docs/algo/rollout_corr.md, rollout_corr_math.md,
  Y. Li 2025): token / sequence IS, token / sequence / geometric rejection;
  Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse from the
  Training-Inference Mismatch" (2025, https://richardli.xyz/rl-collapse), which
  names token-/sequence-level TIS and MIS; IcePop: Ling Team, "Small Leak Can Sink
  a Great Ship -- Boost RL Training on MoE with IcePop" (blog, Sep 2025) and
  Ring-1T, arXiv 2510.18855 (masking function M(k) = k if alpha <= k <= beta
  else 0, alpha = 0.5, beta = 5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.algorithms.loss_parts import (
    Inputs,
    LossAndMetrics,
    PolicyLossFn,
    finish,
    ppo_family,
    token_metrics,
)


def _log_bounds(upper, lower, names=("mis_upper", "mis_lower")) -> tuple[jax.Array, jax.Array]:
    """(log lower, log upper) of a two-sided mask; Python numbers are checked eagerly."""
    if isinstance(upper, int | float) and not upper >= 1.0:
        raise ValueError(f"{names[0]} must be >= 1 (rho = 1 is always kept), got {upper}")
    if isinstance(lower, int | float) and not 0.0 < lower <= 1.0:
        raise ValueError(f"{names[1]} must be in (0, 1], got {lower}")
    lower = 1.0 / upper if lower is None else lower
    return jnp.log(jnp.float32(lower)), jnp.log(jnp.float32(upper))


def _seq_log_rho(x: Inputs) -> tuple[jax.Array, jax.Array]:
    """(sum_t log pi_old/mu over the valid tokens [B, 1], valid length n_b [B, 1])."""
    log_rho_b1 = jnp.sum(jnp.where(x.valid, x.old - x.behaviour, 0.0), axis=-1, keepdims=True)
    return log_rho_b1, jnp.sum(x.valid, axis=-1, keepdims=True).astype(jnp.float32)


def _weighted(x: Inputs, ratio, loss, flags, w_bt, **more_flags) -> LossAndMetrics:
    """loss * w (w broadcast to [B, T]) with the masked / truncated fractions and mean w."""
    w_bt = jax.lax.stop_gradient(jnp.broadcast_to(w_bt, x.valid.shape))
    more = {k: jnp.broadcast_to(v, x.valid.shape) for k, v in more_flags.items()}
    metrics = token_metrics(x, ratio, **flags, **more)
    n = jnp.maximum(jnp.sum(x.valid), 1).astype(jnp.float32)
    metrics["is_weight_mean"] = jnp.sum(jnp.where(x.valid, w_bt, 0.0)) / n
    return finish(x, w_bt * loss, metrics)


def seq_tis_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    tis_cap: float = 2.0,
) -> LossAndMetrics:
    """Sequence-level TIS: loss_t = min(rho_b, C) * ppo_clip_t, rho_b = prod_t pi_old/mu.

    One weight per sequence (the trajectory's importance ratio, truncated at C =
    ``tis_cap``) broadcast to its tokens; unbiased at the sequence level up to
    the truncation, higher variance than token TIS (``tis``). Tokens of a
    truncated sequence count in ``is_truncated_frac``.

    References: verl rollout correction (``rollout_is="sequence"``); module docstring.
    """
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(
        inputs, clip_eps_low, clip_eps_high, dual_clip_c, tis_cap=tis_cap
    )
    log_rho_b1, _ = _seq_log_rho(x)
    log_cap = jnp.log(jnp.float32(tis_cap))
    w_b1 = jnp.exp(jnp.minimum(log_rho_b1, log_cap))  # never overflows
    return _weighted(x, ratio, loss, flags, w_b1, is_truncated_frac=log_rho_b1 > log_cap)


def token_mis_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    mis_upper: float = 2.0,
    mis_lower: float | None = None,
) -> LossAndMetrics:
    """Token-level MIS: loss_t = rho_t * 1[lo <= rho_t <= hi] * ppo_clip_t.

    A token whose ratio pi_old/mu leaves [``mis_lower``, ``mis_upper``] is
    dropped (loss and gradient 0, counted in ``masked_frac``) instead of
    truncated; the others keep their full importance weight.

    References: verl rollout correction (``rollout_is="token"`` with
    ``rollout_rs="token"``); Liu, Li et al. 2025 (token-level MIS).
    """
    lo, hi = _log_bounds(mis_upper, mis_lower)
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(inputs, clip_eps_low, clip_eps_high, dual_clip_c)
    log_rho = x.old - x.behaviour
    keep = (log_rho >= lo) & (log_rho <= hi)
    w = jnp.where(keep, jnp.exp(jnp.minimum(log_rho, hi)), 0.0)
    return _weighted(x, ratio, loss, flags, w, masked_frac=~keep)


def seq_mis_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    mis_upper: float = 2.0,
    mis_lower: float | None = None,
) -> LossAndMetrics:
    """Sequence-level MIS: loss_t = rho_b * 1[lo <= rho_b <= hi] * ppo_clip_t.

    rho_b = prod_t pi_old/mu over the sequence's valid tokens; a whole sequence
    outside [``mis_lower``, ``mis_upper``] is dropped (its tokens count in
    ``masked_frac``), a kept one is weighted by rho_b.

    References: verl rollout correction (``rollout_is="sequence"`` with
    ``rollout_rs="sequence"``); Liu, Li et al. 2025 (sequence-level MIS).
    """
    lo, hi = _log_bounds(mis_upper, mis_lower)
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(inputs, clip_eps_low, clip_eps_high, dual_clip_c)
    log_rho_b1, _ = _seq_log_rho(x)
    keep_b1 = (log_rho_b1 >= lo) & (log_rho_b1 <= hi)
    w_b1 = jnp.where(keep_b1, jnp.exp(jnp.minimum(log_rho_b1, hi)), 0.0)
    return _weighted(x, ratio, loss, flags, w_b1, masked_frac=~keep_b1)


def geo_mis_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    mis_upper: float = 1.001,
    mis_lower: float | None = None,
) -> LossAndMetrics:
    """Geometric-mean MIS: loss_t = 1[lo <= g_b <= hi] * ppo_clip_t, g_b = (prod rho)^(1/n_b).

    g_b = exp(mean_t log pi_old/mu) is the per-token average deviation of the
    sequence, independent of its length, so its bounds are tight (verl: 1.0001 to
    1.001; default hi 1.001, lo 1/hi). It only rejects (weight 1 on kept
    sequences, as verl's geometric rejection sampling); dropped sequences' tokens
    count in ``masked_frac``.

    References: verl rollout correction (``rollout_rs="geometric"``,
    ``decoupled_geo_rs``); Liu, Li et al. 2025, part 3 (geometric-level RS).
    """
    lo, hi = _log_bounds(mis_upper, mis_lower)
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(inputs, clip_eps_low, clip_eps_high, dual_clip_c)
    log_rho_b1, n_b1 = _seq_log_rho(x)
    log_geo_b1 = log_rho_b1 / jnp.maximum(n_b1, 1.0)
    keep_b1 = (log_geo_b1 >= lo) & (log_geo_b1 <= hi)
    return _weighted(x, ratio, loss, flags, keep_b1.astype(jnp.float32), masked_frac=~keep_b1)


def icepop_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
) -> LossAndMetrics:
    """IcePop: loss_t = M(rho_t) * ppo_clip_t, M(k) = k if alpha <= k <= beta else 0.

    rho_t = pi_old/mu is the training engine's over the inference engine's
    probability of the sampled token; tokens whose discrepancy leaves
    [alpha, beta] = [``icepop_low``, ``icepop_high``] on either side lose their
    gradient (``masked_frac``), the others are importance-weighted. The same
    form as ``token_mis`` with IcePop's bounds (0.5, 5).

    References: Ring-1T, arXiv 2510.18855; IcePop blog (Ling Team, 2025).
    """
    lo, hi = _log_bounds(icepop_high, icepop_low, ("icepop_high", "icepop_low"))
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(inputs, clip_eps_low, clip_eps_high, dual_clip_c)
    log_rho = x.old - x.behaviour
    keep = (log_rho >= lo) & (log_rho <= hi)
    w = jnp.where(keep, jnp.exp(jnp.minimum(log_rho, hi)), 0.0)
    return _weighted(x, ratio, loss, flags, w, masked_frac=~keep)


ROLLOUT_CORRECTIONS: dict[str, PolicyLossFn] = {
    "seq_tis": seq_tis_loss,
    "token_mis": token_mis_loss,
    "seq_mis": seq_mis_loss,
    "geo_mis": geo_mis_loss,
    "icepop": icepop_loss,
}
"""Registered into ``policy_loss.POLICY_LOSSES``; each needs ratio_against="proximal"."""
