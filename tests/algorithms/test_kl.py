"""KL estimators k1/k2/k3 and entropy helpers against hand-worked values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms import kl
from jaxflash.algorithms.distributions import NEG_INF

NAN = float("nan")
# d = logp - ref = [0.5, -1, 0]; fourth token masked (NaN on both sides).
LOGP = jnp.array([[-1.0, -2.0, -0.5, NAN]])
REF = jnp.array([[-1.5, -1.0, -0.5, NAN]])
MASK = jnp.array([[1, 1, 1, 0]])


def test_k1_k2_k3_by_hand():
    np.testing.assert_allclose(kl.kl_k1(LOGP, REF, MASK), [[0.5, -1.0, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(kl.kl_k2(LOGP, REF, MASK), [[0.125, 0.5, 0.0, 0.0]], rtol=1e-6)
    # k3 = exp(-d) - 1 + d: exp(-0.5) - 0.5 = 0.1065307; e - 2 = 0.7182818; 0.
    np.testing.assert_allclose(
        kl.kl_k3(LOGP, REF, MASK), [[0.1065307, 0.7182818, 0.0, 0.0]], rtol=1e-6
    )


@pytest.mark.parametrize("name", sorted(kl.KL_ESTIMATORS))
def test_masked_nan_does_not_leak_into_value_or_gradient(name):
    fn = jax.jit(
        jax.value_and_grad(lambda lp: jnp.sum(kl.kl_penalty(lp, REF, MASK, estimator=name)))
    )
    value, grad = fn(LOGP)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert float(grad[0, 3]) == 0.0


@pytest.mark.parametrize("name", sorted(kl.KL_ESTIMATORS))
def test_nan_at_valid_position_propagates(name):
    out = kl.kl_penalty(jnp.array([[NAN]]), jnp.array([[0.0]]), jnp.array([[1]]), estimator=name)
    assert np.isnan(out[0, 0])


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_average_to_exact_kl(name):
    # pi = [0.5, 0.5], ref = [0.25, 0.75]: KL = 0.5 ln 2 + 0.5 ln(2/3) = 0.1438410.
    logp = jnp.log(jnp.array([[0.5, 0.5]]))
    ref = jnp.log(jnp.array([[0.25, 0.75]]))
    per_token = kl.kl_penalty(logp, ref, jnp.ones((1, 2)), estimator=name)
    np.testing.assert_allclose(jnp.sum(0.5 * per_token), 0.1438410, rtol=1e-5)


def test_k3_nonnegative_and_finite_for_extreme_ratios():
    logp = jnp.array([[0.0, -200.0, -1e-7]])
    ref = jnp.array([[-200.0, 0.0, 0.0]])
    out = kl.kl_k3(logp, ref, jnp.ones((1, 3)))
    assert np.all(np.isfinite(out)) and np.all(out >= 0)


def test_sampled_entropy():
    out = kl.sampled_entropy(jnp.array([[-1.0, NAN]]), jnp.array([[1, 0]]))
    np.testing.assert_array_equal(out, [[1.0, 0.0]])


def test_token_entropy_with_truncated_support():
    # Row 0: [0.5, 0.5, 0, 0] -> ln 2; row 1: uniform over 4 -> ln 4; row 2 masked (NaN).
    logq = jnp.array(
        [
            [[math.log(0.5), math.log(0.5), NEG_INF, NEG_INF]],
            [[math.log(0.25)] * 4],
            [[NAN] * 4],
        ]
    )
    out = kl.token_entropy(logq, jnp.array([[1], [1], [0]]))
    np.testing.assert_allclose(out, [[0.6931472], [1.3862944], [0.0]], rtol=1e-6)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="ref_logp_bt"):
        kl.kl_k3(jnp.zeros((1, 2)), jnp.zeros((1, 3)), jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="k2"):
        kl.kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), estimator="k4")
    with pytest.raises(ValueError, match="mask_bt"):
        kl.token_entropy(jnp.zeros((1, 2, 3)), jnp.ones((1, 3)))
