"""Padded vocabularies: config.json's vocab_size 31, a tokenizer of 23 ids.

Ids 23..30 are embedding rows no token maps to. They must never be sampled
(the engine and the learner mask them in the one shared distribution, so the
importance ratio of an unchanged policy stays 1), decoding a response never
meets one, and a tokenizer larger than the model is refused at load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from jaxflash.algorithms.distributions import NEG_INF, processed_log_softmax
from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.slot_loop import run_requests
from jaxflash.models.config.model_config import reconcile_vocab
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.decoder.transformer import forward, init_params, unembed
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams

WORDS = ["<pad>", "<eos>", "<end>"] + [f"w{i}" for i in range(20)]  # 23 ids


def _tokenizer() -> Tokenizer:
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in WORDS[:3]]
    )
    return Tokenizer(
        tok,
        special_tokens={"eos_token": "<eos>", "pad_token": "<pad>"},
        stop_sources=[("generation_config.json eos_token_id", [1, 2])],
    )


def _padded_model(valid: int | None):
    """A tiny model with 31 rows whose padded rows (23..30) would win every draw."""
    config = get_preset("tiny", vocab_size=31, max_seq_len=64)
    params = init_params(config, seed=0)
    embed = np.asarray(params["embed_vd"]).copy()
    embed[23:] *= 200.0  # tied embeddings: padded logits dwarf the real ones
    params = {**params, "embed_vd": jnp.asarray(embed)}
    return config.replace(valid_vocab_size=valid), params


def test_masked_before_top_k_and_top_p():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 9.0, 8.0]])  # ids 3, 4 are padding
    logq = processed_log_softmax(logits, top_k=2, top_p=0.99, valid_vocab_size=3)
    q = np.exp(np.asarray(logq[0], np.float64))
    np.testing.assert_array_equal(np.asarray(logq)[0, 3:], np.float32([NEG_INF, NEG_INF]))
    np.testing.assert_allclose(q[:3], [0, 1 / (1 + np.e), np.e / (1 + np.e)], rtol=1e-6)
    with pytest.raises(ValueError, match="valid_vocab_size"):
        processed_log_softmax(logits, valid_vocab_size=6)


@pytest.mark.parametrize("greedy", [False, True])
def test_engine_never_samples_padding_and_ratio_is_one(greedy):
    tokenizer = _tokenizer()
    config, params = _padded_model(None)
    config = reconcile_vocab(config, tokenizer.vocab_size)
    assert (config.vocab_size, config.valid_vocab_size) == (31, 23)
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12)
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=4, max_prefill_length=8, max_target_length=24, greedy=greedy
        ),
    )
    prompt = np.asarray(tokenizer.encode("w1 w2 w3"), np.int32)
    requests = [
        GenerationRequest(prompt_id=p, sample_index=0, prompt_tokens=prompt, sampling=sampling)
        for p in range(6)
    ]
    samples = run_requests(engine, params, requests, policy_version=0, stop_ids=tokenizer.stop_ids)
    tokens = np.concatenate([s.response_tokens for s in samples])
    assert tokens.max() < 23 and len(tokens) >= 6
    for s in samples:  # nothing crashes turning a response into reward text
        assert isinstance(tokenizer.response_text(s.response_tokens), str)
        if s.finish_reason == FinishReason.EOS:
            assert s.response_tokens[-1] in tokenizer.stop_ids
    # The learner scores the same masked distribution: ratio exp(logp - mu) == 1.
    s = samples[0]
    ids = np.concatenate([s.prompt_tokens, s.response_tokens])[None]
    h, _ = forward(params, config, jnp.asarray(ids[:, :-1]), jnp.arange(ids.shape[1] - 1)[None])
    logp, _ = target_logprobs(
        h, unembed(params, config), jnp.asarray(ids[:, 1:]), valid_vocab_size=23, chunk=8
    )
    learner = np.asarray(logp)[0, len(s.prompt_tokens) - 1 :]
    np.testing.assert_allclose(learner, s.behaviour_logprobs, atol=2e-5)


def test_without_the_mask_padding_wins():
    # The fault the mask prevents: the same model, unmasked, samples padded ids.
    config, params = _padded_model(None)
    engine = LlamaEngine(
        config, EngineConfig(max_concurrent_decodes=2, max_prefill_length=8, max_target_length=24)
    )
    request = GenerationRequest(
        prompt_id=0,
        sample_index=0,
        prompt_tokens=np.asarray([3, 4, 5], np.int32),
        sampling=SamplingParams(max_new_tokens=8),
    )
    (sample,) = run_requests(engine, params, [request], policy_version=0, eos_id=1)
    assert sample.response_tokens.max() >= 23
    with pytest.raises(ValueError, match="out of range"):
        _tokenizer().decode(sample.response_tokens)


def test_reconcile_vocab():
    config = get_preset("tiny", vocab_size=31)
    assert reconcile_vocab(config, 31).valid_vocab_size is None
    assert reconcile_vocab(config, 23).valid_vocab_size == 23
    with pytest.raises(ValueError, match=r"tokenizer has 40 ids but the model's vocab_size is 31"):
        reconcile_vocab(config, 40)
    with pytest.raises(ValueError, match="valid_vocab_size"):
        config.replace(valid_vocab_size=32)


def test_load_hf_checkpoint_with_padded_vocab(tmp_path):
    from jaxflash.models.formats.weights_hf import load_hf, save_hf

    tokenizer = _tokenizer()
    config, params = _padded_model(None)
    save_hf(tmp_path, config, jax.device_get(params), tokenizer)
    loaded, _ = load_hf(tmp_path)
    again = Tokenizer.from_hf_dir(tmp_path)
    assert (loaded.vocab_size, again.vocab_size) == (31, 23)
    assert reconcile_vocab(loaded, again.vocab_size).valid_vocab_size == 23
    assert again.stop_ids == {1, 2}  # written to generation_config.json by save_hf
