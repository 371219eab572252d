"""learner: config, schedule, batch packing, train step (compile-once, micro-batch
invariance, parity, learning pulse) on a tiny fp32 model, fsdp=4 x tensor=2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.learner.batching import bucket_length, pack_batch, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.optimizer import make_optimizer, make_schedule
from jaxflash.learner.scoring import make_logprob_fn
from jaxflash.learner.state import create_train_state, from_params
from jaxflash.learner.step import make_grad_fn, make_train_step
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.decoder.transformer import forward, unembed
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.types import FinishReason, Sample, SamplingParams, TrainBatch

# ---------------------------------------------------------------- config / schedule


def test_config_validates_and_names_field():
    with pytest.raises(ValueError, match="LearnerConfig.loss must be one of"):
        LearnerConfig(loss="ppo_typo")
    with pytest.raises(ValueError, match="LearnerConfig.aggregation must be one of"):
        LearnerConfig(aggregation="mean")
    with pytest.raises(ValueError, match="total_steps must exceed warmup_steps"):
        LearnerConfig(schedule="cosine", warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="needs ratio_against='proximal'"):
        LearnerConfig(loss="decoupled_ppo")
    with pytest.raises(ValueError, match=r"loss_kwargs has keys \['eps_low'\] that loss 'ppo'"):
        LearnerConfig(loss="ppo", loss_kwargs={"eps_low": 0.2})
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        LearnerConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="aggregation_max_tokens"):
        LearnerConfig(aggregation="seq-mean-token-sum-norm")


def test_optimizer_is_built_once_per_config():
    """The state's init, its shardings and the train step share one optimizer."""
    a = make_optimizer(LearnerConfig(lr=1e-3, warmup_steps=4))
    assert make_optimizer(LearnerConfig(lr=1e-3, warmup_steps=4)) is a
    assert make_optimizer(LearnerConfig(lr=2e-3, warmup_steps=4)) is not a


