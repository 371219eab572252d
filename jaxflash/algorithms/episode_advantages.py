"""Advantages of multi-turn episodes over groups that share an environment seed.

Inputs are per-turn rewards ``rewards_bgk`` float32 [B, G, K] (B groups -- one
environment seed each --, G episodes per group, K turns, padded) with
``turn_mask_bgk`` [B, G, K] > 0 on turns that exist. An episode exists iff its
turn 0 exists; a missing episode (failed, aborted by redundancy) has an all-zero
mask row and gets advantage 0.

Returns-to-go (per episode, gamma in [0, 1]):
    G_t = r_t + gamma * G_{t+1},  G_K = 0    (over the episode's existing turns)

Two levels (GRPO-style group baselines, DeepSeekMath arXiv 2402.03300, with any
estimator of ``advantages.ADVANTAGE_ESTIMATORS``):

- ``trajectory_advantages``: one score per episode, its discounted return G_0
  (gamma = 1: the episode return, the sum of its turn rewards); the estimator
  normalises the scores within each group; every token of the episode gets its
  episode's advantage.
- ``step_advantages``: every turn t of every episode gets its own score G_t; the
  estimator normalises over all (episode, turn) pairs of the group (one baseline
  per group), so a turn is credited with what followed it. This is the turn-level
  credit assignment of step-wise agentic RL (ROLL Flash, arXiv 2510.11345, trains
  agentic tasks at either level); GiGPO (arXiv 2505.10978) refines the step
  baseline with anchor states, not done here.

All-equal scores give exactly 0 (the estimators' residue rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.algorithms.advantages import get_advantage_estimator


def _check(rewards_bgk: jax.Array, turn_mask_bgk: jax.Array, gamma: float):
    rewards_bgk = jnp.asarray(rewards_bgk, jnp.float32)
    turn_mask_bgk = jnp.asarray(turn_mask_bgk)
    if rewards_bgk.ndim != 3:
        raise ValueError(f"rewards_bgk must be [B, G, K], got shape {rewards_bgk.shape}")
    if turn_mask_bgk.shape != rewards_bgk.shape:
        raise ValueError(
            f"turn_mask_bgk shape {turn_mask_bgk.shape} must equal rewards_bgk shape "
            f"{rewards_bgk.shape}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    valid = turn_mask_bgk > 0
    return jnp.where(valid, rewards_bgk, 0.0), valid


def returns_to_go(
    rewards_bgk: jax.Array, turn_mask_bgk: jax.Array, *, gamma: float = 1.0
) -> jax.Array:
    """Discounted returns-to-go G_t of every turn.

    Args:
      rewards_bgk: float [B, G, K] per-turn rewards (anything where masked).
      turn_mask_bgk: [B, G, K], > 0 on existing turns (a prefix of each row).
      gamma: discount per turn, in [0, 1].

    Returns:
      float32 [B, G, K]; 0 on missing turns.

    Raises:
      ValueError: shapes differ or are not 3-D; gamma outside [0, 1].
    """
    r_bgk, valid = _check(rewards_bgk, turn_mask_bgk, gamma)
    out = []
    running = jnp.zeros(r_bgk.shape[:2], jnp.float32)
    for k in range(r_bgk.shape[2] - 1, -1, -1):  # K is small and static
        running = r_bgk[..., k] + gamma * running
        out.append(running)
    return jnp.where(valid, jnp.stack(out[::-1], axis=-1), 0.0)


def trajectory_advantages(
    rewards_bgk: jax.Array,
    turn_mask_bgk: jax.Array,
    *,
    gamma: float = 1.0,
    estimator: str = "grpo",
    **estimator_kwargs,
) -> jax.Array:
    """One advantage per episode from its discounted return, normalised in its group.

    Args:
      rewards_bgk, turn_mask_bgk, gamma: as ``returns_to_go``.
      estimator: an ``ADVANTAGE_ESTIMATORS`` name (grpo, dr_grpo, rloo, reinforce_pp).
      **estimator_kwargs: passed on (eps, residue_rtol, std_normalize for rloo).

    Returns:
      float32 [B, G]; 0 for missing episodes.
    """
    g_bgk = returns_to_go(rewards_bgk, turn_mask_bgk, gamma=gamma)
    exists_bg = jnp.asarray(turn_mask_bgk)[..., 0] > 0
    fn = get_advantage_estimator(estimator)
    return fn(g_bgk[..., 0], mask_bg=exists_bg, **estimator_kwargs)


def step_advantages(
    rewards_bgk: jax.Array,
    turn_mask_bgk: jax.Array,
    *,
    gamma: float = 1.0,
    estimator: str = "grpo",
    **estimator_kwargs,
) -> jax.Array:
    """One advantage per turn from its return-to-go, normalised over the group's turns.

    Args/Returns: as ``trajectory_advantages``, but the result is float32 [B, G, K]
    (0 on missing turns).
    """
    g_bgk = returns_to_go(rewards_bgk, turn_mask_bgk, gamma=gamma)
    B, G, K = g_bgk.shape
    valid = jnp.asarray(turn_mask_bgk) > 0
    fn = get_advantage_estimator(estimator)
    adv = fn(g_bgk.reshape(B, G * K), mask_bg=valid.reshape(B, G * K), **estimator_kwargs)
    return adv.reshape(B, G, K)


EPISODE_ADVANTAGE_LEVELS = {"trajectory": trajectory_advantages, "step": step_advantages}
