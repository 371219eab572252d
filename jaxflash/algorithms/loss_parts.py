"""Shared parts of the per-token policy losses (``policy_loss``, ``rollout_correction``).

Input preparation (shape checks, masking with ``jnp.where`` before any arithmetic,
stop-gradients, the non-finite count), the clamped ratio, eager hyper-parameter
checks, the masked token metrics and the PPO clipped surrogate. The conventions
(signature, metrics, masks and NaN) are those of the ``policy_loss`` module docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

LossAndMetrics = tuple[jax.Array, dict[str, jax.Array]]
PolicyLossFn = Callable[..., LossAndMetrics]
MAX_LOG_RATIO = 20.0


class Inputs(NamedTuple):
    logp: jax.Array  # differentiable; 0 behind the mask
    old: jax.Array  # stop-gradient; 0 behind the mask
    adv: jax.Array
    behaviour: jax.Array  # == old when no behaviour logprobs are given
    valid: jax.Array  # bool [B, T]
    nonfinite_count: jax.Array


def prepare(logp_bt, old_logp_bt, adv_bt, mask_bt, behaviour_logp_bt) -> Inputs:
    arrays = {"logp_bt": logp_bt, "old_logp_bt": old_logp_bt, "adv_bt": adv_bt, "mask_bt": mask_bt}
    if behaviour_logp_bt is not None:
        arrays["behaviour_logp_bt"] = behaviour_logp_bt
    arrays = {k: jnp.asarray(v) for k, v in arrays.items()}
    shape = arrays["logp_bt"].shape
    if len(shape) != 2:
        raise ValueError(f"logp_bt must be [B, T], got shape {shape}")
    for name, x in arrays.items():
        if x.shape != shape:
            raise ValueError(f"{name} shape {x.shape} must equal logp_bt shape {shape}")
    valid = arrays.pop("mask_bt") > 0
    finite = jnp.ones(shape, dtype=bool)
    for x in arrays.values():
        finite &= jnp.isfinite(x)
    clean = {k: jnp.where(valid, v.astype(jnp.float32), 0.0) for k, v in arrays.items()}
    sg = jax.lax.stop_gradient
    return Inputs(
        logp=clean["logp_bt"],
        old=sg(clean["old_logp_bt"]),
        adv=sg(clean["adv_bt"]),
        behaviour=sg(clean.get("behaviour_logp_bt", clean["old_logp_bt"])),
        valid=valid,
        nonfinite_count=sg(jnp.sum(valid & ~finite).astype(jnp.float32)),
    )


def exp_ratio(log_ratio: jax.Array) -> jax.Array:
    return jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def check_hparams(*, eps_low=None, eps_high=None, dual_clip_c=None, **positive) -> None:
    """Eager checks on Python-number hyper-parameters (traced values pass through)."""
    for name, v in (("clip_eps_low", eps_low), ("clip_eps_high", eps_high)):
        if isinstance(v, int | float) and not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if isinstance(eps_low, int | float) and eps_low > 1:
        raise ValueError(f"clip_eps_low must be <= 1 (ratios are positive), got {eps_low}")
    if isinstance(dual_clip_c, int | float) and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c}")
    for name, v in positive.items():
        if isinstance(v, int | float) and not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")


def token_metrics(x: Inputs, ratio_bt: jax.Array, **flags_bt: jax.Array) -> dict[str, jax.Array]:
    """Masked token statistics; ``flags_bt`` are bool [B, T] turned into fractions."""
    n = jnp.sum(x.valid).astype(jnp.float32)
    denom = jnp.maximum(n, 1.0)
    any_valid = n > 0
    out = {
        "ratio_mean": jnp.sum(jnp.where(x.valid, ratio_bt, 0.0)) / denom,
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(x.valid, ratio_bt, -jnp.inf)), 0.0),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(x.valid, ratio_bt, jnp.inf)), 0.0),
        "nonfinite_count": x.nonfinite_count,
        "num_tokens": n,
    }
    for key in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "masked_frac"):
        flag = flags_bt.pop(key, jnp.zeros_like(x.valid))
        out[key] = jnp.sum(x.valid & flag) / denom
    out["clip_frac"] = out["clip_frac_low"] + out["clip_frac_high"]
    for key, flag in flags_bt.items():
        out[key] = jnp.sum(x.valid & flag) / denom
    return jax.tree.map(jax.lax.stop_gradient, out)


def finish(x: Inputs, loss_bt: jax.Array, metrics: dict) -> tuple[jax.Array, dict]:
    return jnp.where(x.valid, loss_bt, 0.0), metrics


def ppo_clip(ratio, adv, eps_low, eps_high, dual_clip_c):
    """PPO clipped surrogate (as a loss) with optional dual clip; returns loss and flags."""
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    flags = {
        "clip_frac_low": (adv < 0) & (ratio < 1.0 - eps_low),
        "clip_frac_high": (adv > 0) & (ratio > 1.0 + eps_high),
    }
    if dual_clip_c is not None:
        # Dual clip (arXiv 1912.09729): for A < 0 the loss is bounded by -c*A, so a huge
        # ratio on a bad token cannot dominate the batch.
        cap = -dual_clip_c * adv
        flags["dual_clip_frac"] = (adv < 0) & (loss > cap)
        loss = jnp.where(adv < 0, jnp.minimum(loss, cap), loss)
    return loss, flags


def ppo_family(inputs, eps_low, eps_high, dual_clip_c, **positive):
    """Shared start of ppo / decoupled_ppo / tis: checks, prepare, ratio, clipped loss."""
    eps_high = eps_low if eps_high is None else eps_high
    check_hparams(eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c, **positive)
    x = prepare(*inputs)
    ratio = exp_ratio(x.logp - x.old)
    loss, flags = ppo_clip(ratio, x.adv, eps_low, eps_high, dual_clip_c)
    return x, ratio, loss, flags
