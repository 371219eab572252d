"""The exact mode (``ModelConfig.exact_numerics``): engine and learner logprobs of the
same weights are bitwise equal, whatever the batch around each token.

One tiny model per compute dtype (fp32, bf16); each engine and learner program is
built once per module and reused across the variations: engine slot counts and busy
slots, prefill buckets and rows per prefill, dense and paged KV caches; learner
micro-batch sizes and packing; LoRA adapters; the on-policy tokens of an alpha > 0
run. Equality is asserted on bits (``view(np.uint32)``), never with a tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.slot_loop import SlotBatcher, run_requests
from jaxflash.learner.batching import pack_batch
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.scoring import make_logprob_fn
from jaxflash.learner.state import from_params
from jaxflash.learner.step import make_train_step
from jaxflash.models.adapters import lora
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.types import GenerationRequest, SamplingParams

SAMPLING = dict(temperature=0.7, top_k=40, top_p=0.95)
NO_EOS = -1
ENGINES = {  # name -> EngineConfig fields: slot counts, buckets, prefill rows, cache kinds
    "dense4": dict(max_concurrent_decodes=4, decode_block=4),
    "paged2_bucket32_rows2": dict(
        max_concurrent_decodes=2,
        min_prefill_bucket=32,
        prefill_rows=2,
        kv_cache="paged",
        page_size=4,
        decode_block=2,
    ),
}
LEARNERS = {  # name -> LearnerConfig fields: micro-batches, packing
    "mb1": dict(micro_batch_size=1),
    "mb3_packed": dict(micro_batch_size=3, packing=True, pack_length=96),
}


def _config(dtype):
    return get_preset("tiny", compute_dtype=dtype, exact_numerics=True)


def _requests(vocab, ids=range(4)):
    return [
        GenerationRequest(
            prompt_id=i,
            sample_index=0,
            prompt_tokens=(np.arange(5 + 4 * i, dtype=np.int32) * 37 + 11 * i + 1) % vocab,
            sampling=SamplingParams(max_new_tokens=12 + 3 * i, **SAMPLING),
            seed=0,
        )
        for i in ids
    ]


def _engine(config, name, lora_config=None):
    ec = EngineConfig(max_prefill_length=32, max_target_length=64, **SAMPLING, **ENGINES[name])
    return LlamaEngine(config, ec, lora=lora_config)


def _generate(engine, params, requests):
    samples = run_requests(
        engine, engine.place_params(params), requests, policy_version=0, eos_id=NO_EOS
    )
    return {s.prompt_id: s for s in samples}


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _learner_logprobs(config, params, samples, lora_config=None, **fields):
    lc = LearnerConfig(sampling=SamplingParams(**SAMPLING), lora=lora_config, **fields)
    mesh = make_mesh(jax.devices()[:1], {})
    batch = pack_batch(samples, np.ones(len(samples)), length_multiple=16)
    logp_bt, _ = make_logprob_fn(config, lc, mesh, LEARNER_RULES)(params, batch)
    mask = batch.loss_mask_bt > 0
    return logp_bt[mask], batch.behaviour_logp_bt[mask]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runs(request):
    config = _config(request.param)
    params = init_params(config, seed=0)
    engines = {name: _engine(config, name) for name in ENGINES}
    requests = _requests(config.vocab_size)
    together = {name: _generate(engine, params, requests) for name, engine in engines.items()}
    alone = _generate(engines["dense4"], params, _requests(config.vocab_size, ids=[2]))
    return config, params, engines, together, alone


def test_engine_logprobs_do_not_depend_on_slots_buckets_or_cache_kind(runs):
    _, _, _, together, alone = runs
    ref = together["dense4"]
    for name, samples in [*together.items(), ("dense4_alone", alone)]:
        for pid, s in samples.items():
            np.testing.assert_array_equal(s.response_tokens, ref[pid].response_tokens, name)
            assert np.array_equal(
                _bits(s.behaviour_logprobs), _bits(ref[pid].behaviour_logprobs)
            ), name


@pytest.mark.parametrize("learner", sorted(LEARNERS))
def test_learner_logprobs_equal_the_engines_bit_for_bit(runs, learner):
    config, params, _, together, _ = runs
    samples = [together["dense4"][i] for i in sorted(together["dense4"])]
    got, want = _learner_logprobs(config, params, samples, **LEARNERS[learner])
    assert got.size > 40
    gap = np.abs(got - want).max()
    assert np.array_equal(_bits(got), _bits(want)), f"{learner}: max gap {gap}"


def test_lora_adapters_keep_engine_and_learner_bitwise_equal(runs):
    config, params, engines, _, _ = runs
    lc = lora.LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    adapters = lora.init_adapters(config, lc, jax.random.PRNGKey(1))
    leaves, tree = jax.tree.flatten(adapters)  # B != 0: a trained adapter
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    adapters = jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    )
    merged = lora.merge(params, adapters)
    engine = _engine(config, "dense4", lc)
    samples = _generate(engine, merged, _requests(config.vocab_size, ids=[0, 3]))
    got, want = _learner_logprobs(config, merged, list(samples.values()), lc, micro_batch_size=2)
    assert np.array_equal(_bits(got), _bits(want)), np.abs(got - want).max()


def test_on_policy_tokens_of_an_async_run_have_zero_gap_and_k3(runs):
    """Weights change mid-flight (alpha > 0, partial rollout by recompute): the tokens the
    current version sampled score exactly 0 gap and k3 in the learner step's metrics,
    and the older version's tokens do not."""
    config, params, engines, _, _ = runs
    new = jax.tree.map(lambda x: x * 1.05, params)
    batcher = SlotBatcher(engines["dense4"], params, policy_version=0, eos_id=NO_EOS)
    for r in _requests(config.vocab_size):
        batcher.add(r)
    batcher.step()  # first tokens + a block under version 0
    batcher.set_params(new, 1, in_flight="recompute")
    samples = []
    while not batcher.idle:
        samples += batcher.step()
    assert all(s.token_versions[0] == 0 and s.token_versions[-1] == 1 for s in samples)
    lc = LearnerConfig(lr=1e-3, micro_batch_size=2, sampling=SamplingParams(**SAMPLING))
    mesh = make_mesh(jax.devices()[:1], {})
    state = from_params(new, config, lc, mesh, LEARNER_RULES)
    state = state.replace(step=jnp.ones_like(state.step))  # the learner is at version 1
    batch = pack_batch(samples, np.ones(len(samples)), length_multiple=16)
    _, m = make_train_step(config, lc, mesh, LEARNER_RULES)(state, batch)
    m = jax.device_get(m)
    assert m["current_tokens"] > 20
    assert m["logprob_gap_max_current"] == 0.0 and m["logprob_gap_on_policy_mean"] == 0.0
    assert m["kl_k3_on_policy"] == 0.0 and m["sampling_set_miss_frac_on_policy"] == 0.0
    assert m["prob_corr_on_policy"] > 0.9999
    assert m["logprob_gap_max_off_policy"] > 0.0  # version 0's tokens: a policy change


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_shaped_engine_and_learner_logprobs_are_bitwise_equal(dtype):
    """Real shapes (SmolLM2-135M's width, heads, MLP and 49k tied vocabulary; one
    layer, random init). The tied head ``embed_vd.T`` is where the tiny config passed
    and the real model did not: a decode of <= 8 slots runs one row block, whose
    inlined dot read the transpose in another summation order than the learner's
    (2e-6 in the logits, up to 2.4e-5 in SmolLM2's logprobs) until
    ``logprobs.fixed_unembed``; the tiny vocabulary's dot sums alike either way."""
    config = get_preset("smollm2_135m", n_layers=1, compute_dtype=dtype, exact_numerics=True)
    params = init_params(config, seed=0)
    ec = EngineConfig(
        max_concurrent_decodes=4,
        decode_block=4,
        max_prefill_length=16,
        max_target_length=32,
        **SAMPLING,
    )
    engine = LlamaEngine(config, ec)
    requests = [
        GenerationRequest(
            prompt_id=i,
            sample_index=0,
            prompt_tokens=(np.arange(6 + 3 * i, dtype=np.int32) * 37 + 11 * i + 5) % 49152,
            sampling=SamplingParams(max_new_tokens=8, **SAMPLING),
            seed=0,
        )
        for i in range(2)
    ]
    samples = _generate(engine, params, requests)
    got, want = _learner_logprobs(config, params, list(samples.values()), micro_batch_size=2)
    assert got.size == 16
    assert np.array_equal(_bits(got), _bits(want)), np.abs(got - want).max()


