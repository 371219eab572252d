"""LlamaEngine + slot loop on the tiny fp32 model: logprob parity with the learner's
recomputation, per-sample RNG, continuous batching, weight swaps, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.api import EngineApi
from jaxflash.generation.jetstream.state import result_logprobs
from jaxflash.generation.sampling import sample_key, sample_tokens
from jaxflash.generation.slot_loop import SlotBatcher, run_requests
from jaxflash.generation.slot_types import SlotStats, check_request
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.decoder.transformer import forward, init_params, unembed
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams

CFG = get_preset("tiny")  # vocab 512, fp32
NO_EOS = -1  # never sampled: every sample runs to max_new_tokens
SAMPLING = {
    "t1": dict(temperature=1.0, top_k=0, top_p=1.0),
    "t07_k20_p09": dict(temperature=0.7, top_k=20, top_p=0.9),
}


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


_ENGINES = {}


def engine_for(name):
    """One engine per sampling setting for the whole module (compiles once)."""
    if name not in _ENGINES:
        cfg = EngineConfig(
            max_concurrent_decodes=3,
            max_prefill_length=16,
            max_target_length=40,
            **SAMPLING[name],
        )
        _ENGINES[name] = LlamaEngine(CFG, cfg)
    return _ENGINES[name]


def request(prompt_id, prompt_len, max_new, name="t1", sample_index=0, seed=0):
    tokens = (np.arange(prompt_len, dtype=np.int32) * 37 + 11 * prompt_id) % CFG.vocab_size
    return GenerationRequest(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=tokens,
        sampling=SamplingParams(max_new_tokens=max_new, **SAMPLING[name]),
        seed=seed,
    )


# ----------------------------------------------------------------- sampling


def test_sample_key_is_the_documented_fold_in_chain():
    want = jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), 3), 2), 5
    )
    np.testing.assert_array_equal(sample_key(7, 3, 2, 5), want)
    assert not np.array_equal(sample_key(7, 3, 2, 5), sample_key(7, 3, 2, 6))


def test_sample_tokens_hand_computed_logprobs():
    # Temperature: logits [2, 1, 0], T = 0.5 -> softmax([4, 2, 0])[0] = 0.86681.
    keys = jnp.zeros((1, 2), jnp.uint32)
    tok, logp = sample_tokens(
        jnp.array([[2.0, 1.0, 0.0]]), keys, temperature=0.5, top_k=0, top_p=1.0, greedy=True
    )
    assert int(tok[0]) == 0
    assert float(logp[0]) == pytest.approx(math.log(0.86681), abs=1e-5)
    # Top-k renormalisation: p = [0.5, 0.3, 0.15, 0.05], top-k 2 -> q(0) = 0.5 / 0.8.
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    tok, logp = sample_tokens(logits, keys, temperature=1.0, top_k=2, top_p=1.0, greedy=True)
    assert float(logp[0]) == pytest.approx(math.log(0.625), abs=1e-6)


def test_sampling_stays_in_the_kept_set_with_the_right_frequencies():
    n = 4000
    logits = jnp.broadcast_to(jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05])), (n, 4))
    keys = jax.vmap(lambda i: sample_key(0, 0, 0, i))(jnp.arange(n))
    tok, logp = sample_tokens(logits, keys, temperature=1.0, top_k=2, top_p=1.0, greedy=False)
    tok, logp = np.asarray(tok), np.asarray(logp)
    assert set(np.unique(tok)) <= {0, 1}
    assert abs(np.mean(tok == 0) - 0.625) < 0.03  # 4 sigma ~ 0.031
    np.testing.assert_allclose(logp[tok == 1], math.log(0.375), atol=1e-6)


# ------------------------------------------------------------ engine + loop


def learner_logprobs(params, samples, name, config=CFG):
    """Recompute log q(response) on full sequences, as the learner does (no cache)."""
    seqs = [np.concatenate([s.prompt_tokens, s.response_tokens]) for s in samples]
    width = max(len(x) for x in seqs)
    ids = np.zeros((len(seqs), width), np.int32)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = x  # right padding cannot affect earlier positions
    targets = np.concatenate([ids[:, 1:], np.zeros((len(seqs), 1), np.int32)], axis=1)

    @jax.jit
    def score(params, ids, targets):
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), ids.shape)
        h, _ = forward(params, config, ids, positions)
        return target_logprobs(h, unembed(params, config), targets, chunk=8, **SAMPLING[name])[0]

    logp = np.asarray(score(params, ids, targets))
    out = []
    for i, s in enumerate(samples):
        p, r = len(s.prompt_tokens), len(s.response_tokens)
        out.append(logp[i, p - 1 : p - 1 + r])  # position t scores token t + 1
    return out


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_behaviour_logprobs_match_learner_recomputation(params, name):
    engine = engine_for(name)
    reqs = [request(i, n, 14, name) for i, n in enumerate([3, 9, 16, 5])]
    samples = run_requests(engine, params, reqs, policy_version=0, eos_id=NO_EOS)
    assert [len(s.response_tokens) for s in samples] == [14, 14, 14, 14]
    for sample, want in zip(samples, learner_logprobs(params, samples, name), strict=True):
        assert np.all(sample.behaviour_logprobs < 0) and np.all(sample.behaviour_logprobs > -20)
        assert np.max(np.abs(sample.behaviour_logprobs - want)) <= 1e-5
        np.testing.assert_array_equal(sample.token_versions, np.zeros(14, np.int32))
        assert sample.start_version == 0


# Each family's differences on the tiny shape; window 4 is shorter than the prompts, so
# both the engine's prefill and its KV-cache decode must mask by it.
FAMILIES = {
    "llama3_rope": CFG.replace(
        rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=16
    ),
    "qwen2": CFG.replace(qkv_bias=True),
    "qwen3": CFG.replace(qk_norm=True, head_dim=24, tie_embeddings=False),
    "mistral_window": CFG.replace(sliding_window=4, layer_types=("sliding_attention",) * 2),
    "gemma3": CFG.replace(
        qk_norm=True,
        norm_offset=1.0,
        mlp_activation="gelu_tanh",
        sandwich_norm=True,
        scale_embeddings=True,
        query_pre_attn_scalar=24.0,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        rope_local_theta=100.0,
    ),
}


@pytest.mark.parametrize(
    "family",
    # gemma3 (sliding + full layers) runs in the fast suite; the others are slow (~10 s each).
    [f if f == "gemma3" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)],
)
def test_family_behaviour_logprobs_match_learner(family):
    """The engine (prefill + cached decode, unrolled layers) and the learner's scan agree
    for every family, sliding windows included (one prefill bucket: 16)."""
    config, name = FAMILIES[family], "t07_k20_p09"
    rng = np.random.default_rng(3)

    def spread(path, x):  # 4x the init spread, noisy norms and biases: far from uniform
        name = jax.tree_util.keystr(path)
        if "norm" in name or "'b_" in name:
            return x + jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype)
        return 4 * x

    params = jax.tree_util.tree_map_with_path(spread, init_params(config, seed=1))
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=2, max_prefill_length=16, max_target_length=40, **SAMPLING[name]
        ),
    )
    reqs = [request(i, n, 14, name) for i, n in enumerate([9, 16, 13])]
    samples = run_requests(engine, params, reqs, policy_version=0, eos_id=NO_EOS)
    for sample, want in zip(samples, learner_logprobs(params, samples, name, config), strict=True):
        assert len(sample.response_tokens) == 14
        assert np.max(np.abs(sample.behaviour_logprobs - want)) <= 1e-5


def test_sample_tokens_do_not_depend_on_slot_or_neighbours(params):
    engine = engine_for("t07_k20_p09")
    target = request(42, 7, 12, "t07_k20_p09", sample_index=3, seed=5)
    alone = run_requests(engine, params, [target], policy_version=0, eos_id=NO_EOS)[0]
    others = [request(i, 4 + i, 3 + 2 * i, "t07_k20_p09") for i in range(4)]
    stats = SlotStats()
    crowd = run_requests(
        engine, params, [*others, target], policy_version=0, eos_id=NO_EOS, stats=stats
    )[-1]
    fill = [f for f in stats.slot_fills if f[2] == (42, 3)][0]
    assert fill[:2] != (0, 0)  # it ran later and/or in another slot than when alone
    np.testing.assert_array_equal(crowd.response_tokens, alone.response_tokens)
    np.testing.assert_allclose(crowd.behaviour_logprobs, alone.behaviour_logprobs, atol=1e-6)
    # A different sample index of the same prompt draws different tokens.
    sibling = run_requests(
        engine,
        params,
        [request(42, 7, 12, "t07_k20_p09", 4, seed=5)],
        policy_version=0,
        eos_id=NO_EOS,
    )[0]
    assert not np.array_equal(sibling.response_tokens, alone.response_tokens)


def test_continuous_batching_refills_finished_slots_at_once(params):
    engine = engine_for("t1")
    max_new = [3, 9, 4, 6, 2, 8, 5]  # A..G; 3 slots, FIFO
    reqs = [request(i, 4, n) for i, n in enumerate(max_new)]
    stats = SlotStats()
    samples = run_requests(
        engine, params, reqs, policy_version=0, eos_id=NO_EOS, stats=stats, decode_block=1
    )
    assert [len(s.response_tokens) for s in samples] == max_new
    assert all(s.finish_reason == FinishReason.LENGTH and s.truncated for s in samples)
    # Worked by hand: a sample of n tokens holds a slot for n - 1 generate steps
    # (its first token comes from prefill). D fills A's slot after step 2, E
    # takes C's after step 3, F takes E's after step 4, G takes D's after step 7.
    assert stats.slot_fills == [
        (0, 0, (0, 0)),
        (0, 1, (1, 0)),
        (0, 2, (2, 0)),
        (2, 0, (3, 0)),
        (3, 2, (4, 0)),
        (4, 2, (5, 0)),
        (7, 0, (6, 0)),
    ]
    released = {(step, slot) for step, slot, _ in stats.slot_releases}
    assert all((step, slot) in released for step, slot, _ in stats.slot_fills[3:])
    assert stats.steps == 11
    assert stats.generated_tokens == 37
    assert stats.occupancy == pytest.approx(30 / 33)
    assert stats.tokens_per_s > 0


def test_eos_finishes_a_sample_and_is_kept(params):
    engine = engine_for("t1")
    ref = run_requests(engine, params, [request(0, 5, 10)], policy_version=0, eos_id=NO_EOS)[0]
    eos = int(ref.response_tokens[4])  # make the 5th token the "EOS"
    first = int(np.argmax(ref.response_tokens == eos))
    got = run_requests(engine, params, [request(0, 5, 10)], policy_version=0, eos_id=eos)[0]
    assert got.finish_reason == FinishReason.EOS and not got.truncated
    np.testing.assert_array_equal(got.response_tokens, ref.response_tokens[: first + 1])


def test_new_params_change_outputs_without_recompiling(params):
    engine = engine_for("t1")
    new_params = init_params(CFG, seed=1)
    batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS)
    batcher.add(request(7, 6, 10))
    for _ in range(3):
        assert batcher.step() == []
    counts = dict(engine.trace_counts)
    batcher.set_params(new_params, 1)
    done = []
    while not batcher.idle:
        done += batcher.step()
    assert dict(engine.trace_counts) == counts  # no retrace, so no recompilation
    assert engine.trace_counts["generate_block_1"] == 1  # SlotBatcher's default block
    (sample,) = done
    np.testing.assert_array_equal(sample.token_versions, [0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    assert sample.start_version == 0
    old = run_requests(engine, params, [request(7, 6, 10)], policy_version=0, eos_id=NO_EOS)[0]
    np.testing.assert_array_equal(sample.response_tokens[:4], old.response_tokens[:4])
    assert not np.allclose(sample.behaviour_logprobs[4:], old.behaviour_logprobs[4:], atol=1e-3)
    with pytest.raises(ValueError, match="versions only go up"):
        batcher.set_params(params, 0)


def test_placing_device_params_compiles_the_unstacking_once(params):
    from jaxflash.generation.engine import params as engine_params

    engine = engine_for("t1")
    stacked = jax.device_put(params)  # device arrays: the jitted unstacking path
    engine.place_params(stacked)
    traces = engine_params.UNSTACK_TRACES[0]
    placed = engine.place_params(jax.device_put(init_params(CFG, seed=1)))
    assert engine_params.UNSTACK_TRACES[0] == traces  # the second update reuses the program
    assert isinstance(placed["layers"], tuple) and len(placed["layers"]) == CFG.n_layers


def test_abort_returns_partial_sample_and_frees_the_slot(params):
    engine = engine_for("t1")
    batcher = SlotBatcher(engine, params, policy_version=3, eos_id=NO_EOS)
    for i in range(4):
        batcher.add(request(i, 4, 8))
    batcher.step()  # 3 running (2 tokens each), 1 queued
    aborted = batcher.abort((1, 0))
    assert aborted.finish_reason == FinishReason.ABORTED
    assert len(aborted.response_tokens) == 2 and list(aborted.token_versions) == [3, 3]
    queued = batcher.abort((3, 0))
    assert len(queued.response_tokens) == 0
    with pytest.raises(KeyError):
        batcher.abort((3, 0))
    batcher.add(request(9, 4, 8))
    batcher.step()
    assert batcher.stats.slot_fills[-1] == (1, 1, (9, 0))  # the aborted slot, at once


def test_driver_style_insert_emits_the_prefill_token_first(params):
    """JetStream's Driver only streams generate()'s tokens: the first step after a
    default insert must return the prefill's token, then continue identically."""
    engine = engine_for("t1")
    ref = run_requests(engine, params, [request(5, 6, 5)], policy_version=0, eos_id=NO_EOS)[0]
    req = request(5, 6, 5)
    api = EngineApi(engine)
    prefix = api.prefill(
        params=params, padded_tokens=req.prompt_tokens, true_length=6, prompt_id=5, sample_index=0
    )
    state = api.insert(prefix, api.init_decode_state(), 2)
    tokens, logps, lengths = [], [], []
    for _ in range(5):
        state, result = api.generate(params, state)
        data = np.asarray(result.data)
        tokens.append(data[2, 0])
        lengths.append(data[2, 2])
        logps.append(result_logprobs(result)[2])
        assert data[2, 1] == 1
    np.testing.assert_array_equal(tokens, ref.response_tokens)
    np.testing.assert_allclose(logps, ref.behaviour_logprobs, atol=1e-6)
    assert lengths == [1, 2, 3, 4, 5]


