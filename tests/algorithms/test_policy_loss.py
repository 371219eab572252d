"""Policy losses against values worked out by hand; gradients w.r.t. log pi."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms import policy_loss as pl
from jaxflash.algorithms.aggregation import aggregate
from jaxflash.algorithms.kl import kl_k3
from jaxflash.algorithms.loss_hparams import HPARAM_RANGES, check_loss_hparams, loss_hparam_types
from jaxflash.algorithms.policy_loss import POLICY_LOSSES

NAN = float("nan")
LN = math.log


def _loss_and_grad(fn, logp, old, adv, mask, **kw):
    """(loss_bt, metrics, d sum(loss_bt) / d logp_bt): per token, before aggregation.

    Jitted: one compile is far cheaper on this machine than eager op-by-op dispatch.
    """

    def total(lp):
        loss, metrics = fn(lp, old, adv, mask, **kw)
        return jnp.sum(loss), (loss, metrics)

    grad, (loss, metrics) = jax.jit(jax.grad(total, has_aux=True))(jnp.asarray(logp, jnp.float32))
    return np.asarray(loss), metrics, np.asarray(grad)


def _arr(x):
    return jnp.array(x, jnp.float32)


# Four tokens with ratios r = [1.5, 0.5, 1.1, 3.0] (logp = 0, old = -log r), A = [1, -1, 1, -1].
PPO_OLD = _arr([[-LN(1.5), -LN(0.5), -LN(1.1), -LN(3.0)]])
PPO_ADV = _arr([[1.0, -1.0, 1.0, -1.0]])
ZEROS4, ONES4 = _arr([[0.0] * 4]), _arr([[1.0] * 4])


def test_vanilla_pg():
    loss, _, grad = _loss_and_grad(
        pl.vanilla_pg_loss,
        [[-1.0, -2.0]],
        _arr([[-1.0, -2.0]]),
        _arr([[2.0, -1.0]]),
        _arr([[1, 1]]),
    )
    np.testing.assert_allclose(loss, [[2.0, -2.0]])
    np.testing.assert_allclose(grad, [[-2.0, 1.0]])


def test_ppo_symmetric_clip():
    # r=1.5,A=1: clipped at 1.2 -> -1.2, no grad.  r=0.5,A=-1: clipped at 0.8 -> 0.8, no grad.
    # r=1.1,A=1: -1.1, grad -A r = -1.1.  r=3,A=-1: max(3, 1.2) = 3, grad -A r = 3.
    loss, m, grad = _loss_and_grad(pl.ppo_loss, ZEROS4, PPO_OLD, PPO_ADV, ONES4)
    np.testing.assert_allclose(loss, [[-1.2, 0.8, -1.1, 3.0]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, 0.0, -1.1, 3.0]], rtol=1e-6)
    np.testing.assert_allclose(
        [m["clip_frac_high"], m["clip_frac_low"], m["clip_frac"], m["dual_clip_frac"]],
        [0.25, 0.25, 0.5, 0.0],
    )
    np.testing.assert_allclose(
        [m["ratio_mean"], m["ratio_max"], m["ratio_min"]], [1.525, 3.0, 0.5], rtol=1e-6
    )
    assert float(m["nonfinite_count"]) == 0.0 and float(m["num_tokens"]) == 4.0


def test_ppo_dual_clip_and_clip_higher():
    # Dual clip c=2 bounds the r=3, A=-1 token at -c*A = 2 (no grad); eps_high=0.6 lets r=1.5 pass.
    loss, m, grad = _loss_and_grad(
        pl.ppo_loss, ZEROS4, PPO_OLD, PPO_ADV, ONES4, clip_eps_high=0.6, dual_clip_c=2.0
    )
    np.testing.assert_allclose(loss, [[-1.5, 0.8, -1.1, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[-1.5, 0.0, -1.1, 0.0]], rtol=1e-6)
    np.testing.assert_allclose([m["clip_frac_high"], m["dual_clip_frac"]], [0.0, 0.25])


def test_nan_behind_mask_pitfall_vector():
    """rl_pitfalls: PPO-clip token-mean loss -1.0 and KL 0, both finite."""
    logp, old, adv, mask = (
        _arr([[0.0, 0.0]]),
        _arr([[0.0, NAN]]),
        _arr([[1.0, 1.0]]),
        _arr([[1, 0]]),
    )
    loss_bt, metrics = pl.ppo_loss(logp, old, adv, mask)
    loss = aggregate(loss_bt, mask, "token-mean")
    kl = aggregate(kl_k3(logp, old, mask), mask, "token-mean")
    assert float(loss) == -1.0 and float(kl) == 0.0
    assert float(metrics["nonfinite_count"]) == 0.0


def test_decoupled_ppo():
    # r = pi/pi_prox = [1, 1, 1.5, 1]; w = pi_prox/mu = [2, 8, 0.5, 1]; A = [1, 1, 1, -1]; cap 5.
    old = _arr([[0.0, 0.0, -LN(1.5), 0.0]])
    behaviour = old - _arr([[LN(2.0), LN(8.0), LN(0.5), 0.0]])
    adv = _arr([[1.0, 1.0, 1.0, -1.0]])
    fn = functools.partial(pl.decoupled_ppo_loss, behaviour_logp_bt=behaviour)
    loss, m, grad = _loss_and_grad(fn, ZEROS4, old, adv, ONES4, behaviour_cap=5.0)
    # -2*1; masked (w=8 > 5); 0.5 * -1.2 (clipped); 1 * 1.
    np.testing.assert_allclose(loss, [[-2.0, 0.0, -0.6, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[-2.0, 0.0, 0.0, 1.0]], rtol=1e-6)
    assert float(m["masked_frac"]) == 0.25
    loss, _, grad = _loss_and_grad(fn, ZEROS4, old, adv, ONES4)  # no cap: w=8 kept
    np.testing.assert_allclose(loss[0, 1], -8.0, rtol=1e-6)
    np.testing.assert_allclose(grad[0, 1], -8.0, rtol=1e-6)


def test_tis_truncates_instead_of_masking():
    # r = 1 everywhere, A = 1; w = [3, 0.5] truncated at C=2 -> [2, 0.5].
    old = _arr([[0.0, 0.0]])
    behaviour = _arr([[-LN(3.0), LN(2.0)]])
    fn = functools.partial(pl.tis_loss, behaviour_logp_bt=behaviour)
    loss, m, grad = _loss_and_grad(fn, [[0.0, 0.0]], old, _arr([[1.0, 1.0]]), _arr([[1, 1]]))
    np.testing.assert_allclose(loss, [[-2.0, -0.5]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[-2.0, -0.5]], rtol=1e-6)
    assert float(m["is_truncated_frac"]) == 0.5


def test_cispo_weights_pitfall_vector():
    """rl_pitfalls: bounds [0, 5]: r=0.5 -> 0.5, r=5.5 -> 5.0, r=7 -> grad -5*A (not 0)."""
    logp = _arr([[-1.0, -1.0, -1.0]])
    old = logp - _arr([[LN(0.5), LN(5.5), LN(7.0)]])
    adv = _arr([[1.0, 1.0, 2.0]])
    loss, m, grad = _loss_and_grad(
        pl.cispo_loss, logp, old, adv, _arr([[1, 1, 1]]), clip_eps_low=1.0, clip_eps_high=4.0
    )
    np.testing.assert_allclose(loss, [[0.5, 5.0, 10.0]], rtol=1e-6)  # -w * A * (-1)
    np.testing.assert_allclose(grad, [[-0.5, -5.0, -10.0]], rtol=1e-6)  # -w * A
    np.testing.assert_allclose(m["clip_frac_high"], 2 / 3, rtol=1e-6)


def test_cispo_unified_mask():
    # r = [0.5, 0.5, 5.5, 1.1], A = [1, -1, 1, 1]; mask eps 0.2 drops (A<0, r<0.8), (A>0, r>1.2).
    logp = _arr([[-1.0] * 4])
    old = logp - _arr([[LN(0.5), LN(0.5), LN(5.5), LN(1.1)]])
    adv = _arr([[1.0, -1.0, 1.0, 1.0]])
    loss, m, grad = _loss_and_grad(pl.cispo_loss, logp, old, adv, ONES4, unified_mask=True)
    np.testing.assert_allclose(loss, [[0.5, 0.0, 0.0, 1.1]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.5, 0.0, 0.0, -1.1]], rtol=1e-6)
    assert float(m["masked_frac"]) == 0.5


def test_topr_truncates_negative_sequences_only():
    # Row 0: A=+1, rho=4 -> weight 1.  Row 1: A=-1, rho=0.5 -> 0.5.  Row 2: A=-1, rho=4 -> 1.
    logp = _arr([[-1.0, -1.0]] * 3)
    delta = _arr([[LN(2.0), LN(2.0)], [LN(0.5), 0.0], [LN(2.0), LN(2.0)]])
    adv = _arr([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]])
    loss, m, grad = _loss_and_grad(pl.topr_loss, logp, logp - delta, adv, jnp.ones((3, 2)))
    np.testing.assert_allclose(loss, [[1.0, 1.0], [-0.5, -0.5], [-1.0, -1.0]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[-1.0, -1.0], [0.5, 0.5], [1.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 3, rtol=1e-6)


def test_gspo_sequence_ratio():
    # Both rows: log-ratios [ln 2, 0] -> s = exp(ln2 / 2) = sqrt(2) = 1.4142136.
    logp = _arr([[0.0, 0.0], [0.0, 0.0]])
    old = -_arr([[LN(2.0), 0.0], [LN(2.0), 0.0]])
    adv = _arr([[1.0, 1.0], [-1.0, -1.0]])
    mask = jnp.ones((2, 2))
    loss, m, grad = _loss_and_grad(
        pl.gspo_loss, logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2
    )
    # Row 0 (A>0) clipped at 1.2, no grad; row 1 (A<0) unclipped: s, grad -A*s.
    np.testing.assert_allclose(loss, [[-1.2, -1.2], [1.4142136, 1.4142136]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, 0.0], [1.4142136, 1.4142136]], rtol=1e-6)
    np.testing.assert_allclose(m["ratio_mean"], 1.4142136, rtol=1e-6)
    loss, _, grad = _loss_and_grad(
        pl.gspo_loss, logp, old, adv, mask, clip_eps_low=0.5, clip_eps_high=0.5
    )
    np.testing.assert_allclose(loss[0], [-1.4142136, -1.4142136], rtol=1e-6)
    np.testing.assert_allclose(grad[0], [-1.4142136, -1.4142136], rtol=1e-6)


def test_gspo_token_form_matches_sequence_objective():
    """seq-mean-token-mean of the per-token loss == GSPO's sequence objective, grads too."""
    rng = np.random.default_rng(1)
    logp = _arr(-rng.random((4, 5)))
    old = logp + _arr(rng.normal(scale=0.3, size=(4, 5)))
    adv = jnp.repeat(_arr(rng.normal(size=(4, 1))), 5, axis=1)
    mask = _arr(np.arange(5)[None, :] < np.array([[5], [3], [1], [4]]))
    eps = 0.1

    def token_form(lp):
        return aggregate(
            pl.gspo_loss(lp, old, adv, mask, clip_eps_low=eps, clip_eps_high=eps)[0],
            mask,
            "seq-mean-token-mean",
        )

    def sequence_form(lp):
        n = jnp.sum(mask, axis=1)
        s = jnp.exp(jnp.sum(jnp.where(mask > 0, lp - old, 0.0), axis=1) / n)
        a = adv[:, 0]
        return jnp.mean(-jnp.minimum(s * a, jnp.clip(s, 1 - eps, 1 + eps) * a))

    tok_value, tok_grad = jax.jit(jax.value_and_grad(token_form))(logp)
    seq_value, seq_grad = jax.jit(jax.value_and_grad(sequence_form))(logp)
    np.testing.assert_allclose(tok_value, seq_value, rtol=1e-5)
    np.testing.assert_allclose(tok_grad, seq_grad, rtol=1e-5, atol=1e-7)


