"""Advantage estimators against values worked out by hand (see each comment)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms import advantages
from jaxflash.algorithms.advantages import ADVANTAGE_ESTIMATORS

NAN = float("nan")
# Group 1: [1, 0, 0, 0]: mean 0.25, deviations [.75, -.25, -.25, -.25], sum sq 0.75.
# Group 2: [2, 4, 6, 8]: mean 5, deviations [-3, -1, 1, 3], sum sq 20.
REWARDS = [[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]]


def test_grpo_by_hand():
    # std (ddof=1): sqrt(0.75/3) = 0.5 and sqrt(20/3) = 2.5819889.
    adv = advantages.grpo_advantages(jnp.array(REWARDS), eps=0.0)
    np.testing.assert_allclose(
        adv,
        [[1.5, -0.5, -0.5, -0.5], [-1.1618950, -0.3872983, 0.3872983, 1.1618950]],
        rtol=1e-6,
    )


def test_grpo_eps_is_added_to_std():
    adv = advantages.grpo_advantages(jnp.array([[1.0, 0.0, 0.0, 0.0]]), eps=0.5)
    np.testing.assert_allclose(adv, [[0.75, -0.25, -0.25, -0.25]], rtol=1e-6)  # / (0.5 + 0.5)


def test_grpo_missing_samples_excluded_and_nan_does_not_leak():
    # Valid [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3], var 0.6667/2, std 0.5773503.
    adv = advantages.grpo_advantages(
        jnp.array([[1.0, 0.0, NAN, 0.0]]), mask_bg=jnp.array([[1, 1, 0, 1]]), eps=0.0
    )
    np.testing.assert_allclose(adv, [[1.1547005, -0.5773503, 0.0, -0.5773503]], rtol=1e-6)


def test_dr_grpo_by_hand():
    adv = advantages.dr_grpo_advantages(jnp.array(REWARDS))
    np.testing.assert_allclose(adv, [[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 1.0, 3.0]])


def test_rloo_by_hand():
    # Group 2 baselines: 18/3=6, 16/3, 14/3, 12/3=4.
    adv = advantages.rloo_advantages(jnp.array(REWARDS))
    np.testing.assert_allclose(
        adv,
        [[1.0, -1 / 3, -1 / 3, -1 / 3], [-4.0, -4 / 3, 4 / 3, 4.0]],
        rtol=1e-6,
    )


def test_rloo_with_missing_sample():
    # Valid [1, 0, 3]: baselines 1.5, 2.0, 0.5.
    adv = advantages.rloo_advantages(
        jnp.array([[1.0, 0.0, NAN, 3.0]]), mask_bg=jnp.array([[1.0, 1.0, 0.0, 1.0]])
    )
    np.testing.assert_allclose(adv, [[-0.5, -2.0, 0.0, 2.5]], rtol=1e-6)


def test_rloo_single_valid_sample_gets_zero():
    adv = advantages.rloo_advantages(jnp.array([[5.0, 1.0]]), mask_bg=jnp.array([[1, 0]]))
    np.testing.assert_array_equal(adv, [[0.0, 0.0]])


def test_fp32_residue_leave_one_out_normalisation():
    """rl_pitfalls: [0.35]*7 + [0.0]; the others of the odd sample are all equal."""
    rewards = jnp.array([[0.35] * 7 + [0.0]], jnp.float32)
    # The vector bites: the naive formula gives |A| in the hundreds of thousands.
    r = np.asarray(rewards[0])
    others = r[:7]
    base = (r.sum() - r[7]) / np.float32(7)
    naive_std = np.sqrt(((others - base) ** 2).sum() / np.float32(6))
    assert 0.0 < naive_std < 1e-6
    assert abs((r[7] - base) / (naive_std + np.float32(1e-6))) > 1000
    adv = advantages.rloo_advantages(rewards, std_normalize=True)
    # Odd one: 0 - 0.35, std of others is residue -> not rescaled.
    # Others: baseline 0.3, deviation 0.05, std of [0.35]*6 + [0] (ddof=1) = sqrt(0.105/6).
    expected = [0.3779645] * 7 + [-0.35]
    np.testing.assert_allclose(adv, [expected], rtol=1e-5)
    assert np.all(np.abs(adv) <= 1.0)


def test_fp32_residue_grpo_group_is_bounded():
    # mean 0.30625, sum sq dev 0.1071875, std (ddof=1) 0.1237437.
    adv = advantages.grpo_advantages(jnp.array([[0.35] * 7 + [0.0]]), eps=0.0)
    np.testing.assert_allclose(adv, [[0.3535534] * 7 + [-2.4748737]], rtol=1e-5)


def test_reinforce_pp_batch_normalised():
    # Group-centred values as in dr_grpo; batch population std sqrt(20.75/8) = 1.6105123.
    adv = advantages.reinforce_pp_advantages(jnp.array(REWARDS), eps=0.0)
    np.testing.assert_allclose(
        adv,
        [
            [0.4656903, -0.1552301, -0.1552301, -0.1552301],
            [-1.8627611, -0.6209204, 0.6209204, 1.8627611],
        ],
        rtol=1e-6,
    )


ALL_EQUAL_GROUPS = [
    [[1.0, 1.0, 1.0, 1.0]],
    [[0.35] * 8],
    [[0.1] * 5],
    [[-7.3, -7.3, -7.3]],
    [[0.0, 0.0]],
]


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("group", ALL_EQUAL_GROUPS)
def test_all_equal_group_is_exactly_zero(name, group):
    adv = ADVANTAGE_ESTIMATORS[name](jnp.array(group, jnp.float32))
    assert np.all(np.isfinite(adv))
    np.testing.assert_array_equal(adv, np.zeros_like(group))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_all_equal_group_next_to_a_real_one_stays_zero(name):
    rewards = jnp.array([[0.1, 0.1, 0.1], [1.0, 0.0, 0.0]], jnp.float32)
    adv = jax.jit(ADVANTAGE_ESTIMATORS[name])(rewards)
    np.testing.assert_array_equal(adv[0], [0.0, 0.0, 0.0])
    assert np.all(np.abs(adv[1]) > 0.1)


def test_rloo_std_normalize_all_equal_is_zero():
    adv = advantages.rloo_advantages(jnp.array([[0.35] * 8]), std_normalize=True)
    np.testing.assert_array_equal(adv, np.zeros((1, 8)))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_bad_inputs_are_named(name):
    fn = ADVANTAGE_ESTIMATORS[name]
    with pytest.raises(ValueError, match="rewards_bg"):
        fn(jnp.zeros(4))
    with pytest.raises(ValueError, match="mask_bg"):
        fn(jnp.zeros((2, 4)), mask_bg=jnp.ones((2, 3)))


def test_unknown_estimator_lists_names():
    with pytest.raises(ValueError, match="grpo"):
        advantages.get_advantage_estimator("ppo_gae")
    assert advantages.get_advantage_estimator("rloo") is advantages.rloo_advantages
