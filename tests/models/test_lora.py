"""LoRA / QLoRA (models.adapters.lora): config, exact zero-init, quantized base, the learner's
trainable tree (adapters only), compile-once and micro-batch invariance, engine vs
learner behaviour logprobs with adapters (fp32 and int8 base), adapter-only publish."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.slot_loop import run_requests
from jaxflash.learner.batching import pack_batch, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.state import abstract_train_state, create_train_state
from jaxflash.learner.step import make_grad_fn, make_train_step
from jaxflash.models.adapters import lora
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.decoder.transformer import forward, init_params, unembed
from jaxflash.runtime.model_setup import build_engine
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.sync.publish import AdapterPublisher
from jaxflash.types import FinishReason, GenerationRequest, Sample, SamplingParams, TrainBatch

MODEL = get_preset("tiny")  # V 512, D 64, L 2, 4/2 heads of 16, F 128
ALL = ("q", "k", "v", "o", "gate", "up", "down")
NO_EOS = -1


def _lora(**kw):
    return lora.LoraConfig(**{"rank": 4, "alpha": 8.0, "targets": ALL, **kw})


def _ids(b=2, t=12, seed=0):
    ids = np.random.default_rng(seed).integers(3, MODEL.vocab_size, (b, t)).astype(np.int32)
    return jnp.asarray(ids), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@jax.jit
def _logits(params, ids, pos):
    h, _ = forward(params, MODEL, ids, pos)
    return h @ unembed(params, MODEL).astype(jnp.float32)


def _nonzero(adapters, seed=1, scale=0.05):
    """Adapters with B != 0 (a trained state), deterministic."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [x + scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    )


# ---------------------------------------------------------------- config / model


def test_config_validates_and_maps_from_the_experiment_dict():
    with pytest.raises(ValueError, match="lora.rank must be an int >= 1"):
        lora.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="lora.targets must be distinct names"):
        lora.LoraConfig(rank=4, targets=("q", "qq"))
    with pytest.raises(ValueError, match="only 0.0 is supported"):
        lora.LoraConfig(rank=4, dropout=0.1)
    with pytest.raises(ValueError, match="lora.base_dtype must be one of"):
        lora.LoraConfig(rank=4, base_dtype="nf4")
    with pytest.raises(ValueError, match=r"unknown keys \['rnak'\]"):
        lora.LoraConfig.from_mapping({"rnak": 4})
    assert lora.LoraConfig.from_mapping({"rank": 0, "alpha": 32.0}) is None  # off, defaults
    with pytest.raises(ValueError, match="alpha is set but learner.lora.rank is 0"):
        lora.LoraConfig.from_mapping({"rank": 0, "alpha": 16.0})  # would be ignored
    c = lora.LoraConfig.from_mapping({"rank": 16, "targets": "q, v,lm_head"})
    assert c.targets == ("q", "v", "lm_head") and c.scale == 2.0
    from jaxflash.runtime.config.experiment import ExperimentConfig

    exp = ExperimentConfig.from_config_dict(
        {"learner": {"lora": {"rank": 16, "base_dtype": "int8"}}, "data": {"eval_size": 0}}
    )
    assert exp.learner.lora == lora.LoraConfig(rank=16, base_dtype="int8")
    procs = ExperimentConfig.from_config_dict(  # generation programs pull adapters only
        {
            "learner": {"lora": {"rank": 4}},
            "data": {"eval_size": 0},
            "mesh": {"colocated": False, "generation_processes": True, "num_cpu_devices": 2},
        }
    )
    assert procs.learner.lora.rank == 4 and procs.mesh.generation_processes


