"""Every end-of-turn id stops generation, through the engine and the reward.

The Qwen2.5-base-style checkpoint of ``tests/data/chat_models`` names
``<|endoftext|>`` (id 0) as eos while its turns end with ``<|im_end|>`` (id 2),
and its generation_config lists both. A model that emits ``<|im_end|>`` must stop
there with finish reason EOS (not run to max_new_tokens and be marked
truncated), and the reward must see only the text before it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.compat import JetStreamTokenizer
from jaxflash.generation.slot_loop import run_requests
from jaxflash.models.config.model_config import reconcile_vocab
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.rewards.math_reward import math_answer_reward
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams
from tests.chat_fixtures import build_checkpoint

IM_END, ENDOFTEXT = 2, 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_hf_dir(build_checkpoint("qwen2.5-base", tmp_path_factory.mktemp("q")))


def _run(tokenizer, **stop):
    config = reconcile_vocab(
        get_preset("tiny", vocab_size=tokenizer.vocab_size, max_seq_len=256), tokenizer.vocab_size
    )
    params = init_params(config, seed=1)
    embed = np.asarray(params["embed_vd"]).copy()
    embed[IM_END] *= 300.0  # this model ends its turn with <|im_end|> at once
    params = {**params, "embed_vd": jnp.asarray(embed)}
    engine = LlamaEngine(
        config,
        EngineConfig(max_concurrent_decodes=2, max_prefill_length=128, max_target_length=136),
    )
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is 3 + 4?"}])
    request = GenerationRequest(
        prompt_id=0,
        sample_index=0,
        prompt_tokens=np.asarray(prompt, np.int32),
        sampling=SamplingParams(max_new_tokens=6),
    )
    (sample,) = run_requests(engine, params, [request], policy_version=0, **stop)
    return sample


def test_end_of_turn_stops_with_eos(tokenizer):
    assert tokenizer.eos_id == ENDOFTEXT and tokenizer.stop_ids == {ENDOFTEXT, IM_END}
    sample = _run(tokenizer, stop_ids=tokenizer.stop_ids)
    assert sample.finish_reason == FinishReason.EOS and not sample.truncated
    assert sample.response_tokens.tolist() == [IM_END]
    assert tokenizer.response_text(sample.response_tokens) == ""
    # The fault: stopping on eos alone runs to max_new_tokens, marked truncated.
    old = _run(tokenizer, eos_id=tokenizer.eos_id)
    assert old.finish_reason == FinishReason.LENGTH and old.response_tokens.tolist() == [IM_END] * 6


def test_reward_never_sees_the_stop_token_or_what_follows(tokenizer):
    ids = (
        tokenizer.encode("so the answer is \\boxed{7}") + [IM_END] + tokenizer.encode("\\boxed{8}")
    )
    text = tokenizer.response_text(ids)
    assert text == "so the answer is \\boxed{7}"
    assert math_answer_reward(text, "7").score == 1.0
    assert math_answer_reward(tokenizer.decode(ids), "7").score == 0.0  # both boxes seen


def test_jetstream_server_stops_on_the_stop_set(tokenizer):
    assert JetStreamTokenizer(tokenizer, max_prefill_length=8).stop_tokens == {ENDOFTEXT, IM_END}