def test_overlong_prompt_raises_named_error(params):
    engine = engine_for("t1")
    with pytest.raises(ValueError, match="prompt of 17 tokens exceeds max_prefill_length=16"):
        EngineApi(engine).prefill(
            params=params, padded_tokens=np.ones(17, np.int32), true_length=17
        )
    with pytest.raises(ValueError, match=r"prompt_id=4.*17 tokens exceeds max_prefill_length"):
        run_requests(engine, params, [request(4, 17, 3)], policy_version=0, eos_id=NO_EOS)
    with pytest.raises(ValueError, match=r"prompt \(10\) \+ max_new_tokens \(31\) = 41 exceeds"):
        check_request(engine, request(4, 10, 31))
    with pytest.raises(ValueError, match="differs from the engine's"):
        check_request(engine, request(4, 10, 3, "t07_k20_p09"))
    with pytest.raises(ValueError, match="must be < max_target_length"):
        EngineConfig(max_concurrent_decodes=1, max_prefill_length=16, max_target_length=16)


def test_tensor_parallel_engine_matches_single_device(params):
    """Generator rules on a 2-way tensor mesh: the KV cache is split over kv heads,
    numpy params are placed per the rules, and samples match the 1-device engine."""
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES

    mesh = make_mesh(jax.devices()[:2], {"tensor": 2})
    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=16, max_target_length=40)
    engine = LlamaEngine(CFG, cfg, mesh=mesh, rules=GENERATOR_RULES)
    state = engine.init_decode_state()
    for k_bksh, v_bkhs in zip(state.cache.k_bksh, state.cache.v_bkhs, strict=True):
        # One buffer per layer and k/v ([B, K, S, H] / [B, K, H, S]), kv heads split.
        assert tuple(k_bksh.sharding.spec) == (None, "tensor", None, None)
        assert tuple(v_bkhs.sharding.spec) == (None, "tensor", None, None)
    reqs = [request(i, 5 + i, 8) for i in range(3)]
    host_params = jax.tree.map(np.asarray, params)
    got = run_requests(engine, host_params, reqs, policy_version=0, eos_id=NO_EOS)
    want = run_requests(engine_for("t1"), params, reqs, policy_version=0, eos_id=NO_EOS)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.response_tokens, w.response_tokens)
        np.testing.assert_allclose(g.behaviour_logprobs, w.behaviour_logprobs, atol=1e-5)