@pytest.mark.parametrize(
    "base_dtype",
    ["float32", *(pytest.param(d, marks=pytest.mark.slow) for d in ("bfloat16", "int8", "int4"))],
)
def test_zero_adapters_reproduce_the_base_logits_exactly(base_dtype):
    lc = _lora(base_dtype=base_dtype, targets=(*ALL, "lm_head"), group_size=16)
    params = init_params(MODEL, 0)
    base = lora.quantize_base(params, lc)
    adapters = lora.init_adapters(MODEL, lc, jax.random.PRNGKey(3))
    assert all(float(jnp.abs(a.b).max()) == 0.0 for a in jax.tree.leaves(
        adapters, is_leaf=lambda x: isinstance(x, lora.Adapter)
    ))  # fmt: skip
    ids, pos = _ids()
    want, got = _logits(base, ids, pos), _logits(lora.merge(base, adapters), ids, pos)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The stored base is the model up to its rounding: int8 per channel, int4 per 16.
    err = float(jnp.max(jnp.abs(want - _logits(params, ids, pos))))
    assert err < {"float32": 1e-7, "bfloat16": 2e-2, "int8": 2e-2, "int4": 2e-1}[base_dtype], err
    # Trained adapters change the logits (the hook is live on every target).
    moved = _logits(lora.merge(base, _nonzero(adapters)), ids, pos)
    assert float(jnp.max(jnp.abs(moved - want))) > 1e-3


def test_quantize_round_trip_by_hand():
    w = jnp.asarray([[[1.0, -2.0], [0.5, 4.0]]])  # [L=1, in=2, out=2]
    q8 = lora.quantize(w, n_out=1, n_lead=1, bits=8, group_size=0)
    # Per output channel: scales max|w| / 127 = 1/127 and 4/127.
    np.testing.assert_allclose(np.asarray(q8.scale), [[[1 / 127, 4 / 127]]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q8.q), [[[127, -64], [64, 127]]])
    q4 = lora.quantize(w, n_out=1, n_lead=1, bits=4, group_size=1)  # a scale per weight
    np.testing.assert_allclose(np.asarray(lora.dequantize(q4)), np.asarray(w), rtol=1e-6)
    assert q4.q.dtype == jnp.int4 and q8.q.dtype == jnp.int8
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        lora.quantize(w, n_out=1, n_lead=1, bits=4, group_size=3)


# ---------------------------------------------------------------- learner

SAMPLING = SamplingParams(temperature=0.7, max_new_tokens=16)


