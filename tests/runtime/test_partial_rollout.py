"""Weight updates during generation: SlotBatcher's in-flight policies continue,
restart and recompute (rl_pitfalls "Restart means restart"), on the tiny fp32 model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.api import EngineApi
from jaxflash.generation.slot_loop import SlotBatcher, run_requests
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.decoder.transformer import forward, init_params, unembed
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams

CFG = get_preset("tiny")  # vocab 512, fp32
NO_EOS = -1  # never sampled: every sample runs to max_new_tokens
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def new_params():
    return init_params(CFG, seed=1)


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(
        max_concurrent_decodes=3, max_prefill_length=16, max_target_length=40, **SAMPLING
    )
    return LlamaEngine(CFG, cfg)


def request(prompt_id, prompt_len, max_new, sample_index=0):
    tokens = (np.arange(prompt_len, dtype=np.int32) * 37 + 11 * prompt_id) % CFG.vocab_size
    return GenerationRequest(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=tokens,
        sampling=SamplingParams(max_new_tokens=max_new, **SAMPLING),
    )


def learner_logprobs(params, sample):
    """log q(response) of the full sequence without a cache, as the learner scores it."""
    ids = np.concatenate([sample.prompt_tokens, sample.response_tokens])[None]
    targets = np.concatenate([ids[:, 1:], np.zeros((1, 1), np.int32)], axis=1)
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    h, _ = forward(params, CFG, jnp.asarray(ids), positions)
    logp = target_logprobs(h, unembed(params, CFG), jnp.asarray(targets), chunk=8, **SAMPLING)[0]
    p = len(sample.prompt_tokens)
    return np.asarray(logp)[0, p - 1 : p - 1 + len(sample.response_tokens)]


def drain(batcher):
    done = []
    while not batcher.idle:
        done += batcher.step()
    return done


@pytest.mark.parametrize("policy", ["continue", "restart", "recompute"])
def test_update_at_version_2_after_2_tokens(engine, params, new_params, policy):
    """A sample with 2 tokens at version 2 gets version-3 weights."""
    batcher = SlotBatcher(engine, params, policy_version=2, eos_id=NO_EOS)
    batcher.add(request(8, 5, 6))
    batcher.step()  # first token from prefill + one generated: 2 tokens at version 2
    batcher.set_params(new_params, 3, in_flight=policy)
    (sample,) = drain(batcher)
    (old,) = run_requests(engine, params, [request(8, 5, 6)], policy_version=2, eos_id=NO_EOS)
    (fresh,) = run_requests(engine, new_params, [request(8, 5, 6)], policy_version=3, eos_id=NO_EOS)
    want_new = learner_logprobs(new_params, sample)
    gap_new = np.abs(sample.behaviour_logprobs[2:] - want_new[2:])
    if policy == "restart":
        assert list(sample.token_versions) == [3, 3, 3, 3, 3, 3] and sample.start_version == 3
        np.testing.assert_array_equal(sample.response_tokens, fresh.response_tokens)
        assert (batcher.stats.restarted, batcher.stats.recomputed) == (1, 0)
        return
    assert list(sample.token_versions) == [2, 2, 3, 3, 3, 3] and sample.start_version == 2
    # The version-2 prefix is kept as generated, with its version-2 logprobs.
    np.testing.assert_array_equal(sample.response_tokens[:2], old.response_tokens[:2])
    np.testing.assert_array_equal(sample.behaviour_logprobs[:2], old.behaviour_logprobs[:2])
    if policy == "recompute":
        # KV cache rebuilt under the new weights: the continuation's behaviour
        # logprobs are the learner's under version 3 for the whole sequence.
        assert gap_new.max() <= 1e-5
        assert (batcher.stats.recomputed, batcher.stats.recompute_tokens) == (1, 5 + 2)
    else:
        # The continuation attends to version-2 keys/values: not the learner's.
        assert gap_new.max() > 1e-3
        assert batcher.stats.recomputed == 0


def test_recompute_under_unchanged_weights_is_bit_identical(engine, params):
    reqs = [request(i, n, 9, sample_index=i % 2) for i, n in enumerate([3, 7, 6, 5, 2])]
    want = run_requests(engine, params, reqs, policy_version=0, eos_id=NO_EOS)
    batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS)
    for r in reqs:
        batcher.add(r)
    done = []
    for version in (1, 2, 3, 4, 5):  # interrupt after each of the first 5 steps
        done += batcher.step()
        batcher.set_params(params, version, in_flight="recompute")
    done += drain(batcher)
    got = {(s.prompt_id, s.sample_index): s for s in done}
    assert batcher.stats.recomputed >= 10  # 3 slots busy for the first 5 updates
    assert batcher.stats.recompute_fallbacks == 0
    for w in want:
        g = got[(w.prompt_id, w.sample_index)]
        np.testing.assert_array_equal(g.response_tokens, w.response_tokens)
        np.testing.assert_allclose(g.behaviour_logprobs, w.behaviour_logprobs, atol=1e-5)
        assert g.start_version <= 5 and np.all(np.diff(g.token_versions) >= 0)


def test_recompute_falls_back_to_restart_when_prefix_too_long(engine, params, new_params):
    batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS)
    batcher.add(request(1, 14, 8))  # 14 + 3 tokens > max_prefill_length 16
    batcher.add(request(2, 4, 8))  # 4 + 3 tokens fits
    batcher.step()
    batcher.step()  # 3 tokens each at version 0
    batcher.set_params(new_params, 1, in_flight="recompute")
    got = {s.prompt_id: s for s in drain(batcher)}
    assert (batcher.stats.recompute_fallbacks, batcher.stats.recomputed) == (1, 1)
    assert batcher.stats.restarted == 0
    assert list(got[1].token_versions) == [1] * 8 and got[1].start_version == 1
    assert list(got[2].token_versions) == [0, 0, 0, 1, 1, 1, 1, 1] and got[2].start_version == 0


def test_abort_while_waiting_for_recompute_returns_the_prefix(engine, params, new_params):
    batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS)
    batcher.add(request(3, 5, 8))
    batcher.step()
    batcher.set_params(new_params, 1, in_flight="recompute")
    assert (3, 0) in batcher
    aborted = batcher.abort((3, 0))
    assert aborted.finish_reason == FinishReason.ABORTED
    assert list(aborted.token_versions) == [0, 0] and aborted.start_version == 0
    assert batcher.idle and (3, 0) not in batcher


def test_prefill_token_index_offset_uses_that_key(engine, params):
    """prefill(token_index=n) draws with key n: resuming from a 3-token prefix
    reproduces the 4th token of an uninterrupted run."""
    (want,) = run_requests(engine, params, [request(5, 6, 5)], policy_version=0, eos_id=NO_EOS)
    seq = np.concatenate([want.prompt_tokens, want.response_tokens[:3]])
    api = EngineApi(engine)  # JetStream's prefill, over the engine's prefiller
    prefix = api.prefill(
        params=params, padded_tokens=seq, true_length=9, prompt_id=5, token_index=3
    )
    token, logp, index = jax.device_get((prefix.first_token, prefix.first_logp, prefix.token_index))
    assert (int(token), int(index)) == (int(want.response_tokens[3]), 3)
    assert abs(float(logp) - float(want.behaviour_logprobs[3])) <= 1e-5
    with pytest.raises(ValueError, match="token_index must be >= 0"):
        api.prefill(params=params, padded_tokens=seq, true_length=9, token_index=-1)