def test_kimi_k15_sequence_and_token_penalty():
    # delta = [0.5, 0.5] (third token masked), D = 1, n = 2, tau = 0.1.
    logp = _arr([[-1.0, -2.0, NAN]])
    old = _arr([[-1.5, -2.5, NAN]])
    adv, mask = _arr([[1.0, 1.0, 1.0]]), _arr([[1, 1, 0]])
    loss, _, grad = _loss_and_grad(pl.kimi_k15_loss, logp, old, adv, mask, tau=0.1)
    # -A logp + (tau/2) D^2 / n = [1 + 0.025, 2 + 0.025]; grad -A + tau D = -0.9.
    np.testing.assert_allclose(loss, [[1.025, 2.025, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.9, -0.9, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, mask, "seq-mean-token-sum"), 3.05, rtol=1e-6)
    loss, _, grad = _loss_and_grad(
        pl.kimi_k15_loss, logp, old, adv, mask, tau=0.1, sequence_level=False
    )
    # Per token: (tau/2) 0.25 = 0.0125; grad -1 + tau * 0.5 = -0.95.
    np.testing.assert_allclose(loss, [[1.0125, 2.0125, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.95, -0.95, 0.0]], rtol=1e-6)


VARIANTS = [
    ("vanilla_pg", {}),
    ("ppo", {}),
    ("ppo", {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": 3.0}),
    ("decoupled_ppo", {"behaviour_cap": 5.0}),
    ("tis", {"tis_cap": 2.0}),
    ("cispo", {}),
    ("cispo", {"unified_mask": True}),
    ("topr", {}),
    ("gspo", {}),
    ("kimi_k15", {}),
    ("kimi_k15", {"sequence_level": False}),
    ("m2po", {}),
    ("m2po", {"m2_threshold": 0.0}),
    ("seq_tis", {"tis_cap": 2.0}),
    ("token_mis", {}),
    ("token_mis", {"mis_upper": 3.0, "mis_lower": 0.2}),
    ("seq_mis", {}),
    ("geo_mis", {}),
    ("icepop", {}),
]


def test_variants_cover_registry():
    assert {name for name, _ in VARIANTS} == set(POLICY_LOSSES)


@pytest.mark.parametrize(("name", "hparams"), VARIANTS)
def test_on_policy_gradient_is_minus_advantage(name, hparams):
    """All ratios 1 -> d sum(loss_bt) / d logp_bt = -A on every valid token, 0 elsewhere."""
    rng = np.random.default_rng(0)
    logp = _arr(-rng.random((3, 6)) * 3)
    adv = _arr(rng.normal(size=(3, 6)))
    mask = _arr(rng.random((3, 6)) < 0.7)
    fn = pl.get_policy_loss(name, **hparams)
    grad_fn = jax.jit(
        jax.grad(lambda lp: jnp.sum(fn(lp, logp, adv, mask, behaviour_logp_bt=logp)[0]))
    )
    np.testing.assert_allclose(grad_fn(logp), -adv * mask, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("name", "hparams"), VARIANTS)
def test_nan_behind_mask_never_leaks(name, hparams):
    logp, old, adv = _arr([[0.0, NAN]]), _arr([[0.0, NAN]]), _arr([[1.0, NAN]])
    mask = _arr([[1, 0]])
    fn = pl.get_policy_loss(name, **hparams)

    def total(lp):
        loss, metrics = fn(lp, old, adv, mask, behaviour_logp_bt=_arr([[0.0, NAN]]))
        return aggregate(loss, mask, "token-mean"), metrics

    (value, metrics), grad = jax.jit(jax.value_and_grad(total, has_aux=True))(logp)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    assert float(metrics["nonfinite_count"]) == 0.0


@pytest.mark.parametrize(("name", "hparams"), VARIANTS)
def test_nan_at_valid_position_is_reported(name, hparams):
    fn = pl.get_policy_loss(name, **hparams)
    _, metrics = jax.jit(fn)(
        _arr([[0.0, 0.0]]), _arr([[0.0, NAN]]), _arr([[1.0, 1.0]]), _arr([[1, 1]])
    )
    assert float(metrics["nonfinite_count"]) == 1.0


def test_extreme_ratio_stays_finite():
    old = _arr([[-100.0, -100.0]])  # log-ratio 100: clamped to 20 before exp
    loss, _, grad = _loss_and_grad(
        pl.ppo_loss, [[0.0, 0.0]], old, _arr([[1.0, -1.0]]), _arr([[1, 1]])
    )
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(loss[0, 0], -1.2, rtol=1e-6)


def test_bad_inputs_are_named():
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="adv_bt"):
        pl.ppo_loss(z, z, jnp.zeros((1, 3)), z)
    with pytest.raises(ValueError, match="logp_bt"):
        pl.ppo_loss(jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), jnp.zeros(2))
    with pytest.raises(ValueError, match="clip_eps_low"):
        pl.ppo_loss(z, z, z, z, clip_eps_low=-0.1)
    with pytest.raises(ValueError, match="dual_clip_c"):
        pl.ppo_loss(z, z, z, z, dual_clip_c=0.5)
    with pytest.raises(ValueError, match="tis_cap"):
        pl.tis_loss(z, z, z, z, tis_cap=0.0)
    with pytest.raises(ValueError, match="cispo"):
        pl.get_policy_loss("grpo_magic")


# ------------------------------------------------- config-time hyper-parameter checks


_WRONG = {"bool": ("yes", 1, None), "float": ("abc", True, float("nan"))}


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_every_hyper_parameter_of_every_loss_is_checked_before_tracing(loss):
    """Each keyword hyper-parameter of each loss refuses a wrong type (and, for numbers,
    a value out of its range) in ``check_loss_hparams`` -- at config time, where a bad
    ``tis_cap`` used to surface only as a JAX traceback at the first train step."""
    for name, hint in loss_hparam_types(loss).items():
        kind = "bool" if hint is bool else "float"
        bad_values = list(_WRONG[kind])
        if kind == "float":
            assert name in HPARAM_RANGES, f"{loss}.{name} has no range rule"
            bad_values.append(-1.0)  # below every range
        for bad in bad_values:
            with pytest.raises(
                ValueError, match=rf"^where\.{name} must be .*got {re.escape(repr(bad))}"
            ):
                check_loss_hparams(loss, {name: bad}, where="where")
        check_loss_hparams(loss, {}, where="where")  # the defaults pass


def test_loss_hparams_accept_ints_and_none_where_annotated():
    check_loss_hparams("tis", {"tis_cap": 2, "dual_clip_c": None}, where="w")
    check_loss_hparams("cispo", {"unified_mask": True, "mask_eps_low": 0}, where="w")
    with pytest.raises(ValueError, match=r"w has keys \['cap'\] that loss 'tis' does not take"):
        check_loss_hparams("tis", {"cap": 2.0}, where="w")