def _learner_config(lc, **kw):
    base = dict(
        lr=1e-2,
        micro_batch_size=2,
        loss="ppo",
        loss_kwargs={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        kl_coef=0.01,
        sampling=SAMPLING,
        logprob_chunk=8,
        lora=lc,
    )
    return LearnerConfig(**{**base, **kw})


def _seq_logprobs(params, pairs, temperature):
    """log q(response tokens) of each (prompt, response), scored in one padded batch
    outside the learner code (right padding: causal attention never sees it)."""
    t = max(len(p) + len(r) for p, r in pairs)
    ids = np.zeros((len(pairs), t), np.int32)
    for i, (p, r) in enumerate(pairs):
        ids[i, : len(p) + len(r)] = np.concatenate([p, r])
    pos = np.broadcast_to(np.arange(t - 1, dtype=np.int32), (len(pairs), t - 1))
    h, _ = forward(params, MODEL, jnp.asarray(ids[:, :-1]), jnp.asarray(pos))
    logp, _ = target_logprobs(
        h, unembed(params, MODEL), jnp.asarray(ids[:, 1:]), temperature=temperature, chunk=4
    )
    logp = np.asarray(logp)
    return [logp[i, len(p) - 1 : len(p) - 1 + len(r)] for i, (p, r) in enumerate(pairs)]


@pytest.fixture(scope="module")
def world():
    """A LoRA learner (int8 base, KL on) on fsdp=4 x tensor=2 and a 4-row batch whose
    behaviour logprobs are the base's (B = 0 at step 0)."""
    mesh = make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    lcfg = _learner_config(_lora(base_dtype="int8"))
    state = create_train_state(MODEL, lcfg, mesh, LEARNER_RULES, seed=0)
    host_base = jax.device_get(state.base)
    rng = np.random.default_rng(0)
    pairs = [
        (rng.integers(3, MODEL.vocab_size, p).astype(np.int32),
         rng.integers(3, MODEL.vocab_size, r).astype(np.int32))
        for p, r in ((5, 3), (4, 5), (6, 2), (3, 2))
    ]  # fmt: skip
    logps = _seq_logprobs(lora.merge(host_base, jax.device_get(state.params)), pairs, 0.7)
    samples = []
    for i, ((prompt, resp), logp) in enumerate(zip(pairs, logps, strict=True)):
        r = len(resp)
        samples.append(
            Sample(
                prompt_id=i,
                sample_index=0,
                prompt_tokens=prompt,
                response_tokens=resp,
                behaviour_logprobs=logp.astype(np.float32),
                token_versions=np.zeros(r, np.int32),
                start_version=0,
                finish_reason=FinishReason.LENGTH,
                reward=0.0,
            )
        )
    batch = pack_batch(samples, np.array([1.0, -1.0, 0.5, -0.5]), length_multiple=16)
    step = make_train_step(MODEL, lcfg, mesh, LEARNER_RULES)  # shared: compiled once
    return mesh, lcfg, state, (jax.device_get(state.params), host_base), batch, step


def _copy(batch):
    return TrainBatch(**{k: None if v is None else np.array(v) for k, v in vars(batch).items()})


def test_adapters_are_the_only_trained_leaves_and_only_they_hold_optimizer_state(world):
    mesh, lcfg, state0, (_, host_base), batch, step = world
    keys = {
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state0.params)[0]
    }
    assert keys and all("lora_" in k for k in keys), keys
    mu = state0.opt_state[1][0].mu  # clip, then adamw's (scale_by_adam, ...)
    assert jax.tree.structure(mu) == jax.tree.structure(state0.params)
    assert state0.ref_params is None  # the KL reference is the base itself
    assert isinstance(state0.base["layers"]["w_q_ldnh"], lora.QArray)
    assert state0.base["layers"]["w_q_ldnh"].q.dtype == jnp.int8
    # Sharded like the model: A [L, D, r] splits D over fsdp, B [L, r, F] F over tensor.
    a = state0.params["layers"]["lora_gate"]
    assert a.a.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
    assert a.b.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    abstract = abstract_train_state(MODEL, lcfg, mesh, LEARNER_RULES)
    assert jax.tree.structure(abstract) == jax.tree.structure(state0)

    state = state0  # donated below (the other tests read the fixture's host copies)
    history = []
    for _ in range(2):
        state, metrics = step(state, _copy(batch))
        history.append(jax.device_get(metrics))
    assert step.trace_count == 1  # traced once for 2 steps
    first = history[0]
    # Step 0: B = 0, so the learner scores under the base = what sampled the batch.
    assert first["logprob_gap_max"] < 1e-5 and first["kl"] == 0.0
    assert first["grad_norm"] > 0 and history[1]["kl"] > 0  # adapters moved off the base
    # The base never moves; every B did.
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.base)), jax.tree.leaves(host_base), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    for ad in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, lora.Adapter)):
        assert float(jnp.abs(ad.b).max()) > 0


def test_lora_grads_are_micro_batch_invariant(world):
    _, lcfg, _, (host_adapters, host_base), batch, _ = world
    grad_fn = jax.jit(make_grad_fn(MODEL, lcfg))
    adapters = _nonzero(host_adapters)  # B != 0: gradients reach A too
    out = []
    for mbs in (4, 2):
        b = split_micro_batches(batch, mbs)
        b.behaviour_logp_bt = b.behaviour_logp_bt + 0.3 * b.loss_mask_bt * np.sign(
            np.sin(np.arange(b.loss_mask_bt.size).reshape(b.loss_mask_bt.shape))
        )
        fields = {k: jnp.asarray(v) for k, v in vars(b).items() if v is not None}
        out.append(grad_fn(adapters, None, fields, jnp.int32(0), host_base))
    (l1, g1, m1), (l2, g2, m2) = out
    assert float(m1["clip_frac"]) > 0 and float(m1["kl"]) > 0
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    assert jax.tree.structure(g1) == jax.tree.structure(adapters)  # grads: adapters only
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(b) > 0 and np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-6


# ---------------------------------------------------------------- engine / publish