def test_slot_loop_makes_no_implicit_transfers(params):
    """Every host<->device copy is explicit, so rollouts run under the strictest guard."""
    engine = engine_for("t1")
    want = run_requests(engine, params, [request(3, 6, 5)], policy_version=0, eos_id=NO_EOS)[0]
    with jax.transfer_guard("disallow"):
        got = run_requests(engine, params, [request(3, 6, 5)], policy_version=0, eos_id=NO_EOS)[0]
    np.testing.assert_array_equal(got.response_tokens, want.response_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_real_smollm2_behaviour_logprobs_match_learner(name):
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer

    path = smollm2_gguf_path()
    config, host_params = load_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    cfg = EngineConfig(
        max_concurrent_decodes=2, max_prefill_length=64, max_target_length=96, **SAMPLING[name]
    )
    engine = LlamaEngine(config, cfg)
    params = engine.place_params(host_params)
    reqs = []
    for i, q in enumerate(["What is 7 + 5?", "Name a colour."]):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}])
        tokens = np.asarray(tokenizer.encode(text), np.int32)
        reqs.append(
            GenerationRequest(
                prompt_id=i,
                sample_index=0,
                prompt_tokens=tokens,
                sampling=SamplingParams(max_new_tokens=16, **SAMPLING[name]),
            )
        )
    samples = run_requests(engine, params, reqs, policy_version=0, eos_id=tokenizer.eos_id)
    want = learner_logprobs(params, samples, name, config)
    # 30 fp32 layers: the learner's own logprobs of the same tokens move by 2.1e-5
    # when only the padded length changes (T=48 vs T=41, measured here), so 1e-5
    # is below this stack's rounding floor; measured engine gaps: 0.9e-5 - 2.4e-5.
    for sample, w in zip(samples, want, strict=True):
        assert np.max(np.abs(sample.behaviour_logprobs - w)) <= 5e-5


