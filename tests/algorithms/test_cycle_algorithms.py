"""ESS and ratio stats by cycle, joint/split advantages, the per-cycle loss: by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms import policy_loss as pl
from jaxflash.algorithms.cycle_advantages import cycle_advantages
from jaxflash.algorithms.cycle_loss import make_cycle_loss
from jaxflash.algorithms.importance import (
    effective_sample_size,
    per_sample_ratio_stats,
    ratio_metrics_by_cycle,
)

LN = math.log


def test_ess_by_hand():
    # w = [1, 2, 0.5]: (3.5)^2 / (3 * 5.25) = 0.7778.
    assert effective_sample_size(np.log([1.0, 2.0, 0.5])) == pytest.approx(12.25 / 15.75)
    assert effective_sample_size(np.zeros(5)) == pytest.approx(1.0)
    # log space: weights e^1000 and e^999 do not overflow; ratio e: (1+e)^2/(2(1+e^2)).
    e = math.e
    assert effective_sample_size(np.array([1000.0, 999.0])) == pytest.approx(
        (1 + e) ** 2 / (2 * (1 + e * e))
    )
    with pytest.raises(ValueError):
        effective_sample_size(np.zeros(0))


def test_ratio_metrics_by_cycle_by_hand():
    # Row 0 fresh, w = [1, 1]; row 1 replay, w = [2, 0.5] (+ a masked NaN);
    # row 2 replay, w = [1]; row 3 padding (no tokens).
    lr = np.array([[0, 0, 0], [LN(2), LN(0.5), np.nan], [0, 0, 0], [0, 0, 0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)
    stats = jax.jit(per_sample_ratio_stats)(lr, mask)
    m = ratio_metrics_by_cycle(stats, np.array([0, 1, 1, 1]))
    assert m["fresh_ratio_mean"] == pytest.approx(1.0) and m["fresh_ess_token"] == pytest.approx(1)
    assert m["replay_ratio_tokens"] == 3 and m["replay_sequences"] == 2
    assert m["replay_ratio_mean"] == pytest.approx(3.5 / 3)
    assert m["replay_ratio_max"] == pytest.approx(2.0) and m["replay_ratio_min"] == pytest.approx(
        0.5
    )
    # token ESS: 3.5^2 / (3 * (4 + 0.25 + 1)) = 0.7778
    assert m["replay_ess_token"] == pytest.approx(12.25 / 15.75, rel=1e-6)
    # sequence weights W = [2 * 0.5, 1] = [1, 1] -> 1
    assert m["replay_ess_seq"] == pytest.approx(1.0, rel=1e-6)
    empty = ratio_metrics_by_cycle(stats, np.array([0, 0, 0, 0]))
    assert empty["replay_ratio_tokens"] == 0 and "replay_ess_token" not in empty
    with pytest.raises(ValueError, match="labels"):
        ratio_metrics_by_cycle(stats, np.array([0, 2, 0, 0]))


def test_joint_and_split_advantages_by_hand():
    # Prompt "a": fresh rewards [1, 0], replayed [1, 1]; prompt "b": fresh [0, 1].
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    groups = ["a", "a", "a", "a", "b", "b"]
    replay = [False, False, True, True, False, False]
    # joint "a": [1, 0, 1, 1], mean 0.75, std (ddof 1) 0.5 -> [0.5, -1.5, 0.5, 0.5]
    joint = cycle_advantages(rewards, groups, replay, mode="joint")
    # a pair [1, 0]: centred +-0.5, std (ddof 1) sqrt(0.5) -> +-0.5 / (0.7071 + 1e-6)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(joint, [0.5, -1.5, 0.5, 0.5, -s, s], rtol=1e-5)
    # split: fresh "a" [1, 0] -> +-s; replayed [1, 1] -> exactly 0.
    split = cycle_advantages(rewards, groups, replay, mode="split")
    np.testing.assert_allclose(split, [s, -s, 0.0, 0.0, -s, s], rtol=1e-5)
    assert split[2] == 0.0 and split[3] == 0.0
    dr = cycle_advantages(rewards, groups, replay, mode="joint", estimator="dr_grpo")
    np.testing.assert_allclose(dr, [0.25, -0.75, 0.25, 0.25, -0.5, 0.5], rtol=1e-6)
    with pytest.raises(ValueError, match="mode"):
        cycle_advantages(rewards, groups, replay, mode="both")
    with pytest.raises(ValueError, match="reinforce_pp"):
        cycle_advantages(rewards, groups, replay, mode="joint", estimator="reinforce_pp")


def test_cycle_loss_is_each_cycles_loss_on_its_rows():
    rng = np.random.default_rng(0)
    shape = (4, 5)
    logp = jnp.asarray(-rng.random(shape) * 2, jnp.float32)
    mu = logp + jnp.asarray(rng.normal(size=shape) * 0.4, jnp.float32)
    adv = jnp.asarray(np.repeat(rng.normal(size=(4, 1)), 5, 1), jnp.float32)
    mask = jnp.asarray(rng.random(shape) < 0.8, jnp.float32)
    replay_b = jnp.array([0, 1, 0, 1])
    fn = make_cycle_loss("ppo", "m2po", replay_kwargs={"m2_threshold": 0.02})
    loss, m = jax.jit(
        lambda lp: fn(
            lp, jax.lax.stop_gradient(lp), adv, mask, replay_b=replay_b, behaviour_logp_bt=mu
        )
    )(logp)
    rows = np.array([False, True, False, True])[:, None]
    f_loss, f_m = pl.ppo_loss(logp, logp, adv, jnp.where(rows, 0.0, mask), behaviour_logp_bt=mu)
    r_loss, r_m = pl.m2po_loss(
        logp, logp, adv, jnp.where(rows, mask, 0.0), behaviour_logp_bt=mu, m2_threshold=0.02
    )
    np.testing.assert_allclose(loss, np.where(rows, r_loss, f_loss), rtol=1e-6)
    assert float(m["num_tokens"]) == float(mask.sum())
    assert float(m["replay_pg_masked_frac"]) == pytest.approx(float(r_m["masked_frac"]))
    assert float(m["replay_pg_masked_frac"]) > 0  # M2PO saw the replay rows' log-ratios only
    want = (r_m["masked_frac"] * r_m["num_tokens"]) / mask.sum()
    assert float(m["masked_frac"]) == pytest.approx(float(want), rel=1e-6)
    assert float(m["ratio_max"]) == pytest.approx(
        max(float(f_m["ratio_max"]), float(r_m["ratio_max"]))
    )
    with pytest.raises(ValueError, match="replay_b"):
        fn(logp, logp, adv, mask, replay_b=jnp.zeros(3))
