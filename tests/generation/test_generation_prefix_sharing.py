"""Prefix sharing in the slot loop: G samples of one prompt reuse one prefill, with
tokens and behaviour logprobs bit-identical to prefilling every sample alone."""

import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.api import EngineApi
from jaxflash.generation.slot_loop import SlotBatcher, run_requests
from jaxflash.generation.slot_types import SlotStats
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.types import GenerationRequest, SamplingParams

CFG = get_preset("tiny")  # vocab 512, fp32
NO_EOS = -1
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=16, max_target_length=40, **SAMPLING
    )
    return LlamaEngine(CFG, cfg)


def request(prompt_id, sample_index, prompt_len, max_new, seed=0):
    tokens = (np.arange(prompt_len, dtype=np.int32) * 37 + 11 * prompt_id) % CFG.vocab_size
    return GenerationRequest(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=tokens,
        sampling=SamplingParams(max_new_tokens=max_new, **SAMPLING),
        seed=seed,
    )


def group_requests():
    """3 prompts x 3 samples, lengths differ so slots free at different steps; with 4
    slots the groups are split across fills (the prefill is reused across fills)."""
    return [
        request(p, g, n, 3 + 2 * g + p, seed=5) for p, n in enumerate([5, 9, 16]) for g in range(3)
    ]


def test_sharing_is_bit_identical_and_prefills_once_per_prompt(engine, params):
    reqs = group_requests()
    off, on = SlotStats(), SlotStats()
    want = run_requests(
        engine, params, reqs, policy_version=0, eos_id=NO_EOS, stats=off, share_prefix=False
    )
    got = run_requests(engine, params, reqs, policy_version=0, eos_id=NO_EOS, stats=on)
    for w, g in zip(want, got, strict=True):
        assert (g.prompt_id, g.sample_index) == (w.prompt_id, w.sample_index)
        assert g.response_tokens.tobytes() == w.response_tokens.tobytes()
        assert g.behaviour_logprobs.tobytes() == w.behaviour_logprobs.tobytes()
    assert (off.prefills, off.shared_prefills) == (9, 0)
    assert (on.prefills, on.shared_prefills) == (3, 6)
    # Each sample drew its own first token: the 3 samples of a prompt are not copies.
    firsts = [{int(s.response_tokens[0]) for s in got[3 * p : 3 * p + 3]} for p in range(3)]
    assert any(len(f) > 1 for f in firsts), firsts


def test_new_params_drop_the_shared_prefill(params):
    """rl_pitfalls: a prefix is reused only under the params it ran with. One slot,
    3 samples of one prompt: s0 runs under v0; after set_params s1 and s2 must be
    prefilled again under v1 and equal a fresh v1 run."""
    new_params = init_params(CFG, seed=1)
    one_slot = LlamaEngine(
        CFG,
        EngineConfig(
            max_concurrent_decodes=1, max_prefill_length=16, max_target_length=40, **SAMPLING
        ),
    )
    batcher = SlotBatcher(one_slot, params, policy_version=0, eos_id=NO_EOS)
    reqs = [request(4, g, 7, 3) for g in range(3)]
    for r in reqs:
        batcher.add(r)
    done = []
    while len(done) < 1:
        done += batcher.step()
    assert (batcher.stats.prefills, batcher.stats.shared_prefills) == (1, 0)
    batcher.set_params(new_params, 1)
    while not batcher.idle:
        done += batcher.step()
    # s1 re-prefilled under v1, s2 reused s1's v1 prefill.
    assert (batcher.stats.prefills, batcher.stats.shared_prefills) == (2, 1)
    fresh = run_requests(
        one_slot, new_params, reqs[1:], policy_version=1, eos_id=NO_EOS, share_prefix=False
    )
    for sample, want in zip(done[1:], fresh, strict=True):
        assert list(sample.token_versions) == [1, 1, 1]
        assert sample.response_tokens.tobytes() == want.response_tokens.tobytes()
        assert sample.behaviour_logprobs.tobytes() == want.behaviour_logprobs.tobytes()


def test_recompute_prefills_each_running_sample_alone(engine, params):
    """Running samples of one prompt have different prefixes: recompute re-prefills
    each (no sharing) and, with unchanged weights, matches an uninterrupted run."""
    reqs = [request(6, g, 5, 6) for g in range(2)]
    want = run_requests(engine, params, reqs, policy_version=0, eos_id=NO_EOS)
    batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS)
    for r in reqs:
        batcher.add(r)
    batcher.step()
    assert batcher.stats.prefills == 1
    batcher.set_params(params, 1, in_flight="recompute")
    done = []
    while not batcher.idle:
        done += batcher.step()
    assert batcher.stats.prefills == 3 and batcher.stats.recomputed == 2
    for sample, w in zip(sorted(done, key=lambda s: s.sample_index), want, strict=True):
        np.testing.assert_array_equal(sample.response_tokens, w.response_tokens)


def test_first_tokens_needs_identities(engine, params):
    shared = engine.prefiller.prefill_prompt(
        params=params, padded_tokens=np.arange(3), true_length=3
    )
    with pytest.raises(ValueError, match="identities is empty"):
        EngineApi(engine).first_tokens(shared, [])
