"""Chat templates, BOS and stop sets against transformers itself.

Each checkpoint of ``tests/data/chat_models`` (SmolLM2, Qwen2.5, a Qwen2.5 base
whose eos differs from its end of turn, Llama 3.2, DeepSeek-R1-distill, Mistral
v0.3, Gemma 2, a ChatML template with ``{% generation %}`` tags) is loaded by
``transformers.AutoTokenizer`` and by ``Tokenizer.from_hf_dir``; every
conversation must give the same string and the same token ids as
``apply_chat_template(..., tokenize=True)``, and conversations a template
rejects must be rejected by both.
"""

from __future__ import annotations

import pytest

from configs import rlvr_smollm2_arith
from jaxflash.models.text.chat_template import ChatTemplateError, render_chat_template
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from tests.chat_fixtures import NAMES, build_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the reference")
transformers.logging.set_verbosity_error()

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 3 + 4?"}],
    "system": [
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "What is 3 + 4?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Let me see <think>hmm</think> Hello there."},
        {"role": "user", "content": "2+2?\n"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": " Hello. ", "tool_calls": None},
        {"role": "user", "content": "héllo wörld 日本語 🙂 <|im_end|> in text"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Say 7."},
        {"role": "assistant", "content": "7"},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Add 2 and 3."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        ],
    },
    {"role": "tool", "content": "5"},
]

# Hand-derived from each fixture's configs: id -> sources.
EXPECTED_STOPS = {
    "chatml-generation": {0: ("eos_token",), 2: ("chat template end of turn",)},
    "deepseek-r1-distill": {1: ("eos_token", "generation", "template")},
    "gemma": {1: ("eos_token", "generation"), 6: ("generation", "template")},
    "gemma3": {1: ("eos_token", "generation"), 6: ("generation", "template")},
    "llama3": {1: ("generation",), 4: ("generation",), 5: ("eos_token", "generation", "template")},
    "mistral": {2: ("eos_token", "generation", "template")},
    "qwen2.5": {0: ("generation",), 2: ("eos_token", "generation", "template")},
    "qwen2.5-base": {0: ("eos_token", "generation"), 2: ("generation", "template")},
    "qwen3": {0: ("generation",), 2: ("eos_token", "generation", "template")},
    "smollm2": {2: ("eos_token", "generation", "template")},
}
BOS = {
    "deepseek-r1-distill": 0,
    "gemma": 2,
    "gemma3": 2,
    "llama3": 0,
    "mistral": 1,
}  # templates writing bos


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_models")
    out = {}
    for name in NAMES:
        directory = build_checkpoint(name, root)
        hf = transformers.AutoTokenizer.from_pretrained(str(directory))
        out[name] = (hf, Tokenizer.from_hf_dir(directory), directory)
    return out


def _both(hf, ours, messages, gen, **kwargs):
    """(hf ids, hf text) and (our ids, our text); an exception stands for a rejection."""
    try:
        theirs = (
            hf.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, return_dict=False, **kwargs
            ),
            hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False, **kwargs),
        )
    except Exception as e:  # noqa: BLE001 - any rejection counts; ours must reject too
        theirs = e
    try:
        mine = (
            ours.encode_chat(messages, add_generation_prompt=gen, **kwargs),
            ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs),
        )
    except ValueError as e:
        mine = e
    return theirs, mine


@pytest.mark.parametrize("gen", [True, False], ids=["gen_prompt", "no_gen_prompt"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", NAMES)
def test_token_ids_equal_transformers(pairs, name, conversation, gen):
    hf, ours, _ = pairs[name]
    theirs, mine = _both(hf, ours, CONVERSATIONS[conversation], gen)
    if isinstance(theirs, Exception):
        assert isinstance(mine, ValueError), f"transformers rejected ({theirs}); we gave {mine}"
        assert str(theirs) in str(mine)  # the template's own message reaches the user
        return
    assert not isinstance(mine, Exception), f"we rejected what transformers renders: {mine}"
    assert mine[1] == theirs[1]
    assert mine[0] == theirs[0]


def test_every_template_renders_some_conversation(pairs):
    # Guards the parity test against passing because everything is rejected.
    for name in NAMES:
        hf, ours, _ = pairs[name]
        ok = [
            c
            for c in CONVERSATIONS
            if not isinstance(_both(hf, ours, CONVERSATIONS[c], True)[0], Exception)
        ]
        assert len(ok) >= 3, (name, ok)


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama3"])
def test_tools_and_tool_calls_equal_transformers(pairs, name):
    hf, ours, _ = pairs[name]
    for messages in (TOOL_CONVERSATION, CONVERSATIONS["user"]):
        theirs, mine = _both(hf, ours, messages, True, tools=TOOLS)
        assert not isinstance(theirs, Exception) and mine == theirs
    assert '"integer"' in mine[1]  # tojson ran (indent=4 for Llama)


QWEN3_REASONING = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "<think>\n3 plus 4 is 7.\n</think>\n\n7"},
    {"role": "user", "content": "And times 2?"},
    {"role": "assistant", "reasoning_content": "7 * 2 = 14", "content": "14"},
    {"role": "user", "content": "Thanks."},
]