def test_prefill_buckets_are_powers_of_two_capped_at_the_limit():
    cfg = EngineConfig(max_concurrent_decodes=1, max_prefill_length=48, max_target_length=64)
    engine = LlamaEngine(CFG, cfg)  # nothing compiles until first use
    got = {n: engine.prefiller.prefill_bucket(n) for n in (1, 16, 17, 32, 33, 48)}
    assert got == {1: 16, 16: 16, 17: 32, 32: 32, 33: 48, 48: 48}
    with pytest.raises(ValueError, match="at least 1 token"):
        engine.prefiller.prefill_bucket(0)


@pytest.mark.parametrize("in_flight", ["continue", "restart"])
def test_weight_update_in_flight_policies(params, in_flight):
    """rl_pitfalls "Restart means restart": a sample with 2 tokens at version 2 gets
    version-3 weights; continue -> versions [2, 2, 3, ...]; restart -> all 3, no old
    prefix, identical to a fresh run under version 3."""
    engine = engine_for("t1")
    new_params = init_params(CFG, seed=1)
    batcher = SlotBatcher(engine, params, policy_version=2, eos_id=NO_EOS)
    batcher.add(request(8, 5, 6))
    batcher.step()  # first token from prefill + one generated
    batcher.set_params(new_params, 3, in_flight=in_flight)
    done = []
    while not batcher.idle:
        done += batcher.step()
    (sample,) = done
    fresh = run_requests(engine, new_params, [request(8, 5, 6)], policy_version=3, eos_id=NO_EOS)
    if in_flight == "continue":
        assert list(sample.token_versions) == [2, 2, 3, 3, 3, 3] and sample.start_version == 2
        assert batcher.stats.restarted == 0
    else:
        assert list(sample.token_versions) == [3] * 6 and sample.start_version == 3
        assert batcher.stats.restarted == 1
        np.testing.assert_array_equal(sample.response_tokens, fresh[0].response_tokens)
        np.testing.assert_allclose(
            sample.behaviour_logprobs, fresh[0].behaviour_logprobs, atol=1e-6
        )
    with pytest.raises(ValueError, match="in_flight must be"):
        batcher.set_params(new_params, 3, in_flight="resume")


