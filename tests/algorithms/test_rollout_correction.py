"""Rollout corrections (verl's TIS / MIS family, IcePop) against values worked out by
hand: loss per token, its gradient w.r.t. log pi, and the masked / truncated fractions."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms import rollout_correction as rc
from jaxflash.algorithms.loss_hparams import check_loss_hparams
from jaxflash.algorithms.policy_loss import POLICY_LOSSES, PROXIMAL_LOSSES
from jaxflash.learner.config import LearnerConfig

LN = math.log


def _arr(x):
    return jnp.array(x, jnp.float32)


def _loss_and_grad(fn, logp, old, adv, mask, behaviour, **kw):
    """(loss_bt, metrics, d sum(loss_bt) / d logp_bt), jitted once per call."""

    def total(lp):
        loss, metrics = fn(lp, old, adv, mask, behaviour_logp_bt=behaviour, **kw)
        return jnp.sum(loss), (loss, metrics)

    grad, (loss, metrics) = jax.jit(jax.grad(total, has_aux=True))(_arr(logp))
    return np.asarray(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


# Token cases: rho = pi_old/mu = [3, 0.4, 1.5, 0.1, 1]; A = [1, 1, -1, 1, 1].
# PPO ratio r = pi/pi_old = 1 except the last token (r = 1.5, A = 1: clipped at 1.2,
# no gradient). Unclipped: loss_t = -w A, grad -w A.
TOK_OLD = _arr([[0.0, 0.0, 0.0, 0.0, -LN(1.5)]])
TOK_LOGP = [[0.0] * 5]
TOK_MU = TOK_OLD - _arr([[LN(3.0), LN(0.4), LN(1.5), LN(0.1), 0.0]])
TOK_ADV = _arr([[1.0, 1.0, -1.0, 1.0, 1.0]])
TOK_MASK = _arr([[1.0] * 5])

TOKEN_CASES = [
    # token_mis, [1/2, 2]: keeps rho 1.5 and 1 -> w = [0, 0, 1.5, 0, 1]
    ("token_mis", {}, [0, 0, 1.5, 0, 1], [0, 0, 1.5, 0, -1.2], [0, 0, 1.5, 0, 0], 3 / 5),
    # lower 0.3: rho 0.4 kept too
    (
        "token_mis",
        {"mis_lower": 0.3},
        [0, 0.4, 1.5, 0, 1],
        [0, -0.4, 1.5, 0, -1.2],
        [0, -0.4, 1.5, 0, 0],
        2 / 5,
    ),
    # IcePop [0.5, 5]: rho 3 kept, 0.4 and 0.1 dropped
    ("icepop", {}, [3, 0, 1.5, 0, 1], [-3, 0, 1.5, 0, -1.2], [-3, 0, 1.5, 0, 0], 2 / 5),
    # IcePop [0.05, 2]: 3 dropped on the high side, 0.1 and 0.4 kept
    (
        "icepop",
        {"icepop_low": 0.05, "icepop_high": 2.0},
        [0, 0.4, 1.5, 0.1, 1],
        [0, -0.4, 1.5, -0.1, -1.2],
        [0, -0.4, 1.5, -0.1, 0],
        1 / 5,
    ),
]


@pytest.mark.parametrize(("name", "kw", "w", "loss", "grad", "masked"), TOKEN_CASES)
def test_token_level_masks(name, kw, w, loss, grad, masked):
    fn = POLICY_LOSSES[name]
    got_loss, m, got_grad = _loss_and_grad(fn, TOK_LOGP, TOK_OLD, TOK_ADV, TOK_MASK, TOK_MU, **kw)
    np.testing.assert_allclose(got_loss, [loss], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_grad, [grad], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["masked_frac"], masked, rtol=1e-6)
    np.testing.assert_allclose(m["is_weight_mean"], sum(w) / 5, rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 5)  # the r = 1.5 token


# Sequence cases: 2 sequences x 3 tokens, r = 1, A = +1 / -1 per sequence. rho of
# sequence 0 = [2, 2, 1/4] (product 1, geometric mean 1); sequence 1 = [3, 2] and a
# masked third token whose (garbage) rho 100 must be ignored: product 6, geo sqrt 6.
SEQ_OLD = _arr([[0.0] * 3, [0.0] * 3])
SEQ_MU = -_arr([[LN(2), LN(2), LN(0.25)], [LN(3), LN(2), LN(100)]])
SEQ_ADV = _arr([[1.0] * 3, [-1.0] * 3])
SEQ_MASK = _arr([[1, 1, 1], [1, 1, 0]])

SEQ_CASES = [
    # seq TIS, C = 2: w = [1, min(6, 2) = 2]; sequence 1's 2 tokens truncated
    ("seq_tis", {}, [1, 2], "is_truncated_frac", 2 / 5),
    ("seq_tis", {"tis_cap": 10.0}, [1, 6], "is_truncated_frac", 0.0),
    # seq MIS [1/2, 2]: sequence 1 (rho 6) dropped; [1/8, 8]: both kept, weighted
    ("seq_mis", {}, [1, 0], "masked_frac", 2 / 5),
    ("seq_mis", {"mis_upper": 8.0}, [1, 6], "masked_frac", 0.0),
    # geometric [1/1.001, 1.001]: g = [1, 2.449]: sequence 1 dropped; hi 3: both, w = 1
    ("geo_mis", {}, [1, 0], "masked_frac", 2 / 5),
    ("geo_mis", {"mis_upper": 3.0}, [1, 1], "masked_frac", 0.0),
    # geometric lower bound: lo 0.5 < g, so nothing dropped from below either
    ("geo_mis", {"mis_upper": 3.0, "mis_lower": 0.5}, [1, 1], "masked_frac", 0.0),
]


@pytest.mark.parametrize(("name", "kw", "w_b", "frac_key", "frac"), SEQ_CASES)
def test_sequence_level_weights_and_masks(name, kw, w_b, frac_key, frac):
    fn = POLICY_LOSSES[name]
    loss, m, grad = _loss_and_grad(fn, SEQ_OLD, SEQ_OLD, SEQ_ADV, SEQ_MASK, SEQ_MU, **kw)
    want = -np.asarray(SEQ_ADV) * np.asarray(w_b)[:, None] * np.asarray(SEQ_MASK)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)  # r = 1: grad = -w A
    np.testing.assert_allclose(m[frac_key], frac, rtol=1e-6)
    np.testing.assert_allclose(m["is_weight_mean"], (3 * w_b[0] + 2 * w_b[1]) / 5, rtol=1e-5)
    assert m["num_tokens"] == 5.0


def test_long_sequences_never_overflow():
    """log rho = 5 on each of 200 tokens (product e^1000): weights stay finite."""
    logp = jnp.zeros((1, 200))
    mu = logp - 5.0
    adv, mask = jnp.ones((1, 200)), jnp.ones((1, 200))
    for name in rc.ROLLOUT_CORRECTIONS:
        loss, m, grad = _loss_and_grad(POLICY_LOSSES[name], logp, logp, adv, mask, mu)
        assert np.isfinite(loss).all() and np.isfinite(grad).all(), name
        assert all(math.isfinite(v) for v in m.values()), name
    loss, m, _ = _loss_and_grad(rc.seq_tis_loss, logp, logp, adv, mask, mu)
    np.testing.assert_allclose(loss, -2.0 * np.ones((1, 200)), rtol=1e-6)  # truncated at C = 2
    assert m["is_truncated_frac"] == 1.0


def test_every_correction_is_registered_needs_the_proximal_policy_and_is_configurable():
    assert set(rc.ROLLOUT_CORRECTIONS) <= set(POLICY_LOSSES)
    assert set(rc.ROLLOUT_CORRECTIONS) <= set(PROXIMAL_LOSSES)
    for name in rc.ROLLOUT_CORRECTIONS:
        LearnerConfig(loss=name, ratio_against="proximal")  # fresh rows
        LearnerConfig(replay_loss=name, replay_ratio_against="proximal")  # replayed rows
        with pytest.raises(ValueError, match="needs ratio_against='proximal'"):
            LearnerConfig(loss=name, ratio_against="behaviour")
    with pytest.raises(ValueError, match=r"loss_kwargs\.mis_upper must be a number >= 1"):
        LearnerConfig(loss="seq_mis", ratio_against="proximal", loss_kwargs={"mis_upper": 0.5})
    with pytest.raises(ValueError, match=r"w\.icepop_low must be a number in \(0, 1\]"):
        check_loss_hparams("icepop", {"icepop_low": 2.0}, where="w")
    with pytest.raises(ValueError, match="mis_upper must be >= 1"):
        rc.token_mis_loss(*(jnp.zeros((1, 2)),) * 4, mis_upper=0.9)
    with pytest.raises(ValueError, match="icepop_low must be in"):
        rc.icepop_loss(*(jnp.zeros((1, 2)),) * 4, icepop_low=0.0)


def test_nan_behind_the_mask_never_reaches_weights():
    mu = _arr([[0.0, float("nan")]])
    mask = _arr([[1, 0]])
    for name in rc.ROLLOUT_CORRECTIONS:
        fn = functools.partial(POLICY_LOSSES[name], behaviour_logp_bt=mu)
        loss, m = jax.jit(fn)(_arr([[0.0, 0.0]]), _arr([[0.0, 0.0]]), _arr([[1.0, 1.0]]), mask)
        assert np.isfinite(np.asarray(loss)).all() and m["num_tokens"] == 1.0, name
        np.testing.assert_allclose(loss, [[-1.0, 0.0]], err_msg=name)


def test_fresh_and_replayed_rows_each_get_their_correction():
    """learner.loss for fresh rows, replay.correction for replayed ones (cycle_loss):
    row 0 fresh under IcePop (rho [2, 2, 1/4]: the 1/4 token dropped), row 1 replayed
    under sequence TIS (rho_b = 6 truncated to 2)."""
    from jaxflash.algorithms.cycle_loss import make_cycle_loss

    fn = functools.partial(make_cycle_loss("icepop", "seq_tis"), replay_b=jnp.array([0, 1]))
    loss, m, grad = _loss_and_grad(fn, SEQ_OLD, SEQ_OLD, SEQ_ADV, SEQ_MASK, SEQ_MU)
    np.testing.assert_allclose(loss, [[-2, -2, 0], [2, 2, 0]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, [[-2, -2, 0], [2, 2, 0]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["fresh_pg_masked_frac"], 1 / 3, rtol=1e-6)
    assert m["replay_pg_is_truncated_frac"] == 1.0 and m["replay_pg_num_tokens"] == 2.0