@pytest.mark.parametrize("thinking", [None, True, False], ids=["unset", "on", "off"])
def test_qwen3_thinking_switch_equals_transformers(pairs, thinking):
    hf, ours, _ = pairs["qwen3"]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    theirs, mine = _both(hf, ours, CONVERSATIONS["system"], True, **kwargs)
    assert not isinstance(theirs, Exception) and mine == theirs
    # Off writes an empty think block after the generation prompt; on / unset leave it open.
    assert mine[1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (thinking is False)


def test_qwen3_multi_turn_drops_earlier_reasoning_like_transformers(pairs):
    hf, ours, _ = pairs["qwen3"]
    for messages in (QWEN3_REASONING, QWEN3_REASONING[:4]):
        for gen in (True, False):
            theirs, mine = _both(hf, ours, messages, gen)
            assert not isinstance(theirs, Exception) and mine == theirs
    _, (_, text) = _both(hf, ours, QWEN3_REASONING, True)
    # Turns before the last user query keep their answers and lose their reasoning.
    assert "3 plus 4" not in text and "7 * 2" not in text and "<|im_start|>assistant\n7" in text
    # After the last query (a conversation ending with the assistant) it is kept.
    _, (_, text) = _both(hf, ours, QWEN3_REASONING[:4], False)
    assert "<think>\n7 * 2 = 14\n</think>\n\n14<|im_end|>" in text


def test_gemma3_system_prompt_and_content_parts_equal_transformers(pairs):
    hf, ours, _ = pairs["gemma3"]
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": " What is 3 + 4? "}]},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And 5 + 5?"},
    ]
    for messages in (CONVERSATIONS["system"], parts):
        theirs, mine = _both(hf, ours, messages, True)
        assert not isinstance(theirs, Exception) and mine == theirs
    # The system prompt is folded into the first user turn (Gemma 3 has no system role).
    assert "<start_of_turn>user\nBe brief.\n\nWhat is 3 + 4?<end_of_turn>" in mine[1]
    theirs, mine = _both(hf, ours, [parts[0], parts[2]], True)  # roles must alternate
    assert isinstance(theirs, Exception) and isinstance(mine, ValueError)


def test_gemma_system_role_rejected_with_templates_message(pairs):
    _, ours, _ = pairs["gemma"]
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        ours.encode_chat(CONVERSATIONS["system"])


