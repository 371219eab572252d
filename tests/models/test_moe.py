"""Qwen3-MoE: routed experts against transformers, the grouped matmul against its dense
reference, engine vs learner logprobs with routing, the load-balancing loss, the MoE
learner step (compile-once, micro-batch invariance) and expert sharding on 8 fake
CPU devices.

The transformers model is built from a config with random weights (no download) and
redrawn with a larger spread (router included), so routing is decisive: a wrong
top-k, renormalisation, expert layout or combine moves the logits by O(1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.slot_loop import run_requests
from jaxflash.learner.batching import pack_batch, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.optimizer import make_optimizer
from jaxflash.learner.state import from_params
from jaxflash.learner.step import make_grad_fn, make_loss_fn, make_train_step
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder import moe, transformer
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.formats.hf_config import config_from_hf_dict, hf_model_type
from jaxflash.models.formats.weights_hf import load_hf, save_hf
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES, logical_to_spec
from jaxflash.types import FinishReason, Sample, SamplingParams, TrainBatch
from tests.generation.test_engine import NO_EOS, SAMPLING, learner_logprobs
from tests.generation.test_engine import request as engine_request
from tests.models.test_families import PROMPTS, _assert_close, _hf_logits, _our_logits

torch = pytest.importorskip("torch", reason="crosscheck extra (torch) not installed")
transformers = pytest.importorskip(
    "transformers", reason="crosscheck extra (transformers) not installed"
)

_HF_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # != hidden / heads
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def _hf_moe(norm_topk_prob: bool):
    cfg = transformers.AutoConfig.for_model("qwen3_moe", **_HF_SHAPE, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # matrices, fused expert stacks [E, out, in] and the router [E, D]
                p.copy_(1.5 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(True, id="renorm"),
        pytest.param(False, id="no_renorm", marks=pytest.mark.slow),
    ],
)
def hf_moe(request, tmp_path_factory):
    """(transformers model, our config, our params) imported from save_pretrained."""
    model = _hf_moe(request.param)
    directory = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(directory)
    config, params = load_hf(directory)
    return model, config, params


def test_import_matches_transformers(hf_moe):
    model, config, params = hf_moe
    assert hf_model_type(config) == "qwen3_moe"
    assert (config.n_experts, config.n_experts_per_token, config.moe_d_ff) == (8, 2, 32)
    assert config.norm_topk_prob == model.config.norm_topk_prob
    _assert_close(_our_logits(config, params, PROMPTS), _hf_logits(model, PROMPTS), "qwen3_moe")


def test_export_read_back_by_transformers(hf_moe, tmp_path):
    _, config, params = hf_moe
    save_hf(tmp_path, config, params)
    back_config, back = load_hf(tmp_path)
    assert back_config == config
    jax.tree.map(np.testing.assert_array_equal, back, params)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    _assert_close(_our_logits(config, params, PROMPTS), _hf_logits(theirs, PROMPTS), "export")


def test_aux_loss_equals_transformers(hf_moe):
    """Router logits and the load-balancing loss (with a padding mask) equal
    transformers' ``output_router_logits=True`` outputs; micro-batch shares computed
    with the whole batch's loads sum to the whole batch's loss."""
    model, config, params = hf_moe
    ids = np.zeros((2, 12), np.int32)
    ids[0], ids[1, :7] = PROMPTS[2], PROMPTS[1]
    mask = np.zeros((2, 12), np.float32)
    mask[0], mask[1, :7] = 1.0, 1.0
    with torch.no_grad():
        out = model(
            torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            output_router_logits=True,
        )
    pos = jnp.broadcast_to(jnp.arange(12), ids.shape)
    _, router_lbte = transformer.forward_with_router_logits(params, config, jnp.asarray(ids), pos)
    theirs_lne = np.stack([r.numpy() for r in out.router_logits])
    ours_lne = np.asarray(router_lbte).reshape(theirs_lne.shape)
    on = mask.reshape(-1) > 0  # transformers' padded rows see a different mask
    np.testing.assert_allclose(ours_lne[:, on], theirs_lne[:, on], atol=1e-5)
    k = config.n_experts_per_token
    ours = float(moe.load_balancing_loss(router_lbte, jnp.asarray(mask), k))
    assert float(out.aux_loss) > 1.0  # E * sum f P = top_k only if perfectly balanced
    np.testing.assert_allclose(ours, float(out.aux_loss), rtol=1e-5)
    load_e = moe.expert_load(router_lbte, jnp.asarray(mask), k)
    assert float(jnp.sum(load_e)) == config.n_layers * k * mask.sum()
    rows = config.n_layers * mask.sum()
    shares = [
        moe.load_balancing_loss(
            router_lbte[:, i : i + 1], mask[i : i + 1], k, load_e=load_e, num_rows=rows
        )
        for i in range(2)
    ]
    np.testing.assert_allclose(float(sum(shares)), ours, rtol=1e-6)


def test_ragged_dot_equals_dense_reference():
    """The grouped matmul on expert-sorted rows equals running every expert on every
    token and combining: values and gradients (of the input and every weight)."""
    rng = np.random.default_rng(0)
    d, e, f = 16, 6, 12
    x = jnp.asarray(rng.normal(size=(3, 7, d)), jnp.float32)
    ws = [
        jnp.asarray(rng.normal(size=s) / s[-2] ** 0.5, jnp.float32)
        for s in ((d, e), (e, d, f), (e, d, f), (e, f, d))
    ]
    probe = jnp.asarray(rng.normal(size=(3, 7, d)), jnp.float32)

    def run(impl):
        def loss(x, *ws):
            y, *_ = moe.moe_mlp(x, *ws, top_k=3, norm_topk_prob=True, impl=impl)
            return jnp.sum(y * probe), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
            x, *ws
        )
        return y, grads

    (y_r, g_r), (y_d, g_d) = run("ragged"), run("dense")
    _, _, experts_nk, _ = moe.route(x.reshape(-1, d), ws[0], top_k=3, norm_topk_prob=True)
    assert len(np.unique(np.asarray(experts_nk))) == e  # every expert gets tokens
    np.testing.assert_allclose(y_r, y_d, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(y_d))))
    for a, b in zip(g_r, g_d, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
    with pytest.raises(ValueError, match="impl"):
        moe.moe_mlp(x, *ws, top_k=3, norm_topk_prob=True, impl="megablox")


# ------------------------------------------------------------ engine vs learner

MOE = get_preset("tiny_moe")  # vocab 512, 8 experts, top-2, renormalised, fp32


def _spread_params(config, seed):
    """4x the init spread and noisy norms (as tests/generation/test_engine.py): decisive routing."""
    rng = np.random.default_rng(3)

    def spread(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return x + jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype)
        return 4 * x

    return jax.tree_util.tree_map_with_path(spread, transformer.init_params(config, seed=seed))


def _topk_margin(params, config, seqs):
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens and
    layers, relative to the largest |logit|: how far routing is from a tie that
    float32 rounding (~1e-7 relative) could flip."""
    width = max(map(len, seqs))
    ids = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    pos = jnp.broadcast_to(jnp.arange(width), ids.shape)
    _, router = transformer.forward_with_router_logits(params, config, jnp.asarray(ids), pos)
    logits = np.sort(np.asarray(router), axis=-1)[..., ::-1]
    k = config.n_experts_per_token
    valid = np.zeros(ids.shape, bool)
    for i, s in enumerate(seqs):
        valid[i, : len(s)] = True
    gap = (logits[..., k - 1] - logits[..., k])[:, valid]
    return float(np.min(gap) / np.max(np.abs(logits[:, valid])))


