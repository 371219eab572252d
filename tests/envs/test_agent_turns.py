"""An agent session's turns with a template that renders tools itself (Qwen2.5's, real
template, fixture tokenizer): tools reach the template, the reply's <tool_call> block is
parsed, the echoed call and the tool result become the template's own delta."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxflash.envs.agent_chat import RequestError, ToolFormat, parse_chat_request
from jaxflash.envs.agent_turns import SessionTurns
from jaxflash.envs.chat import TurnRenderer
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.types import FinishReason, Sample, SamplingParams
from tests.chat_fixtures import build_checkpoint

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return Tokenizer.from_hf_dir(build_checkpoint("qwen2.5", tmp_path_factory.mktemp("q")))


def _sample(tok, text, prompt):
    ids = np.asarray([*tok.encode(text), tok.token_to_id("<|im_end|>")], np.int32)
    return Sample(
        prompt_id=0, sample_index=0, prompt_tokens=np.asarray(prompt, np.int32),
        response_tokens=ids, behaviour_logprobs=np.full(ids.shape, -1.0, np.float32),
        token_versions=np.zeros(ids.shape, np.int32), start_version=0,
        finish_reason=FinishReason.EOS,
    )  # fmt: skip


def test_native_tool_template_round_trip(qwen):
    base = TurnRenderer(qwen)
    fmt = ToolFormat(qwen)
    assert fmt.native
    turns = SessionTurns(base, fmt, session_id="s0", model_name="m")
    first = [{"role": "user", "content": "7*8?"}]
    turns.begin(parse_chat_request({"model": "m", "messages": first, "tools": TOOLS}))
    prompt = turns.first_prompt("")
    text = qwen.decode(prompt)
    assert "<tools>" in text and '"name": "python"' in text  # the template's own tool block
    sampled = '<tool_call>\n{"name": "python", "arguments": {"code": "print(7*8)"}}\n</tool_call>'
    sample = _sample(qwen, sampled, prompt)
    turns.observe_turn(sample)
    reply = turns.reply(turns.response_text(sample.response_tokens))
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"code": "print(7*8)"}
    echoed = [*first, message, {"role": "tool", "tool_call_id": "x", "content": "56"}]
    turns.extend(parse_chat_request({"model": "m", "messages": echoed, "tools": TOOLS}))
    assert turns.counters["agent_echo_mismatch"] == 0
    assert turns.counters["agent_retokenized_differently"] == 0  # same ids from the template
    delta = qwen.decode(turns.between_turns("", ended_with_eot=True))
    assert delta == (
        "\n<|im_start|>user\n<tool_response>\n56\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert turns.turn_sampling(SamplingParams(max_new_tokens=64)).max_new_tokens == 64
    with pytest.raises(RequestError, match="history rewritten") as info:
        turns.extend(parse_chat_request({"model": "m", "messages": echoed[:1] + echoed}))
    assert info.value.code == "history_rewritten"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 3}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [1]}, "tools"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ],
)
def test_malformed_requests_name_their_parameter(body, param):
    with pytest.raises(RequestError) as info:
        parse_chat_request(body)
    assert info.value.param == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}
