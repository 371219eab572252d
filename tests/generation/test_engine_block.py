"""Block decoding, batched starts, fixed-row prefill and the engine's param layout,
on the tiny fp32 model: same tokens and logprobs whatever the block size or batch
composition; refills, aborts and weights apply at block boundaries."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig, SampleStart
from jaxflash.generation.sampling import argmax_first, sample_key, sample_tokens
from jaxflash.generation.slot_loop import SlotBatcher, run_requests
from jaxflash.generation.slot_types import SLOT_EVENT_HISTORY, SlotStats, record_slot_event
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params, stack_layers, unstack_layers
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams

CFG = get_preset("tiny")  # vocab 512, fp32
NO_EOS = -1


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def engine():
    return LlamaEngine(
        CFG, EngineConfig(max_concurrent_decodes=3, max_prefill_length=16, max_target_length=40)
    )


def request(prompt_id, prompt_len, max_new, sample_index=0, seed=0):
    tokens = (np.arange(prompt_len, dtype=np.int32) * 37 + 11 * prompt_id) % CFG.vocab_size
    return GenerationRequest(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=tokens,
        sampling=SamplingParams(max_new_tokens=max_new),
        seed=seed,
    )


def same_samples(got, want):
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_id, g.sample_index, g.finish_reason) == (
            w.prompt_id,
            w.sample_index,
            w.finish_reason,
        )
        assert g.response_tokens.tobytes() == w.response_tokens.tobytes()
        assert g.behaviour_logprobs.tobytes() == w.behaviour_logprobs.tobytes()


@pytest.mark.parametrize("block", [2, 5, 16])
def test_block_decoding_is_bit_identical_to_single_steps(engine, params, block):
    reqs = [request(i, 3 + 2 * i, n) for i, n in enumerate([3, 9, 4, 6, 2, 8, 5])]
    one, many = SlotStats(), SlotStats()
    want = run_requests(
        engine, params, reqs, policy_version=0, eos_id=NO_EOS, stats=one, decode_block=1
    )
    got = run_requests(
        engine, params, reqs, policy_version=0, eos_id=NO_EOS, stats=many, decode_block=block
    )
    same_samples(got, want)
    # Every sample's tokens came out; fewer host round trips, more idle slot-steps.
    assert (
        many.generated_tokens == one.generated_tokens == sum(len(s.response_tokens) for s in want)
    )
    assert many.steps >= one.steps and many.occupancy <= one.occupancy


def test_eos_inside_a_block_stops_only_that_slot(engine, params):
    ref = run_requests(engine, params, [request(0, 5, 12)], policy_version=0, eos_id=NO_EOS)[0]
    eos = int(ref.response_tokens[4])  # the 5th token ends the sample
    first = int(np.argmax(ref.response_tokens == eos))
    reqs = [request(0, 5, 12), request(1, 6, 12)]
    got = run_requests(engine, params, reqs, policy_version=0, eos_id=eos, decode_block=8)
    assert got[0].finish_reason == FinishReason.EOS
    np.testing.assert_array_equal(got[0].response_tokens, ref.response_tokens[: first + 1])
    want = run_requests(engine, params, reqs, policy_version=0, eos_id=eos, decode_block=1)
    same_samples(got, want)


def test_block_finish_and_refill_steps(engine, params):
    """3 slots, block of 4: a slot freed at step k of a block is refilled when the
    next block starts (its release and fill step counts differ), not at once."""
    batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS, decode_block=4)
    for i, n in enumerate([3, 12, 12, 6]):
        batcher.add(request(i, 4, n))
    done = batcher.step()  # sample 0: 1 token from prefill + 2 decode steps
    assert [(s.prompt_id, len(s.response_tokens)) for s in done] == [(0, 3)]
    assert batcher.stats.slot_releases == [(2, 0, (0, 0))]  # released at step 2
    assert batcher.stats.steps == 4
    batcher.step()
    assert batcher.stats.slot_fills[-1] == (4, 0, (3, 0))  # refilled when block 2 began
    assert batcher.stats.fills == len(batcher.stats.slot_fills) == 4
    # An abort between calls frees the slot for the next block; new weights apply
    # from the next block on (every token of the next block carries version 1).
    aborted = batcher.abort((1, 0))
    assert aborted.finish_reason == FinishReason.ABORTED and len(aborted.response_tokens) == 9
    batcher.set_params(init_params(CFG, seed=1), 1)
    rest = []
    while not batcher.idle:
        rest += batcher.step()
    by_id = {s.prompt_id: s for s in rest}
    assert list(by_id[2].token_versions) == [0] * 9 + [1] * 3
    assert list(by_id[3].token_versions) == [0] * 5 + [1] * 1


def test_block_ends_early_once_every_slot_stopped(engine, params):
    stats = SlotStats()
    run_requests(
        engine,
        params,
        [request(0, 4, 3)],
        policy_version=0,
        eos_id=NO_EOS,
        stats=stats,
        decode_block=64,
    )
    assert stats.steps == 2  # not 64: the loop exits when no slot is live


def test_start_samples_validates_slots(engine, params):
    (prefill,) = engine.prefiller.prefill_many(params, [np.arange(4)])
    start = SampleStart(
        prefill=prefill, slot=3, seed=0, prompt_id=0, sample_index=0, token_index=0, budget=1
    )
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        engine.start_samples(engine.init_decode_state(), [start])
    with pytest.raises(ValueError, match="decode_block must be >= 1"):
        SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS, decode_block=0)


def test_compiles_once_per_block_size_and_start_shape(params):
    engine = LlamaEngine(
        CFG, EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_target_length=40)
    )
    reqs = [request(i, 5, 6, sample_index=g) for i in range(3) for g in range(2)]
    for seed in (0, 1):  # a second round compiles nothing new
        seeded = [dataclasses.replace(r, seed=seed) for r in reqs]
        run_requests(engine, params, seeded, policy_version=0, eos_id=NO_EOS, decode_block=4)
        if seed == 0:
            counts = engine.trace_counts
    assert engine.trace_counts == counts
    assert counts["generate_block_4"] == 1 and counts["prefill_1x16"] == 1


@pytest.mark.parametrize("rows", [4, 8])
def test_fixed_prefill_rows_make_results_independent_of_companions(params, rows):
    """Alone, the target is prefilled in a padded group of ``rows``; in a crowd, it
    fills a group with rows - 1 other prompts. XLA rounds a [1, T] and a [rows, T]
    prefill differently on this model, so only a fixed row count gives equal bits."""
    engine = LlamaEngine(
        CFG,
        EngineConfig(
            max_concurrent_decodes=4, max_prefill_length=16, max_target_length=40, prefill_rows=rows
        ),
    )
    target = request(9, 7, 10)
    alone = run_requests(engine, params, [target], policy_version=0, eos_id=NO_EOS)[0]
    crowd = [request(i, 7 + (i % 3), 10) for i in range(rows - 1)]  # same bucket
    with_others = run_requests(engine, params, [*crowd, target], policy_version=0, eos_id=NO_EOS)
    same_samples([with_others[-1]], [alone])
    one_row = LlamaEngine(
        CFG, EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_target_length=40)
    )
    ref = run_requests(one_row, params, [target], policy_version=0, eos_id=NO_EOS)[0]
    np.testing.assert_allclose(alone.behaviour_logprobs, ref.behaviour_logprobs, atol=1e-5)


# Long-prefill attention: the tiny model at a 512-token bucket (two of the blockwise
# path's 256-key blocks on CPU), and its qk-norm and sliding-window (Gemma 3) variants.
LONG = {
    "llama": CFG.replace(max_seq_len=1024),
    "qwen3_qk_norm": CFG.replace(max_seq_len=1024, qk_norm=True, head_dim=24, qkv_bias=True),
    "gemma3_window": CFG.replace(
        max_seq_len=1024, qk_norm=True, norm_offset=1.0, mlp_activation="gelu_tanh",
        sandwich_norm=True, scale_embeddings=True, query_pre_attn_scalar=24.0,
        sliding_window=100, layer_types=("sliding_attention", "full_attention"),
        rope_local_theta=100.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "family",  # gemma3 (qk norm, sliding + full layers) in the fast suite; the others slow
    [f if f == "gemma3_window" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(LONG)],
)
def test_a_bucket_above_prefill_dense_max_attends_in_o_t_and_matches_dense(family):
    """prefill_dense_max=256: the 512 bucket attends through model.attention ("auto":
    blockwise here), with no [T, T] scores, and gives the dense prefill's cache and
    last-position logits to float32 rounding (5e-5; measured <= 1e-5). The first layer's
    cache is bit-identical: its k/v come before any attention."""
    config = LONG[family]
    params = jax.tree.map(lambda x: 4 * x if x.ndim > 1 else x, init_params(config, seed=1))
    base = EngineConfig(max_concurrent_decodes=2, max_prefill_length=512, max_target_length=520)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 512), dtype=np.int32)
    lengths = np.asarray([512, 300], np.int32)
    out = {}
    for name, dense_max in (("dense", 1024), ("o_t", 256)):
        engine = LlamaEngine(config, dataclasses.replace(base, prefill_dense_max=dense_max))
        placed = engine.place_params(params)
        lowered = engine.prefill_jit.lower(placed, ids, lengths)
        assert ("2x2x512x512xf32" in lowered.as_text()) == (name == "dense"), name  # [N,K,G,T,T]
        out[name] = lowered.compile()(placed, ids, lengths)
    dense, o_t = out["dense"], out["o_t"]
    np.testing.assert_allclose(o_t.logits_nv, dense.logits_nv, atol=5e-5, rtol=0)
    leaves = zip(jax.tree.leaves(o_t.cache), jax.tree.leaves(dense.cache), strict=True)
    for i, (a, b) in enumerate(leaves):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=0, err_msg=f"cache buffer {i}")
    for a, b in (
        (o_t.cache.k_bksh[0], dense.cache.k_bksh[0]),
        (o_t.cache.v_bkhs[0], dense.cache.v_bkhs[0]),
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_place_params_unstacks_once_and_is_idempotent(engine, params):
    placed = engine.place_params(params)
    assert isinstance(placed["layers"], tuple) and len(placed["layers"]) == CFG.n_layers
    assert placed["layers"][1]["w_q_ldnh"].shape == params["layers"]["w_q_ldnh"].shape[1:]
    again = engine.place_params(placed)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed), strict=True))
    back = stack_layers(placed)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    host = engine.place_params(jax.tree.map(np.asarray, params))
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(placed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert unstack_layers(placed) is placed


def test_sampling_equals_jax_random_categorical_bit_for_bit():
    """The materialised-noise sampler draws exactly what jax.random.categorical draws."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (16, 512)) * 3
    keys = jax.vmap(sample_key)(
        np.zeros(16, np.int32), np.arange(16), np.zeros(16, np.int32), np.arange(16)
    )
    token, logp = sample_tokens(logits, keys, temperature=1.0, top_k=0, top_p=1.0, greedy=False)
    logq = jax.nn.log_softmax(logits, axis=-1)
    want = jax.vmap(jax.random.categorical)(keys, logq)
    np.testing.assert_array_equal(token, want)
    np.testing.assert_array_equal(
        logp, np.take_along_axis(np.asarray(logq), np.asarray(want)[:, None], 1)[:, 0]
    )
    x = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -3.0, -0.5]], np.float32)
    np.testing.assert_array_equal(argmax_first(x), np.argmax(x, axis=-1))  # first of ties


def test_slot_event_lists_are_bounded():
    """A server's fill/release history is bounded (it used to grow by one entry per
    sample for the server's whole life); the newest events are the ones kept."""
    events: list = []
    for i in range(5 * SLOT_EVENT_HISTORY + 3):
        record_slot_event(events, (i, 0, (i, 0)))
        assert len(events) <= SLOT_EVENT_HISTORY
    assert events[-1] == (5 * SLOT_EVENT_HISTORY + 2, 0, (5 * SLOT_EVENT_HISTORY + 2, 0))
    steps = [e[0] for e in events]
    assert steps == list(range(steps[0], steps[-1] + 1))  # a contiguous newest window