def test_engine_behaviour_logprobs_match_learner_with_routing():
    """The engine (prefill + cached decode, unrolled layers, a few tokens per call)
    and the learner's full-sequence scan route every token alike, so behaviour
    logprobs equal the learner's within the dense families' bound."""
    name = "t07_k20_p09"
    params = _spread_params(MOE, seed=1)
    engine = LlamaEngine(
        MOE,
        EngineConfig(
            max_concurrent_decodes=2, max_prefill_length=16, max_target_length=40, **SAMPLING[name]
        ),
    )
    reqs = [engine_request(i, n, 14, name) for i, n in enumerate([9, 16, 13])]
    samples = run_requests(engine, params, reqs, policy_version=0, eos_id=NO_EOS)
    gaps = []
    for sample, want in zip(samples, learner_logprobs(params, samples, name, MOE), strict=True):
        assert len(sample.response_tokens) == 14
        gaps.append(float(np.max(np.abs(sample.behaviour_logprobs - want))))
    seqs = [np.concatenate([s.prompt_tokens, s.response_tokens]) for s in samples]
    margin = _topk_margin(params, MOE, seqs)
    print(f"engine-learner max |logp gap| {max(gaps):.2e}, min top-k router margin {margin:.2e}")
    assert margin > 1e-6  # no tie: a flip would need a rounding error ~10x float32 eps
    assert max(gaps) <= 1e-5


# ----------------------------------------------------------------- learner step


def _sample(prompt, response, logps, pid):
    return Sample(
        prompt_id=pid,
        sample_index=0,
        prompt_tokens=np.asarray(prompt, np.int32),
        response_tokens=np.asarray(response, np.int32),
        behaviour_logprobs=np.asarray(logps, np.float32),
        token_versions=np.zeros(len(response), np.int32),
        start_version=0,
        finish_reason=FinishReason.EOS,
        reward=1.0,
    )


