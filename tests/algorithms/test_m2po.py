"""M2PO second-moment mask and loss against hand-worked numbers (arXiv 2510.01161)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms import policy_loss as pl
from jaxflash.algorithms.m2po import m2po_mask


def _mask(d, m=None, tau=0.04):
    d = jnp.asarray(d, jnp.float32)
    m = jnp.ones_like(d) if m is None else jnp.asarray(m, jnp.float32)
    keep, stats = jax.jit(lambda a, b: m2po_mask(a, b, threshold=tau))(d, m)
    return np.asarray(keep).tolist(), {k: float(v) for k, v in stats.items()}


def test_mask_by_hand():
    # d^2 = [0.01, 0.25, 0.04, 0]: M2 = 0.3 / 4 = 0.075 > 0.04; without 0.25 the
    # mean is 0.05 / 3 = 0.0167 <= 0.04 -> one token masked.
    keep, st = _mask([[0.1, -0.5, 0.2, 0.0]])
    assert keep == [[True, False, True, True]]
    assert st["m2_before"] == pytest.approx(0.075)
    assert st["m2_after"] == pytest.approx(0.05 / 3)
    assert st["m2_masked"] == 1
    # tau = 0.01: 0.0167 > 0.01, so 0.04 goes too: mean of [0.01, 0] = 0.005.
    assert _mask([[0.1, -0.5, 0.2, 0.0]], tau=0.01)[0] == [[True, False, False, True]]
    assert _mask([[0.1, -0.5, 0.2, 0.0]], tau=0.1)[0] == [[True, True, True, True]]
    # tau = 0: every token with d != 0 goes.
    assert _mask([[0.1, -0.5, 0.2, 0.0]], tau=0.0)[0] == [[False, False, False, True]]


def test_mask_ignores_masked_tokens_and_ties_go_in_position_order():
    # The 9.0 behind the mask never counts: valid d^2 [0.01, 0.25, 0.04] mean 0.1.
    keep, st = _mask([[0.1, -0.5, 0.2, 9.0]], [[1, 1, 1, 0]])
    assert keep == [[True, False, True, False]]
    assert st["m2_before"] == pytest.approx(0.1)
    keep, _ = _mask([[0.1, -0.5, 0.2, float("nan")]], [[1, 1, 1, 0]])
    assert keep == [[True, False, True, False]]
    # Equal d^2 = 0.09, 0.09, 0: mean 0.06; drop position 0 -> 0.045; drop 1 -> 0.
    assert _mask([[0.3, -0.3, 0.0]])[0] == [[False, False, True]]


def test_mask_is_batch_level_across_rows():
    # d^2 [[0.25, 0], [0.01, 0]]: mean 0.065 -> drop the 0.25 -> 0.0033.
    keep, _ = _mask([[0.5, 0.0], [0.1, 0.0]])
    assert keep == [[False, True], [True, True]]
    # Per row the second row alone (mean 0.005) would keep everything; the first
    # row alone drops its 0.5 too -- same here, but a batch where rows disagree:
    keep, _ = _mask([[0.3, 0.3], [0.0, 0.0]], tau=0.04)  # mean 0.045 -> drop one 0.09
    assert keep == [[False, True], [True, True]]
    assert _mask([[0.3, 0.3]], tau=0.04)[0] == [[False, False]]  # alone: 0.09 > 0.04


def _loss_grad(logp, old, beh, adv, mask, **kw):
    def total(lp):
        loss, m = pl.m2po_loss(lp, old, adv, mask, behaviour_logp_bt=beh, **kw)
        return jnp.sum(loss), (loss, m)

    g, (loss, m) = jax.jit(jax.grad(total, has_aux=True))(jnp.asarray(logp, jnp.float32))
    return np.asarray(loss), m, np.asarray(g)


@pytest.mark.parametrize("against", ["proximal", "behaviour"])
def test_loss_by_hand_is_unclipped_weighted_on_kept_tokens(against):
    mu = jnp.array([[-1.0, -2.0, -0.5, -1.5]], jnp.float32)
    d = jnp.array([[0.1, -0.5, 0.2, 0.0]], jnp.float32)
    logp = mu + d
    adv = jnp.array([[1.0, 1.0, -1.0, 2.0]], jnp.float32)
    mask = jnp.ones((1, 4), jnp.float32)
    old = logp if against == "proximal" else mu
    loss, m, g = _loss_grad(logp, old, mu if against == "proximal" else None, adv, mask)
    w = [math.exp(0.1), 0.0, math.exp(0.2), 1.0]  # pi / mu, token 1 masked
    want = [-w[0] * 1.0, 0.0, w[2] * 1.0, -2.0]
    np.testing.assert_allclose(loss, [want], rtol=1e-5)
    np.testing.assert_allclose(g, [want], rtol=1e-5)  # d(-w A)/d log pi = -w A
    assert float(m["masked_frac"]) == pytest.approx(0.25)
    assert float(m["m2_before"]) == pytest.approx(0.075, rel=1e-5)
    assert float(m["clip_frac"]) == 0.0  # no trust region: nothing is clipped


def test_loss_nan_at_valid_position_is_counted_not_hidden():
    nan = float("nan")
    loss, m, _ = _loss_grad(
        [[0.0, 0.0]], [[0.0, 0.0]], jnp.array([[0.0, nan]]), [[1.0, 1.0]], [[1.0, 1.0]]
    )
    assert float(m["nonfinite_count"]) == 1.0
    assert np.isnan(loss[0, 1])
    with pytest.raises(ValueError, match="threshold"):
        m2po_mask(jnp.zeros(2), jnp.ones(2), threshold=-1.0)