def test_generation_tags_loopcontrols_and_dict(pairs):
    hf, ours, _ = pairs["chatml-generation"]
    messages = CONVERSATIONS["multi_turn"]
    ids, mask = ours.encode_chat_with_mask(messages)
    out = hf.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == out["input_ids"] and mask == out["assistant_masks"]
    masked = ours.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert masked == messages[2]["content"] + "<|im_end|>"  # the assistant turn, nothing else
    # {% break %} after 7 messages: transformers and we both stop there.
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": str(i)} for i in range(10)]
    assert ours.apply_chat_template(long) == hf.apply_chat_template(
        long, add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\n8" not in ours.apply_chat_template(long)


@pytest.mark.parametrize("name", NAMES)
def test_stop_set_has_every_source(pairs, name):
    hf, ours, directory = pairs[name]
    short = {
        "generation": "generation_config.json eos_token_id",
        "template": "chat template end of turn",
    }
    expected = {
        i: tuple(short.get(s, s) for s in sources) for i, sources in EXPECTED_STOPS[name].items()
    }
    assert dict(ours.stop_set.sources) == expected
    generation = (
        transformers.GenerationConfig.from_pretrained(str(directory))
        if (directory / "generation_config.json").exists()
        else None
    )
    theirs = {hf.eos_token_id}
    if generation is not None:
        eos = generation.eos_token_id
        theirs |= set(eos if isinstance(eos, list) else [eos])
    assert theirs <= ours.stop_ids  # every id transformers' generate() stops on


@pytest.mark.parametrize("name", sorted(BOS))
def test_one_bos_whether_the_tokenizer_adds_bos_or_not(pairs, tmp_path, name):
    hf, ours, _ = pairs[name]
    bos = BOS[name]
    messages = CONVERSATIONS["multi_turn_no_system"]
    assert ours.add_bos and ours.bos_id == bos
    ids = ours.encode_chat(messages)
    assert ids[0] == bos and ids.count(bos) == 1
    # The fault this guards against: render, then encode with special tokens -> two BOS.
    naive = ours.encode(ours.apply_chat_template(messages), add_special_tokens=True)
    assert naive[:2] == [bos, bos]
    # A tokenizer that adds no BOS: the template still writes exactly one,
    # because bos_token is always passed to it (hiding it would give none).
    plain_dir = build_checkpoint(name, tmp_path, adds_bos=False)
    plain = Tokenizer.from_hf_dir(plain_dir)
    hf_plain = transformers.AutoTokenizer.from_pretrained(str(plain_dir))
    assert not plain.add_bos
    ids = plain.encode_chat(messages)
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids == hf_plain.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_plain_encode_follows_the_post_processor_like_transformers(pairs):
    for name in NAMES:
        hf, ours, _ = pairs[name]
        for text in ("hello world", "3 + 4 = 7"):
            assert ours.encode(text, add_special_tokens=True) == hf.encode(text), name
            assert ours.encode(text) == hf.encode(text, add_special_tokens=False), name


def test_response_text_stops_at_first_stop_id(pairs):
    _, ours, _ = pairs["qwen2.5-base"]  # eos <|endoftext|> (0), turns end with <|im_end|> (2)
    ids = ours.encode("The answer is 7.") + [2] + ours.encode(" junk") + [0]
    assert ours.response_text(ids) == "The answer is 7."
    assert ours.response_text(ours.encode("no stop")) == "no stop"


def test_render_errors_are_value_errors():
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render_chat_template("{{ messages }}", [], special_tokens={})
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% if %}", [{"role": "user", "content": "x"}], special_tokens={})
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat_template(
            "{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}], special_tokens={}
        )
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.slow
def test_gguf_template_and_ids_equal_transformers():
    import os

    from jaxflash.models.formats.weights_gguf import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    hf = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    ours = Tokenizer.from_gguf(path)
    assert ours.special_tokens["bos_token"] == hf.bos_token and ours.add_bos is False
    for conversation in CONVERSATIONS.values():
        for gen in (True, False):
            theirs, mine = _both(hf, ours, conversation, gen)
            assert mine == theirs


def test_run_wide_template_kwargs_turn_qwen3_thinking_off(pairs):
    hf, ours, _ = pairs["qwen3"]
    off = ours.with_chat_template(ours.chat_template, template_kwargs={"enable_thinking": False})
    messages = CONVERSATIONS["user"]
    expected = hf.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        enable_thinking=False,
    )
    assert off.encode_chat(messages) == expected != ours.encode_chat(messages)
    assert off.stop_ids == ours.stop_ids
    # A call's own value wins over the run's.
    assert off.encode_chat(messages, enable_thinking=True) == ours.encode_chat(messages)


def test_model_chat_template_kwargs_config_field():
    c = rlvr_smollm2_arith.get_config()
    c.model.chat_template_kwargs = '{"enable_thinking": false}'
    assert ExperimentConfig.from_config_dict(c).model.chat_template_kwargs == {
        "enable_thinking": False
    }
    c.model.chat_template_kwargs = "{enable_thinking: no}"
    with pytest.raises(ConfigError, match="model.chat_template_kwargs is not valid JSON"):
        ExperimentConfig.from_config_dict(c)
    c.model.chat_template_kwargs = "[1, 2]"
    with pytest.raises(ConfigError, match="model.chat_template_kwargs must be a JSON object"):
        ExperimentConfig.from_config_dict(c)