# Gemma 3's features at toy size: sliding-window layers (window 8, shorter than the
# sequences) interleaved with a full one, the local RoPE base, sqrt(D) embedding scale,
# q/k norms, (1 + w) norms, sandwich norms, GeGLU, a query_pre_attn_scalar and a tied head.
GEMMA3_TINY = dict(
    n_layers=3,
    n_kv_heads=1,
    rope_theta=1e6,
    rope_local_theta=1e4,
    sliding_window=8,
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    query_pre_attn_scalar=24.0,
    qk_norm=True,
    norm_offset=1.0,
    mlp_activation="gelu_tanh",
    sandwich_norm=True,
    scale_embeddings=True,
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_shaped_engine_and_learner_logprobs_are_bitwise_equal(dtype):
    """Sliding-window layers in the engine's unrolled layers and the learner's layer scan
    (a traced per-layer flag), over a paged cache and packed learner rows: the real
    Gemma 3 270M rows of benchmarks/consistency.py never reach its 512-token window."""
    config = get_preset("tiny", compute_dtype=dtype, exact_numerics=True, **GEMMA3_TINY)
    params = init_params(config, seed=0)
    samples = _generate(_engine(config, "paged2_bucket32_rows2"), params, _requests(512))
    assert max(len(s.prompt_tokens) + len(s.response_tokens) for s in samples.values()) > 24
    samples = [samples[i] for i in sorted(samples)]
    got, want = _learner_logprobs(config, params, samples, **LEARNERS["mb3_packed"])
    assert got.size > 40
    assert np.array_equal(_bits(got), _bits(want)), np.abs(got - want).max()