def _requests(n=3, max_new=10):
    return [
        GenerationRequest(
            prompt_id=i,
            sample_index=0,
            prompt_tokens=(np.arange(4 + i, dtype=np.int32) * 37 + 11 * i + 1) % MODEL.vocab_size,
            sampling=SamplingParams(max_new_tokens=max_new),
            seed=0,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("base_dtype", ["float32", pytest.param("int8", marks=pytest.mark.slow)])
def test_engine_behaviour_logprobs_equal_the_learners_under_adapters(base_dtype):
    lc = _lora(base_dtype=base_dtype)
    mesh = make_mesh(jax.devices()[:1], {})
    config = EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_target_length=32)
    engine, adapter_sh = build_engine(MODEL, config, mesh, lora=lc)
    base = lora.quantize_base(init_params(MODEL, 0), lc)
    adapters = _nonzero(lora.init_adapters(MODEL, lc, jax.random.PRNGKey(0)))
    pub = AdapterPublisher(engine, adapter_sh)
    params = pub.publish(adapters, base, 0).params
    base_bytes, adapter_bytes = lora.tree_bytes(base), lora.tree_bytes(adapters)
    assert pub.last_bytes == base_bytes + adapter_bytes  # the first publish: base once
    samples = run_requests(engine, params, _requests(), policy_version=0, eos_id=NO_EOS)
    merged = lora.merge(base, adapters)
    want = _seq_logprobs(merged, [(s.prompt_tokens, s.response_tokens) for s in samples], 1.0)
    gap = max(
        float(np.max(np.abs(w - s.behaviour_logprobs))) for w, s in zip(want, samples, strict=True)
    )
    assert gap < 1e-5, gap  # today's fp32 engine/learner bound (tests/models/test_bf16.py)
    # Publish v1: only the adapters move (counted); the base buffers are the same.
    new = _nonzero(adapters, seed=2)
    params1 = pub.publish(new, base, 1).params
    assert pub.last_bytes == adapter_bytes and pub.total_bytes == base_bytes + 2 * adapter_bytes
    assert adapter_bytes < 0.2 * base_bytes
    w0, w1 = params["layers"][0]["w_q_ldnh"], params1["layers"][0]["w_q_ldnh"]
    for x, y in zip(jax.tree.leaves(w0), jax.tree.leaves(w1), strict=True):
        assert x is y  # held once, not copied
    samples1 = run_requests(engine, params1, _requests(), policy_version=1, eos_id=NO_EOS)
    assert any(
        not np.array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
        for a, b in zip(samples, samples1, strict=True)
    )  # the new adapters are what the engine now samples with
    with pytest.raises(ValueError, match="versions must increase"):
        pub.publish(new, base, 1)


def test_resume_from_an_adapter_checkpoint_equals_the_uninterrupted_run(world, tmp_path):
    """The checkpoint holds adapters + optimizer state, not the base (named by digest);
    restored and given the rebuilt base, the next step equals the uninterrupted one."""
    from jaxflash.checkpoint.checkpointer import Checkpointer, CheckpointMeta
    from jaxflash.sync.transfer_digest import tree_digest

    mesh, lcfg, _, (_, host_base), batch, step = world
    fresh = lambda: create_train_state(MODEL, lcfg, mesh, LEARNER_RULES, seed=0)  # noqa: E731
    state, _ = step(fresh(), _copy(batch))
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(state.replace(base=None), CheckpointMeta(step=1))
    ckpt.wait()
    saved = jax.device_get(state.params)
    straight, _ = step(state, _copy(batch))
    abstract = abstract_train_state(MODEL, lcfg, mesh, LEARNER_RULES).replace(base=None)
    restored, meta = ckpt.restore(1, abstract)
    ckpt.close()
    assert restored.base is None and meta.step == 1
    base = fresh().base  # rebuilt from the source, as runtime.resume does
    assert tree_digest(base) == tree_digest(host_base)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), saved)
    resumed, _ = step(restored.replace(base=base), _copy(batch))
    assert step.trace_count == 1
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(resumed.params),
        jax.device_get(straight.params),
    )
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(resumed.opt_state),
        jax.device_get(straight.opt_state),
    )


def test_lora_settings_without_a_rank_are_refused_not_ignored():
    from configs import rlvr_smollm2_arith  # noqa: PLC0415
    from jaxflash.runtime.config.experiment import ExperimentConfig  # noqa: PLC0415

    c = rlvr_smollm2_arith.get_config()
    assert ExperimentConfig.from_config_dict(c).learner.lora is None  # rank 0: off
    c.learner.lora.base_dtype = "int8"
    with pytest.raises(ValueError, match=r"learner.lora.base_dtype is set but learner.lora.rank"):
        ExperimentConfig.from_config_dict(c)
    c.learner.lora.rank = -1
    with pytest.raises(ValueError, match=r"rank must be an int >= 1 \(0 in the config"):
        ExperimentConfig.from_config_dict(c)
