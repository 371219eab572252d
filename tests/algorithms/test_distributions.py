"""The processed sampling distribution: top-k/top-p renormalisation and temperature.

Cases from the RL-pitfalls list, "Importance ratios". Expected values are
worked out by hand (math module), not by the code under test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms.distributions import (
    NEG_INF,
    entropy_from_logprobs,
    processed_log_softmax,
)

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = jnp.log(jnp.array(PROBS))


def test_top_k_renormalisation_ratio_is_one():
    """Top-k 2, token 0: engine and learner both score log(0.5/0.8) -> ratio exactly 1."""
    engine = processed_log_softmax(LOGITS, top_k=2)
    learner = processed_log_softmax(LOGITS, top_k=2)
    np.testing.assert_allclose(engine[0], math.log(0.625), rtol=1e-6)
    assert float(jnp.exp(engine[0] - learner[0])) == 1.0
    np.testing.assert_array_equal(engine[2:], np.float32([NEG_INF, NEG_INF]))
    np.testing.assert_allclose(jnp.sum(jnp.exp(engine)), 1.0, rtol=1e-6)
    # The pitfall: a full-vocabulary learner logprob gives 0.5 / 0.625 = 0.8.
    full = processed_log_softmax(LOGITS)
    np.testing.assert_allclose(jnp.exp(full[0] - engine[0]), 0.8, rtol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "expected_logq0"),
    [
        (0.7, math.log(0.625)),  # cumulative-before [0, .5, .8, .95] -> keep 2
        (0.5, 0.0),  # only the most likely token (cumulative-before 0.5 is not < 0.5)
        (1e-6, 0.0),  # the most likely token is always kept
    ],
)
def test_top_p(top_p, expected_logq0):
    logq = processed_log_softmax(LOGITS, top_p=top_p)
    np.testing.assert_allclose(logq[0], expected_logq0, atol=1e-6)
    np.testing.assert_allclose(jnp.sum(jnp.exp(logq)), 1.0, rtol=1e-6)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # After top-k 3: [.5, .3, .15] / .95 -> cumulative-before of token 2 is 0.842 > 0.83:
    # dropped. On the unrenormalised distribution it would be 0.8 < 0.83 and kept.
    logq = processed_log_softmax(LOGITS, top_k=3, top_p=0.83)
    np.testing.assert_allclose(logq[:2], [math.log(0.625), math.log(0.375)], rtol=1e-6)
    assert logq[2] == np.float32(NEG_INF)


def test_top_k_keeps_ties_on_both_sides():
    logq = processed_log_softmax(jnp.array([1.0, 1.0, 1.0, 0.0]), top_k=2)
    np.testing.assert_allclose(jnp.exp(logq), [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)


def test_temperature_ratio_and_entropy():
    """Logits [2, 1, 0], T = 0.5, token 0: log softmax(z/T)[0] = log 0.8668133 on both sides."""
    logits = jnp.array([2.0, 1.0, 0.0])
    engine = processed_log_softmax(logits, temperature=0.5)
    learner = processed_log_softmax(logits, temperature=0.5)
    np.testing.assert_allclose(engine[0], math.log(0.8668133), rtol=1e-6)
    assert float(jnp.exp(engine[0] - learner[0])) == 1.0
    # Forgetting T on the learner side: 0.6652410 / 0.8668133 = 0.7674558.
    forgot = processed_log_softmax(logits)
    np.testing.assert_allclose(jnp.exp(forgot[0] - engine[0]), 0.7674558, rtol=1e-6)
    # Entropy of softmax(z/T) = [0.8668133, 0.1173104, 0.0158762].
    np.testing.assert_allclose(entropy_from_logprobs(engine), 0.4410574, rtol=1e-6)


def test_temperature_array_broadcasts_per_row():
    logits = jnp.array([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    logq = processed_log_softmax(logits, temperature=jnp.array([[0.5], [1.0]]))
    np.testing.assert_allclose(jnp.exp(logq[:, 0]), [0.8668133, 0.6652410], rtol=1e-6)


def test_entropy_of_truncated_distribution():
    # Top-k 2 of PROBS: [0.625, 0.375] -> -(.625 ln .625 + .375 ln .375) = 0.6615632.
    logq = processed_log_softmax(LOGITS, top_k=2)
    np.testing.assert_allclose(entropy_from_logprobs(logq), 0.6615632, rtol=1e-6)


def test_gradients_are_finite_with_truncation():
    def score(z):
        logq = processed_log_softmax(z, temperature=0.7, top_k=3, top_p=0.9)
        return logq[..., 0].sum() + entropy_from_logprobs(logq).sum()

    grad = jax.jit(jax.grad(score))(jnp.stack([LOGITS, LOGITS[::-1]]))
    assert np.all(np.isfinite(grad))


def test_bfloat16_logits_give_float32_and_leading_dims_are_kept():
    logq = processed_log_softmax(jnp.zeros((2, 3, 5), jnp.bfloat16), top_k=2)
    assert logq.dtype == jnp.float32 and logq.shape == (2, 3, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 5}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        processed_log_softmax(LOGITS, **kwargs)