def _learner_config(**kw):
    base = dict(
        lr=1e-2,
        micro_batch_size=2,
        loss="ppo",
        loss_kwargs={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        sampling=SamplingParams(temperature=0.7),
        logprob_chunk=8,
        router_aux_loss_coef=0.05,
        # Adam's first update is ~lr * sign(g): an element whose gradient is at the
        # rounding level would flip by 2 lr between two float32-equal computations;
        # a large eps makes tiny gradients' updates proportional to them instead.
        eps=1e-3,
    )
    return LearnerConfig(**{**base, **kw})


LC = _learner_config()


@pytest.fixture(scope="module")
def moe_batch():
    """(host params, {M: TrainBatch [M, b, T]} for M = 1 and 2) of 4 sequences with 12
    loss tokens (8 + 4 in the halves); behaviour logprobs scored outside the learner
    code (one jitted forward of the padded rows) and then perturbed by +-0.3 so PPO
    ratios leave 1 and clip."""
    params = jax.device_get(_spread_params(MOE, seed=2))
    rng = np.random.default_rng(0)
    samples = []
    for i, (p, r) in enumerate(zip((3, 5, 4, 6), (6, 2, 1, 3), strict=True)):
        prompt = rng.integers(3, MOE.vocab_size, p).astype(np.int32)
        resp = rng.integers(3, MOE.vocab_size, r).astype(np.int32)
        samples.append(_sample(prompt, resp, np.zeros(r), i))
    batch = pack_batch(samples, (1.0, -1.0, 0.5, -0.5), length_multiple=16)

    @jax.jit
    def score(params, ids, pos, targets):
        h, _ = transformer.forward(params, MOE, ids, pos)
        return target_logprobs(
            h, transformer.unembed(params, MOE), targets, temperature=0.7, chunk=4
        )[0]

    logp = np.asarray(score(params, batch.input_ids_bt, batch.positions_bt, batch.target_ids_bt))
    on = batch.loss_mask_bt > 0
    wiggle = 0.3 * np.sign(np.sin(np.arange(on.size).reshape(on.shape)))
    batch.behaviour_logp_bt = np.where(on, logp + wiggle, 0.0).astype(np.float32)
    return params, {m: split_micro_batches(batch, 4 // m) for m in (1, 2)}


@pytest.fixture(scope="module")
def grads(moe_batch):
    """{M: (loss, grads, metrics)} of the unsharded, jitted ``make_grad_fn``."""
    params, batches = moe_batch
    grad_fn = jax.jit(make_grad_fn(MOE, LC))
    return {
        m: grad_fn(
            params,
            params,
            {k: jnp.asarray(v) for k, v in vars(b).items() if v is not None},
            jnp.int32(0),
        )
        for m, b in batches.items()
    }


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def _assert_trees_close(got, want, rtol):
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(got)[0]:
        rel = _rel(a, flat_want[path])
        assert rel < rtol, (jax.tree_util.keystr(path), rel)


def test_moe_grads_are_micro_batch_invariant_with_aux_loss(grads):
    """M = 1 (4 rows) and M = 2 (2 + 2 rows, 8 and 4 loss tokens) give the same loss,
    router_aux_loss and gradients: the aux loss uses the whole batch's expert loads."""
    (loss1, g1, m1), (loss2, g2, m2) = grads[1], grads[2]
    assert float(m1["router_aux_loss"]) > MOE.n_experts_per_token  # some imbalance
    assert float(m1["clip_frac"]) > 0  # the clipped branch is exercised
    np.testing.assert_allclose(float(m1["router_aux_loss"]), float(m2["router_aux_loss"]), 1e-6)
    np.testing.assert_allclose(float(loss1), float(loss2), rtol=1e-6)
    # The loss carries the aux term: loss = pg_loss + coef * router_aux_loss.
    for m in (m1, m2):
        want = float(m["pg_loss"]) + LC.router_aux_loss_coef * float(m["router_aux_loss"])
        np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-6)
    # float32 sums over 2 vs 4 rows in another order (1.2e-6 measured on the q/k
    # norms); a per-micro-batch normaliser or expert load gives O(1e-2) and more.
    _assert_trees_close(g2, g1, 1e-5)


def test_expert_axis_rules_split_experts():
    """The ``expert`` logical axis maps to the ``expert`` mesh axis in both roles; the
    router stays whole; batch rows also split over ``expert`` in the learner."""
    axes, shapes = (
        transformer.logical_axes(MOE)["layers"],
        transformer.abstract_params(MOE)["layers"],
    )
    learner = make_mesh(jax.devices(), {"fsdp": 2, "expert": 4})
    generator = make_mesh(jax.devices(), {"expert": 2, "tensor": 4})

    def spec(name, mesh, rules):
        return logical_to_spec(axes[name], mesh, rules, shapes[name].shape)

    P = jax.sharding.PartitionSpec
    assert spec("w_gate_ledf", learner, LEARNER_RULES) == P(None, "expert", "fsdp", None)
    assert spec("w_down_lefd", learner, LEARNER_RULES) == P(None, "expert", None, "fsdp")
    assert spec("w_router_lde", learner, LEARNER_RULES) == P(None, "fsdp", None)
    assert spec("w_gate_ledf", generator, GENERATOR_RULES) == P(None, "expert", None, "tensor")
    assert spec("w_router_lde", generator, GENERATOR_RULES) == P(None, None, None)
    assert logical_to_spec(("batch", "seq"), learner, LEARNER_RULES, (8, 16)) == P(
        ("fsdp", "expert"), None
    )


def _copy(batch):
    return TrainBatch(**{k: None if v is None else np.array(v) for k, v in vars(batch).items()})


@pytest.mark.slow  # one more train-step compile (~30 s of CPU here)
def test_expert_sharded_train_step_compiles_once_and_equals_unsharded(moe_batch, grads):
    """Experts split 4 ways over the ``expert`` mesh axis (embed 2 ways over fsdp) on
    the 8 fake devices: the step traces once for 2 steps; its first step's metrics
    equal the unsharded gradient's, and its params the unsharded gradient put through
    the same optimiser on the host."""
    params, batches = moe_batch
    mesh = make_mesh(jax.devices(), {"fsdp": 2, "expert": 4})
    state = from_params(params, MOE, LC, mesh, LEARNER_RULES)
    w = state.params["layers"]["w_gate_ledf"]  # [L, E, D, F]
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", None)
    assert w.addressable_shards[0].data.shape == (2, 2, 32, 32)  # 2 of 8 experts, half of D
    assert state.params["layers"]["w_router_lde"].sharding.spec[2] is None  # router whole
    step = make_train_step(MOE, LC, mesh, LEARNER_RULES)
    state, metrics = step(state, _copy(batches[2]))
    after_one = jax.device_get(state.params)  # before the next call donates the state
    assert state.params["layers"]["w_gate_ledf"].sharding == w.sharding
    state, metrics2 = step(state, _copy(batches[2]))
    assert step.trace_count == 1
    assert float(metrics2["loss"]) != float(metrics["loss"])  # the update moved the policy
    _, g, want = grads[2]
    for k in ("loss", "pg_loss", "router_aux_loss", "clip_frac", "logprob_gap_max"):
        np.testing.assert_allclose(float(metrics[k]), float(want[k]), rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(g)), 1e-5)
    optimizer = make_optimizer(LC)
    updates, _ = optimizer.update(g, optimizer.init(params), params)
    _assert_trees_close(after_one, optax.apply_updates(params, updates), 1e-5)


# ---------------------------------------------------------------- configs, refusals


def test_preset_qwen3_30b_a3b_shapes():
    c = get_preset("qwen3_30b_a3b")
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == (48, 2048, 32, 4, 128)
    assert (c.n_experts, c.n_experts_per_token, c.moe_d_ff) == (128, 8, 768)
    assert c.norm_topk_prob and not c.tie_embeddings and c.qk_norm
    shapes = jax.tree.map(lambda x: x.shape, transformer.abstract_params(c))
    assert shapes["layers"]["w_gate_ledf"] == (48, 128, 2048, 768)
    assert "w_gate_ldf" not in shapes["layers"]
    total = sum(
        int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    )
    assert 30.0e9 < total < 31.0e9  # "30B": 30.5B parameters


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"num_experts": 0}, "num_experts=0"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_moe_variants_are_refused_by_name(bad, match):
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 256,
        "num_local_experts": 8,  # transformers 5's name for num_experts
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        **bad,
    }
    with pytest.raises(ValueError, match=match):
        config_from_hf_dict(cfg)


def test_config_and_learner_validation_name_the_field():
    base = get_preset("tiny")
    with pytest.raises(ValueError, match="n_experts_per_token=9"):
        base.replace(n_experts=8, n_experts_per_token=9, moe_d_ff=16)
    with pytest.raises(ValueError, match="moe_d_ff"):
        base.replace(n_experts=8, n_experts_per_token=2)
    with pytest.raises(ValueError, match="need n_experts > 0"):
        base.replace(n_experts_per_token=2)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        LearnerConfig(router_aux_loss_coef=-1.0)
    with pytest.raises(ValueError, match="needs a model with experts"):
        make_loss_fn(base, LearnerConfig(router_aux_loss_coef=0.01))
    with pytest.raises(ValueError, match="no experts"):
        transformer.forward_with_router_logits(
            {}, base, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32)
        )
    assert isinstance(MOE, ModelConfig) and MOE.is_moe and not base.is_moe
