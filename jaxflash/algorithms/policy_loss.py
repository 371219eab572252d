"""Policy-gradient losses, per token, chosen by name from ``POLICY_LOSSES``.

Every loss has the signature
    ``fn(logp_bt, old_logp_bt, adv_bt, mask_bt, *, behaviour_logp_bt=None, **hparams)
        -> (loss_bt, metrics)``
with float32 [B, T] inputs: ``logp_bt`` log pi_theta(token) (the only input that is
differentiated), ``old_logp_bt`` the policy the importance ratio r = pi/pi_old is
taken against (the proximal policy recomputed by the learner, or the behaviour
logprobs when none is recomputed), ``adv_bt`` advantages (per-sequence values
broadcast over tokens), ``mask_bt`` > 0 on tokens that carry loss, and
``behaviour_logp_bt`` the engine's log mu(token), used only by the off-policy
corrections (decoupled PPO, TIS, M2PO; ``None`` means mu = pi_old).

``loss_bt`` is the per-token loss, 0 behind the mask; reduce it with
``aggregation.aggregate`` (the mode is a separate choice). Sequence-level losses
(TOPR, GSPO, Kimi k1.5) broadcast their per-sequence quantity to tokens so that
the paper's objective is recovered by one named mode, documented on each; the
gradient of ``sum(loss_bt)`` w.r.t. ``logp_bt`` is -A per token for every loss
when all ratios are 1 (the on-policy REINFORCE gradient).

Masks and NaN: inputs are selected with ``jnp.where`` *before* any arithmetic, so
a NaN/Inf behind the mask never reaches a value or a gradient. A non-finite input
at a valid position is not hidden: it propagates into ``loss_bt`` and is counted
in ``metrics["nonfinite_count"]`` ("NaN behind a mask", tests/algorithms/test_policy_loss.py).

Metrics (float32 scalars over this call's valid tokens, ``num_tokens`` lets a
caller combine micro-batches): ratio_mean/max/min, clip_frac, clip_frac_low,
clip_frac_high, dual_clip_frac, masked_frac (tokens dropped by the loss itself),
nonfinite_count, num_tokens. Log-ratios are clamped to [-20, 20] before exp (as
verl does) so an extreme token gives a large finite ratio, not Inf * 0 = NaN
gradients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxflash.algorithms.loss_parts import (
    Inputs,
    LossAndMetrics,
    PolicyLossFn,
    check_hparams,
    exp_ratio,
    finish,
    ppo_clip,
    ppo_family,
    prepare,
    token_metrics,
)
from jaxflash.algorithms.m2po import M2PO_DEFAULT_THRESHOLD, m2po_mask
from jaxflash.algorithms.rollout_correction import ROLLOUT_CORRECTIONS


def vanilla_pg_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
) -> LossAndMetrics:
    """REINFORCE: loss_t = -A_t * log pi(y_t). On-policy; ratios are only reported.

    Args/Returns: see module docstring.
    """
    x = prepare(logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    return finish(x, -x.adv * x.logp, token_metrics(x, exp_ratio(x.logp - x.old)))


def ppo_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
) -> LossAndMetrics:
    """PPO clip: loss_t = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = pi/pi_old.

    Asymmetric bounds (``clip_eps_high`` > ``clip_eps_low``: DAPO's clip-higher,
    arXiv 2503.14476); ``clip_eps_high=None`` means symmetric. ``dual_clip_c`` (> 1)
    bounds the loss of negative-advantage tokens by -c*A (arXiv 1912.09729).

    References: PPO, arXiv 1707.06347.
    """
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(inputs, clip_eps_low, clip_eps_high, dual_clip_c)
    return finish(x, loss, token_metrics(x, ratio, **flags))


def decoupled_ppo_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    behaviour_cap: float | None = None,
) -> LossAndMetrics:
    """Decoupled PPO: clip against the proximal policy, weight by pi_prox / mu.

    loss_t = w_t * ppo_clip(pi/pi_prox), w_t = pi_prox/mu (constant); tokens with
    w_t > ``behaviour_cap`` are masked (loss 0, counted in ``masked_frac``).
    ``old_logp_bt`` is pi_prox (recomputed by the learner), ``behaviour_logp_bt``
    is mu (the engine's); ``behaviour_cap=None`` masks nothing.

    References: AReaL, arXiv 2505.24298 (decoupled objective, Hilton et al. 2110.00641).
    """
    cap = {} if behaviour_cap is None else {"behaviour_cap": behaviour_cap}
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(inputs, clip_eps_low, clip_eps_high, dual_clip_c, **cap)
    weight = exp_ratio(x.old - x.behaviour)
    dropped = jnp.zeros_like(x.valid) if behaviour_cap is None else weight > behaviour_cap
    loss = jnp.where(dropped, 0.0, weight * loss)
    return finish(x, loss, token_metrics(x, ratio, masked_frac=dropped, **flags))


def tis_loss(
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
    """Truncated importance sampling: loss_t = min(pi_prox/mu, C) * ppo_clip(pi/pi_prox).

    Unlike decoupled PPO, a large behaviour ratio is truncated to C, not masked
    (``is_truncated_frac`` counts those tokens).

    References: Yao et al., "Your efficient RL framework secretly brings you
    off-policy RL training" (2025); IMPALA V-trace truncation, arXiv 1802.01561.
    """
    inputs = (logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    x, ratio, loss, flags = ppo_family(
        inputs, clip_eps_low, clip_eps_high, dual_clip_c, tis_cap=tis_cap
    )
    raw_weight = exp_ratio(x.old - x.behaviour)
    loss = jnp.minimum(raw_weight, tis_cap) * loss
    return finish(x, loss, token_metrics(x, ratio, is_truncated_frac=raw_weight > tis_cap, **flags))


def cispo_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 1.0,
    clip_eps_high: float = 4.0,
    unified_mask: bool = False,
    mask_eps_low: float = 0.2,
    mask_eps_high: float = 0.2,
) -> LossAndMetrics:
    """CISPO: loss_t = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi(y_t).

    The importance weight is clipped and detached, so every token keeps a gradient
    (-w*A), unlike PPO whose clipped tokens get none. Defaults: bounds [0, 5] (no
    lower bound, as in the paper). ``unified_mask`` additionally drops tokens PPO
    would clip (A > 0 and r > 1+mask_eps_high, or A < 0 and r < 1-mask_eps_low):
    the paper's unified formulation; they count in ``masked_frac``.

    References: MiniMax-M1, arXiv 2506.13585.
    """
    check_hparams(eps_low=clip_eps_low, eps_high=clip_eps_high)
    check_hparams(eps_low=mask_eps_low, eps_high=mask_eps_high)
    x = prepare(logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    ratio = exp_ratio(x.logp - x.old)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high))
    loss = -weight * x.adv * x.logp
    dropped = jnp.zeros_like(x.valid)
    if unified_mask:
        dropped = ((x.adv > 0) & (ratio > 1.0 + mask_eps_high)) | (
            (x.adv < 0) & (ratio < 1.0 - mask_eps_low)
        )
        loss = jnp.where(dropped, 0.0, loss)
    flags = {
        "clip_frac_low": ratio < 1.0 - clip_eps_low,
        "clip_frac_high": ratio > 1.0 + clip_eps_high,
    }
    return finish(x, loss, token_metrics(x, ratio, masked_frac=dropped, **flags))


def _seq_log_ratio(x: Inputs) -> tuple[jax.Array, jax.Array]:
    """(sum_t log pi/pi_old over valid tokens [B, 1], valid length n_b [B, 1])."""
    log_ratio_b1 = jnp.sum(jnp.where(x.valid, x.logp - x.old, 0.0), axis=-1, keepdims=True)
    return log_ratio_b1, jnp.sum(x.valid, axis=-1, keepdims=True).astype(jnp.float32)


def topr_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
) -> LossAndMetrics:
    """TOPR: loss_t = -w_b * A_t * log pi(y_t), w_b = 1 if A >= 0 else sg(min(rho_b, 1)).

    rho_b = pi(y_b)/pi_old(y_b) is the *sequence* ratio (product over valid tokens).
    Positive samples get a plain SFT-like gradient; negative ones are truncated
    from above so they can only be down-weighted. Aggregate with
    ``seq-mean-token-sum`` for the paper's objective (sum_t log pi = log pi(y_b));
    ``clip_frac_high`` counts negative tokens whose sequence ratio was truncated.

    References: Tapered Off-Policy REINFORCE, arXiv 2503.14286.
    """
    x = prepare(logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    seq_lr_b1, _ = _seq_log_ratio(x)
    # exp(min(s, 0)) == min(exp(s), 1) without overflow for long sequences.
    truncated_b1 = jnp.exp(jnp.minimum(seq_lr_b1, 0.0))
    weight = jax.lax.stop_gradient(jnp.where(x.adv >= 0, 1.0, truncated_b1))
    loss = -weight * x.adv * x.logp
    flags = {"clip_frac_high": (x.adv < 0) & (seq_lr_b1 > 0)}
    return finish(x, loss, token_metrics(x, exp_ratio(x.logp - x.old), **flags))


def gspo_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
) -> LossAndMetrics:
    """GSPO: PPO clip on the length-normalised sequence ratio s_b.

    s_b = exp(mean_t log(pi/pi_old)) over the valid tokens of sequence b. Per token
    (the paper's GSPO-token form) s_bt = sg(s_b) * pi(y_t)/sg(pi(y_t)): its value is
    s_b and its gradient is s_b * d log pi(y_t), so clipping is decided per sequence
    and ``seq-mean-token-mean`` aggregation gives exactly the GSPO objective
    (value and gradient). ``ratio_*`` metrics report s_b per token.

    References: Group Sequence Policy Optimization, arXiv 2507.18071.
    """
    check_hparams(eps_low=clip_eps_low, eps_high=clip_eps_high)
    x = prepare(logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    seq_lr_b1, n_b1 = _seq_log_ratio(x)
    s_b1 = jax.lax.stop_gradient(exp_ratio(seq_lr_b1 / jnp.maximum(n_b1, 1.0)))
    s_bt = s_b1 * jnp.exp(x.logp - jax.lax.stop_gradient(x.logp))
    loss, flags = ppo_clip(s_bt, x.adv, clip_eps_low, clip_eps_high, None)
    return finish(x, loss, token_metrics(x, jnp.broadcast_to(s_b1, s_bt.shape), **flags))


def kimi_k15_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    tau: float = 0.1,
    sequence_level: bool = True,
) -> LossAndMetrics:
    """Kimi k1.5 mirror descent: -A log pi(y) + (tau/2) (log pi(y)/pi_old(y))^2.

    With ``sequence_level`` (the paper) the penalty is on the sequence log-ratio
    D_b = sum_t log(pi/pi_old); each valid token carries (tau/2) D_b^2 / n_b, so
    ``seq-mean-token-sum`` aggregation gives exactly the paper's per-sample loss
    and d sum(loss)/d log pi(y_t) = -A + tau * D_b. Otherwise the penalty is per
    token, (tau/2) (log pi(y_t)/pi_old(y_t))^2.

    References: Kimi k1.5, arXiv 2501.12599 (section 2.3.2).
    """
    check_hparams(tau=tau)
    x = prepare(logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    delta_bt = jnp.where(x.valid, x.logp - x.old, 0.0)
    if sequence_level:
        seq_lr_b1, n_b1 = _seq_log_ratio(x)
        penalty = 0.5 * tau * seq_lr_b1**2 / jnp.maximum(n_b1, 1.0)
    else:
        penalty = 0.5 * tau * delta_bt**2
    loss = -x.adv * x.logp + penalty
    return finish(x, loss, token_metrics(x, exp_ratio(delta_bt)))


def m2po_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    behaviour_logp_bt: jax.Array | None = None,
    m2_threshold: float = M2PO_DEFAULT_THRESHOLD,
) -> LossAndMetrics:
    """M2PO: loss_t = -M_t * sg(pi_old/mu) * (pi/pi_old) * A_t, no clipping.

    Its value and gradient are those of -M_t * (pi/mu) * A_t whether pi_old is mu
    (``ratio_against="behaviour"``) or the proximal policy; M_t is
    ``m2po.m2po_mask`` of log(pi/mu) = sg(log pi) - log mu over this call's
    tokens (a learner using micro-batches should fold a whole-batch mask into
    ``mask_bt`` instead, see ``m2po``). Masked tokens count in ``masked_frac``;
    ``m2_before`` / ``m2_after`` report the second moment.

    References: M2PO, arXiv 2510.01161.
    """
    x = prepare(logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt)
    keep, m2 = m2po_mask(
        jax.lax.stop_gradient(x.logp) - x.behaviour, x.valid, threshold=m2_threshold
    )
    ratio = exp_ratio(x.logp - x.old)
    loss = jnp.where(keep, -exp_ratio(x.old - x.behaviour) * ratio * x.adv, 0.0)
    metrics = token_metrics(x, ratio, masked_frac=x.valid & ~keep)
    return finish(x, loss, {**metrics, **m2})


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla_pg": vanilla_pg_loss,
    "ppo": ppo_loss,
    "decoupled_ppo": decoupled_ppo_loss,
    "tis": tis_loss,
    "cispo": cispo_loss,
    "topr": topr_loss,
    "gspo": gspo_loss,
    "kimi_k15": kimi_k15_loss,
    "m2po": m2po_loss,
    **ROLLOUT_CORRECTIONS,  # verl's rollout-correction family and IcePop
}


PROXIMAL_LOSSES: tuple[str, ...] = ("decoupled_ppo", "tis", *ROLLOUT_CORRECTIONS)
"""Losses that weight by pi_old/mu: against mu itself (ratio_against="behaviour") the
weight is identically 1 and the correction would silently vanish, so they need the
proximal policy recomputed (ratio_against="proximal")."""


def get_policy_loss(name: str, **hparams: Any) -> PolicyLossFn:
    """``POLICY_LOSSES[name]`` with ``hparams`` bound; the error lists valid names."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose from {sorted(POLICY_LOSSES)}")
    fn = POLICY_LOSSES[name]
    if not hparams:
        return fn

    def bound(logp_bt, old_logp_bt, adv_bt, mask_bt, *, behaviour_logp_bt=None):
        return fn(
            logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt=behaviour_logp_bt, **hparams
        )

    return bound