def _with_leaf(params, key, value):
    return {**params, key: value}


@pytest.mark.parametrize(
    "fault",
    ["float32_into_bfloat16", "lm_head_of_another_vocab", "unstacked_layer_shape", "missing_leaf"],
)
def test_set_params_refuses_a_tree_unlike_the_model_naming_the_leaf(params, fault):
    """A float32 tree into a bfloat16 engine would recompile every program; an
    lm_head [64, 80] into a 64-word engine would sample ids outside the vocabulary.
    Both are refused like the cross-process transfer refuses them."""
    from jaxflash.models.decoder.transformer import unstack_layers
    from jaxflash.sharding.leaves import LayoutMismatchError

    cfg = EngineConfig(max_concurrent_decodes=1, max_prefill_length=16, max_target_length=40)
    model, good, bad = CFG, params, None
    if fault == "float32_into_bfloat16":
        model = CFG.replace(param_dtype="bfloat16")
        good = init_params(model, seed=0)
        bad, match = params, r"leaf \['embed_vd'\]: new params has float32.*expects bfloat16"
    elif fault == "lm_head_of_another_vocab":
        model = CFG.replace(tie_embeddings=False, vocab_size=64)
        good = init_params(model, seed=0)
        d = model.d_model
        bad = _with_leaf(good, "lm_head_dv", np.zeros((d, 80), np.float32))
        match = rf"leaf \['lm_head_dv'\]: new params has float32\[{d}, 80\].*\[{d}, 64\]"
    elif fault == "unstacked_layer_shape":
        layers = list(unstack_layers(params)["layers"])
        layers[1] = {**layers[1], "w_q_ldnh": jnp.zeros((64, 4, 8))}
        bad = {**params, "layers": tuple(layers)}
        match = r"leaf \['layers'\]\[1\]\['w_q_ldnh'\]"
    else:
        bad = {k: v for k, v in params.items() if k != "final_norm_d"}
        missing = sorted(set(params) - set(bad))
        match = rf"trees differ.*missing on the new params \[\"\['{missing[0]}'\]\"\]"
    engine = LlamaEngine(model, cfg)  # nothing compiles: the check reads shapes only
    batcher = SlotBatcher(engine, good, policy_version=0, eos_id=NO_EOS)
    with pytest.raises(LayoutMismatchError, match=match):
        batcher.set_params(bad, 1)
    assert batcher.policy_version == 0  # nothing was installed
    with pytest.raises(LayoutMismatchError):
        SlotBatcher(engine, bad, policy_version=0, eos_id=NO_EOS)
    batcher.set_params(unstack_layers(good), 1)  # the model's own tree, either layout
    assert batcher.policy_version == 1
    assert dict(engine.trace_counts) == {}
