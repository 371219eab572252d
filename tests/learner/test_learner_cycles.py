"""learner.cycles in the train step: the fresh loss on fresh rows and the replay correction
on replayed rows in one compiled step, and importance ratios / ESS per cycle from the
step's own forward pass (tiny fp32 model, the batch of tests/learner/test_learner.py).

The batch: rows of 6, 2, 1, 3 response tokens with advantages 1, -1, 0.5, -0.5 (12
tokens). Rows 1 and 2 are labelled replayed, so each micro-batch of 2 rows mixes both
cycles. Behaviour logprobs are set to log pi_theta - log 2, so every importance ratio
w = pi_theta / mu is 2 and each loss below is worked out by hand.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms.importance import per_sample_ratio_stats, ratio_metrics_by_cycle
from jaxflash.learner import cycles
from jaxflash.learner.batching import split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.scoring import make_logprob_fn
from jaxflash.learner.state import from_params
from jaxflash.learner.step import make_grad_fn, make_train_step
from jaxflash.runtime.workloads.learner_batch import learner_metrics
from jaxflash.sharding.rules import LEARNER_RULES
from tests.learner.test_learner import MODEL, _copy, _learner_config, world  # noqa: F401

CYCLE_B = np.array([0, 1, 1, 0], np.int32)  # rows 1, 2 replayed
LN2 = float(np.log(2.0))
# Fresh rows, "ppo" (eps 0.2 / 0.28) clipped against mu, r = 2: row 0 (A = 1) is
# clipped at 1.28: 6 * -1.28 = -7.68; row 3 (A = -0.5) keeps max(-A r, -A 0.8) = 1.0
# per token: 3.0. Fresh sum -4.68 whatever the replay correction.
FRESH_SUM = -4.68
# Replayed rows 1 (2 tokens, A = -1) and 2 (1 token, A = 0.5), per correction:
REPLAY_SUM = {
    # pi_old = pi_prox (ratio 1), weight min(pi_prox / mu, 1.5) = 1.5: -1.5 A per token.
    ("tis", (("tis_cap", 1.5),)): 2 * 1.5 + -0.75,
    # pi_old = pi_prox, weight pi_prox / mu = 2: -2 A per token.
    ("decoupled_ppo", ()): 2 * 2.0 + -1.0,
    # kept (d^2 = ln(2)^2 = 0.48 <= tau = 1): -(pi / mu) A = -2 A per token.
    ("m2po", (("m2_threshold", 1.0),)): 2 * 2.0 + -1.0,
    # clipped against mu like the fresh rows: row 1: 2 * 2; row 2: -1.28 * 0.5.
    ("ppo", (("clip_eps_low", 0.2), ("clip_eps_high", 0.28))): 4.0 - 0.64,
}


def _dual_config(correction, kwargs, **kw):
    against = "proximal" if correction in ("tis", "decoupled_ppo") else "behaviour"
    return _learner_config(
        kl_coef=0.0,
        entropy_coef=0.0,
        replay_loss=correction,
        replay_loss_kwargs=dict(kwargs),
        replay_ratio_against=against,
        **kw,
    )


def _labelled(batch, cycle_b=CYCLE_B, shift=LN2):
    """The batch with rows labelled by ``cycle_b`` and mu = log pi - shift on loss tokens."""
    b = _copy(batch)
    b.behaviour_logp_bt = (b.behaviour_logp_bt - shift * b.loss_mask_bt).astype(np.float32)
    b.cycle_bt = np.repeat(np.asarray(cycle_b, np.int32)[:, None], b.loss_mask_bt.shape[1], 1)
    return b


def _grad(lc, params, batch):
    fields = {
        k: jnp.asarray(v) for k, v in vars(split_micro_batches(batch, 2)).items() if v is not None
    }
    loss, grads, m = jax.jit(make_grad_fn(MODEL, lc))(params, None, fields, jnp.int32(0))
    return float(loss), grads, jax.device_get(m)


@pytest.mark.parametrize("correction, kwargs", list(REPLAY_SUM))
def test_fresh_and_replayed_rows_take_their_own_loss_by_hand(world, correction, kwargs):  # noqa: F811
    _, _, _, params, batch = world
    loss, _, m = _grad(_dual_config(correction, kwargs), params, _labelled(batch))
    np.testing.assert_allclose(loss, (FRESH_SUM + REPLAY_SUM[correction, kwargs]) / 12, rtol=1e-4)
    # The fresh rows' share does not depend on the replay correction.
    assert m["fresh_pg_num_tokens"] == 9 and m["replay_pg_num_tokens"] == 3
    np.testing.assert_allclose(m["fresh_pg_clip_frac"], 6 / 9, rtol=1e-6)  # row 0 clipped
    # Importance ratios against mu, from the step's forward pass: w = 2 on every token.
    for c in ("fresh", "replay"):
        np.testing.assert_allclose(m[f"{c}_ratio_mean"], 2.0, rtol=1e-4)
        np.testing.assert_allclose(m[f"{c}_ess_token"], 1.0, rtol=1e-5)
    # Sequence ESS (sum W)^2 / (R sum W^2), W_b = 2^(tokens of row b):
    # fresh W = [2^6, 2^3]: 72^2 / (2 * 4160) = 0.6231; replayed W = [4, 2]: 36 / 40.
    np.testing.assert_allclose(m["fresh_ess_seq"], 72**2 / (2 * 4160), rtol=1e-3)
    np.testing.assert_allclose(m["replay_ess_seq"], 0.9, rtol=1e-3)
    assert (m["fresh_ratio_tokens"], m["replay_ratio_tokens"]) == (9, 3)
    assert (m["fresh_sequences"], m["replay_sequences"]) == (2, 2)


def test_replay_correction_changes_only_the_replayed_rows(world):  # noqa: F811
    _, _, _, params, batch = world
    tis = _dual_config("tis", {"tis_cap": 1.5})
    m2po = _dual_config("m2po", {"m2_threshold": 1.0})
    # Every row fresh: the replay correction has nothing to act on, bit for bit.
    fresh_only = _labelled(batch, cycle_b=np.zeros(4, np.int32))
    (l1, g1, m1), (l2, g2, m2) = (_grad(lc, params, fresh_only) for lc in (tis, m2po))
    assert l1 == l2
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(a, b)
    # ... and equals the one-loss learner on the same rows.
    single, g_single, _ = _grad(_learner_config(kl_coef=0.0, entropy_coef=0.0), params, fresh_only)
    assert single == pytest.approx(l1, rel=1e-6)
    # Mixed rows: the fresh rows' statistics agree, the replayed rows' and the loss differ.
    (l1, _, m1), (l2, _, m2) = (_grad(lc, params, _labelled(batch)) for lc in (tis, m2po))
    for k in ("fresh_pg_clip_frac", "fresh_pg_ratio_mean", "fresh_pg_num_tokens"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-6), k
    assert "replay_pg_is_truncated_frac" in m1 and m1["replay_pg_is_truncated_frac"] == 1.0
    assert "replay_pg_m2_before" in m2
    np.testing.assert_allclose(l1 - l2, (2.25 - 3.0) / 12, rtol=1e-4)


def test_replayed_rows_use_their_stored_behaviour_logprobs(world):  # noqa: F811
    # CISPO clips the detached weight pi / mu: shifting mu on the replayed rows only
    # changes their weight (2 -> 3) and leaves the fresh rows' loss alone.
    _, _, _, params, batch = world
    lc = _dual_config("cispo", {})
    two = _labelled(batch)
    three = _labelled(batch)
    replay_rows = (three.cycle_bt == 1) & (three.loss_mask_bt > 0)
    three.behaviour_logp_bt = np.where(
        replay_rows, three.behaviour_logp_bt - np.log(1.5), three.behaviour_logp_bt
    ).astype(np.float32)
    (_, _, m2), (_, _, m3) = (_grad(lc, params, b) for b in (two, three))
    np.testing.assert_allclose(m2["replay_ratio_mean"], 2.0, rtol=1e-4)
    np.testing.assert_allclose(m3["replay_ratio_mean"], 3.0, rtol=1e-4)
    np.testing.assert_allclose(m3["replay_pg_ratio_mean"], 3.0, rtol=1e-4)  # CISPO's r = pi/mu
    assert m3["fresh_ratio_mean"] == m2["fresh_ratio_mean"]
    assert m3["fresh_pg_clip_frac"] == m2["fresh_pg_clip_frac"]


def test_ratio_stats_from_the_step_equal_an_extra_forward(world):  # noqa: F811
    # Uneven log-ratios (so ESS < 1), two micro-batches each mixing both cycles: the
    # step's combined sums give what scoring the batch again and aggregating would.
    mesh, _, state0, params, batch = world
    b = _labelled(batch, shift=0.0)
    rng = np.random.default_rng(3)
    b.behaviour_logp_bt = (
        b.behaviour_logp_bt + rng.normal(0, 0.4, b.loss_mask_bt.shape) * b.loss_mask_bt
    ).astype(np.float32)
    lc = _dual_config("m2po", {})
    _, _, m = _grad(lc, params, b)
    logp, _ = make_logprob_fn(MODEL, lc, mesh, LEARNER_RULES)(state0.params, b)
    stats = per_sample_ratio_stats(logp - b.behaviour_logp_bt, b.loss_mask_bt)
    want = ratio_metrics_by_cycle({k: np.asarray(v) for k, v in stats.items()}, CYCLE_B)
    assert 0.3 < want["fresh_ess_seq"] < 0.99 and want["replay_ess_token"] < 0.99
    for k, v in want.items():
        np.testing.assert_allclose(m[k], v, rtol=2e-4, err_msg=k)


def test_one_compile_for_every_mix_and_empty_cycles_are_dropped(world):  # noqa: F811
    mesh, _, _, params, batch = world
    lc = dataclasses.replace(_dual_config("tis", {"tis_cap": 1.5}), micro_batch_size=2)
    state = from_params(params, MODEL, lc, mesh, LEARNER_RULES)
    step = make_train_step(MODEL, lc, mesh, LEARNER_RULES)
    rows = []
    for labels in ([0, 0, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]):
        state, m = step(state, _labelled(batch, cycle_b=np.array(labels, np.int32)))
        rows.append(learner_metrics({k: float(v) for k, v in jax.device_get(m).items()}))
    assert step.trace_count == 1  # fresh / replayed mixes select with masks: one compile
    assert "replay_ratio_mean" not in rows[0] and rows[0]["replay_ratio_tokens"] == 0
    assert "fresh_ratio_mean" not in rows[2] and rows[2]["fresh_ratio_tokens"] == 0
    assert all(np.isfinite(v) for r in rows for v in r.values())
    # A step built without a replay loss refuses replayed rows instead of training
    # them with the fresh loss.
    plain = make_train_step(MODEL, _learner_config(), mesh, LEARNER_RULES)
    with pytest.raises(ValueError, match="replay_loss"):
        plain(state, _labelled(batch))


def test_policy_term_without_replay_loss_ignores_labels_and_config_refusals():
    lc = LearnerConfig(loss="ppo")
    term = cycles.make_policy_term(lc)
    logp = jnp.array([[-1.0, -2.0]])
    mu = logp - 0.1
    a = term(logp, mu, jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.zeros((1, 2), jnp.int32))
    b = term(logp, mu, jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2), jnp.int32))
    np.testing.assert_array_equal(a[0], b[0])
    with pytest.raises(ValueError, match="needs replay_ratio_against='proximal'"):
        LearnerConfig(replay_loss="tis")
    with pytest.raises(ValueError, match=r"replay_loss_kwargs has keys \['tis_cap'\]"):
        LearnerConfig(replay_loss="m2po", replay_loss_kwargs={"tis_cap": 2.0})
    with pytest.raises(ValueError, match="would be ignored without LearnerConfig.replay_loss"):
        LearnerConfig(replay_ratio_against="proximal")