def test_schedule_values_by_hand():
    warm = make_schedule(LearnerConfig(lr=1.0, warmup_steps=4))
    assert [float(warm(s)) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = make_schedule(LearnerConfig(lr=1.0, schedule="cosine", total_steps=10))
    # 0.5 * (1 + cos(pi * s / 10)): s=0 -> 1, s=5 -> 0.5, s=10 -> 0.
    np.testing.assert_allclose([float(cos(s)) for s in (0, 5, 10)], [1.0, 0.5, 0.0], atol=1e-7)
    floor = make_schedule(
        LearnerConfig(lr=2.0, schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    )
    # Warmup 1.0, 2.0; then 2 * (0.1 + 0.9 * 0.5 * (1 + cos(pi * 5/10))) = 1.1 at step 7.
    np.testing.assert_allclose([float(floor(s)) for s in (0, 1, 2, 7)], [1.0, 2.0, 2.0, 1.1])


# ---------------------------------------------------------------- batching


def _sample(prompt, response, logps, versions=None, pid=0):
    return Sample(
        prompt_id=pid,
        sample_index=0,
        prompt_tokens=np.asarray(prompt, np.int32),
        response_tokens=np.asarray(response, np.int32),
        behaviour_logprobs=np.asarray(logps, np.float32),
        token_versions=np.asarray(versions if versions is not None else [0] * len(response)),
        start_version=0,
        finish_reason=FinishReason.EOS,
        reward=1.0,
    )


def test_pack_batch_layout_by_hand():
    s0 = _sample([5, 6, 7], [8, 9], [-0.5, -0.25], [3, 4])
    s1 = _sample([11], [12, 13, 14], [-1.0, -2.0, -3.0], [4, 4, 4], pid=1)
    b = pack_batch([s0, s1], [2.0, -1.0], pad_id=0, length_multiple=8)
    np.testing.assert_array_equal(
        b.input_ids_bt, [[5, 6, 7, 8, 9, 0, 0, 0], [11, 12, 13, 14, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        b.target_ids_bt, [[6, 7, 8, 9, 0, 0, 0, 0], [12, 13, 14, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        b.loss_mask_bt, [[0, 0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(b.advantages_bt[0], [0, 0, 2, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.advantages_bt[1], [-1, -1, -1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.behaviour_logp_bt[0], [0, 0, -0.5, -0.25, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.token_versions_bt[0], [-1, -1, 3, 4, -1, -1, -1, -1])
    np.testing.assert_array_equal(b.positions_bt[1], np.arange(8))
    assert b.input_ids_bt.dtype == np.int32 and b.loss_mask_bt.dtype == np.float32

    mb = split_micro_batches(pack_batch([s0, s1, s0], [1.0, 1.0, 1.0], length_multiple=8), 2)
    assert mb.input_ids_bt.shape == (2, 2, 8)
    np.testing.assert_array_equal(mb.loss_mask_bt[1, 1], np.zeros(8))  # padding row
    np.testing.assert_array_equal(mb.token_versions_bt[1, 1], -np.ones(8))


def test_pack_batch_applies_response_mask():
    """Multi-turn samples: tokens with response_mask 0 (env observations) stay in the
    input as context but carry no loss, advantage, behaviour logprob or version."""
    import dataclasses

    s = _sample([5, 6], [7, 8, 9, 10], [-0.5, -0.25, -0.125, -1.0], [3, 3, 4, 4])
    s = dataclasses.replace(s, response_mask=np.asarray([1, 0, 0, 1], np.float32))
    b = pack_batch([s], [2.0], length_multiple=8)
    np.testing.assert_array_equal(b.input_ids_bt[0], [5, 6, 7, 8, 9, 10, 0, 0])
    np.testing.assert_array_equal(b.loss_mask_bt[0], [0, 1, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(b.advantages_bt[0], [0, 2, 0, 0, 2, 0, 0, 0])
    np.testing.assert_array_equal(b.behaviour_logp_bt[0], [0, -0.5, 0, 0, -1.0, 0, 0, 0])
    np.testing.assert_array_equal(b.token_versions_bt[0], [-1, 3, -1, -1, 4, -1, -1, -1])
    for bad in ([1, 0, 1], [1, 0.5, 1, 1]):
        with pytest.raises(ValueError, match=r"prompt_id=0.*response_mask must be 0/1 of length 4"):
            pack_batch([dataclasses.replace(s, response_mask=np.asarray(bad))], [1.0])


def test_bucket_and_pack_errors():
    assert [bucket_length(n, multiple=32) for n in (1, 32, 33)] == [32, 32, 64]
    assert [bucket_length(n, multiple=16, power_of_two=True) for n in (3, 17, 64, 65)] == [
        16,
        32,
        64,
        128,
    ]
    good = _sample([1, 2], [3], [-1.0])
    with pytest.raises(ValueError, match="advantages must have shape"):
        pack_batch([good], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        pack_batch([good], [np.nan])
    with pytest.raises(ValueError, match=r"prompt_id=7.*2 behaviour_logprobs for 1 response"):
        pack_batch([_sample([1], [2], [-1.0, -2.0], [0], pid=7)], [1.0])
    with pytest.raises(ValueError, match="3 tokens > max_len=2"):
        pack_batch([good], [1.0], max_len=2)


# ---------------------------------------------------------------- train step

MODEL = get_preset("tiny")  # fp32, 2 layers, vocab 512
SAMPLING = SamplingParams(temperature=0.7)
PROMPT_LENS, RESP_LENS = (3, 5, 4, 6), (6, 2, 1, 3)  # micro-batches of 8 and 4 tokens
ADVANTAGES = (1.0, -1.0, 0.5, -0.5)


def _learner_config(**kw):
    base = dict(
        lr=1e-2,
        grad_clip_norm=1.0,
        micro_batch_size=2,
        loss="ppo",
        loss_kwargs={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        kl_coef=0.01,
        entropy_coef=0.001,
        sampling=SAMPLING,
        logprob_chunk=8,
    )
    return LearnerConfig(**{**base, **kw})


def _reference_logprobs(params, prompt, response):
    """log q(response tokens) for one unpadded sequence, outside the learner code."""
    full = np.concatenate([prompt, response])
    ids = jnp.asarray(full[:-1])[None]
    h, _ = forward(params, MODEL, ids, jnp.arange(ids.shape[1])[None])
    logp, _ = target_logprobs(
        h, unembed(params, MODEL), jnp.asarray(full[1:])[None], temperature=0.7, chunk=4
    )
    return np.asarray(logp[0, len(prompt) - 1 :])


@pytest.fixture(scope="module")
def world():
    mesh = make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    lc = _learner_config()
    state = create_train_state(MODEL, lc, mesh, LEARNER_RULES, seed=0)
    host_params = jax.device_get(state.params)
    rng = np.random.default_rng(0)
    samples = []
    for i, (P, R) in enumerate(zip(PROMPT_LENS, RESP_LENS, strict=True)):
        prompt = rng.integers(3, MODEL.vocab_size, P).astype(np.int32)
        resp = rng.integers(3, MODEL.vocab_size, R).astype(np.int32)
        logps = _reference_logprobs(host_params, prompt, resp)
        samples.append(_sample(prompt, resp, logps, [0] * R, pid=i))
    batch = pack_batch(samples, ADVANTAGES, length_multiple=16)
    return mesh, lc, state, host_params, batch


def _copy(batch):
    return TrainBatch(**{k: None if v is None else np.array(v) for k, v in vars(batch).items()})


def test_state_is_born_sharded(world):
    mesh, lc, state, _, _ = world
    w = state.params["layers"]["w_gate_ldf"]  # [L, D, F]: embed->fsdp, mlp->tensor
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    mu = state.opt_state[1][0].mu["layers"]["w_gate_ldf"]
    assert mu.sharding == w.sharding
    assert state.ref_params is not None and int(state.step) == 0


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_micro_batch_split_gives_same_loss_and_grads(world):
    mesh, lc, state, host_params, batch = world
    grad_fn = jax.jit(make_grad_fn(MODEL, lc))
    whole = split_micro_batches(batch, 4)  # M=1: 4 sequences, 12 tokens
    halves = split_micro_batches(batch, 2)  # M=2: 8 and 4 tokens
    assert whole.loss_mask_bt.shape == (1, 4, 16) and halves.loss_mask_bt.shape == (2, 2, 16)
    assert halves.loss_mask_bt[0].sum() == 8 and halves.loss_mask_bt[1].sum() == 4
    # Perturb the behaviour logprobs so ratios differ from 1 and clipping happens.
    for b in (whole, halves):
        b.behaviour_logp_bt = b.behaviour_logp_bt + 0.3 * b.loss_mask_bt * np.sign(
            np.sin(np.arange(b.loss_mask_bt.size).reshape(b.loss_mask_bt.shape))
        )
    version = jnp.int32(0)
    out = []
    for b in (whole, halves):
        fields = {k: jnp.asarray(v) for k, v in vars(b).items() if v is not None}
        out.append(grad_fn(host_params, host_params, fields, version))
    (loss1, g1, m1), (loss2, g2, m2) = out
    assert float(m1["clip_frac"]) > 0  # the clipped branch is exercised
    np.testing.assert_allclose(float(loss1), float(loss2), rtol=1e-6)
    # rtol 1e-6 in norm, per parameter: float32 matmuls over 2 vs 4 rows sum in a
    # different order, so single elements that nearly cancel differ relatively
    # more (elementwise rtol is not meaningful there); a normaliser bug (e.g. a
    # per-micro-batch mean) gives differences of order 1.
    for path, a in jax.tree_util.tree_flatten_with_path(g1)[0]:
        a = np.asarray(a)
        b = np.asarray(_get(g2, path))
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-6, (jax.tree_util.keystr(path), rel)
    for k in ("tokens", "sequences", "entropy", "clip_frac", "ratio_max", "ratio_min"):
        np.testing.assert_allclose(float(m1[k]), float(m2[k]), rtol=1e-6, err_msg=k)
    # k3 KL of the policy to itself (ref = params) is float rounding, 0 in exact
    # arithmetic: measured 9.5e-15 (1 micro-batch) vs 1.9e-14 (2), so a bound, not rtol.
    np.testing.assert_allclose(float(m1["kl"]), float(m2["kl"]), atol=1e-12, err_msg="kl")
    assert (float(m1["tokens"]), float(m1["sequences"])) == (12.0, 4.0)


def test_train_step_compiles_once_parity_and_pulse(world):
    mesh, lc, state0, host_params, batch = world
    state = from_params(host_params, MODEL, lc, mesh, LEARNER_RULES)
    train_step = make_train_step(MODEL, lc, mesh, LEARNER_RULES)
    history = []
    for _ in range(3):
        state, metrics = train_step(state, _copy(batch))
        history.append(jax.device_get(metrics))
    assert train_step.trace_count == 1  # traced (and compiled) once for 3 steps
    first = history[0]
    # (d) parity: identical params, behaviour logprobs from target_logprobs of the
    # unpadded sequences, so the learner's rescoring of the padded batch matches.
    assert first["logprob_gap_max"] < 1e-5
    assert first["logprob_gap_max_current"] < 1e-5 and first["current_tokens"] == 12.0
    assert abs(first["ratio_max"] - 1.0) < 1e-4 and abs(first["ratio_min"] - 1.0) < 1e-4
    assert first["kl"] == 0.0  # reference == params at step 0
    assert first["tokens"] == 12.0 and first["clip_frac"] == 0.0
    assert np.isfinite(first["grad_norm"]) and first["grad_norm"] > 0
    assert first["lr"] == np.float32(1e-2)
    # After an update the learner's logprobs drift from the behaviour ones.
    assert history[1]["logprob_gap_max"] > 1e-4 and history[1]["kl"] > 0
    # The gap splits by the version that sampled each token (all version 0 here).
    assert first["logprob_gap_max_off_policy"] == 0.0
    assert history[1]["logprob_gap_max_current"] == 0.0 and history[1]["current_tokens"] == 0
    assert history[1]["logprob_gap_max_off_policy"] == history[1]["logprob_gap_max"]
    assert int(state.step) == 3
    # make_logprob_fn (the replay cycle's scorer) rescores the padded batch like the
    # step: equal to the unpadded reference logprobs on every loss token.
    logp_fn = make_logprob_fn(MODEL, lc, mesh, LEARNER_RULES)
    logp0, ent0 = logp_fn(state0.params, batch)
    assert logp0.shape == ent0.shape == batch.loss_mask_bt.shape
    on = batch.loss_mask_bt > 0
    np.testing.assert_allclose(logp0[on], batch.behaviour_logp_bt[on], atol=1e-5)
    assert np.all(ent0[on] > 0)

    # (c) learning has a pulse: tokens with A > 0 gained probability, A < 0 lost it.
    def rescore(params):
        ids, pos = jnp.asarray(batch.input_ids_bt), jnp.asarray(batch.positions_bt)
        h, _ = forward(params, MODEL, ids, pos)
        logp, _ = target_logprobs(
            h, unembed(params, MODEL), jnp.asarray(batch.target_ids_bt), temperature=0.7, chunk=8
        )
        return np.asarray(logp)

    mask = batch.loss_mask_bt > 0
    delta = rescore(jax.device_get(state.params)) - rescore(host_params)
    adv = batch.advantages_bt
    assert delta[mask & (adv > 0)].mean() > 0.1, delta[mask]
    assert delta[mask & (adv < 0)].mean() < -0.1, delta[mask]


def test_proximal_ratio_weights_by_behaviour_ratio(world):
    # decoupled PPO with pi_old = proximal = current params: r = 1 and the loss is
    # -w * A with w = pi_prox / mu. Behaviour logprobs set to log pi - log 2 give
    # w = 2 on every token, so the token-mean loss is -2 * mean(A) with
    # mean(A) = (6*1 + 2*(-1) + 1*0.5 + 3*(-0.5)) / 12 = 0.25  ->  loss = -0.5.
    _, _, _, host_params, batch = world
    lc = _learner_config(
        loss="decoupled_ppo", ratio_against="proximal", kl_coef=0.0, entropy_coef=0.0
    )
    b = split_micro_batches(batch, 2)
    b.behaviour_logp_bt = (b.behaviour_logp_bt - np.log(2.0) * b.loss_mask_bt).astype(np.float32)
    fields = {k: jnp.asarray(v) for k, v in vars(b).items() if v is not None}
    loss, grads, m = jax.jit(make_grad_fn(MODEL, lc))(host_params, None, fields, jnp.int32(0))
    np.testing.assert_allclose(float(loss), -0.5, rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(m["logprob_gap_max"]), np.log(2.0), rtol=1e-5)
    assert float(m["kl"]) == 0.0 and float(m["clip_frac"]) == 0.0


@pytest.mark.slow
def test_bfloat16_params_train_step_keeps_dtypes_and_compiles_once(world):
    _, _, _, _, batch = world
    mc = get_preset("tiny", n_layers=1, param_dtype="bfloat16", compute_dtype="bfloat16")
    mesh = make_mesh(jax.devices()[:2], {"fsdp": 2})
    lc = _learner_config(kl_coef=0.0, entropy_coef=0.0)
    state = create_train_state(mc, lc, mesh, LEARNER_RULES, seed=0)
    dtypes0 = [x.dtype for x in jax.tree.leaves(state)]
    train_step = make_train_step(mc, lc, mesh, LEARNER_RULES)
    for _ in range(2):
        state, metrics = train_step(state, _copy(batch))
    assert train_step.trace_count == 1
    assert [x.dtype for x in jax.tree.leaves(state)] == dtypes0
    assert state.params["embed_vd"].dtype == jnp.bfloat16
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
