"""Tokenizer from the SmolLM2 GGUF: known ids, digit splitting, specials, ChatML, HF files.

Expected ids were read by hand from the GGUF vocabulary (``tokenizer.ggml.tokens``);
``test_known_ids_match_raw_gguf_vocab`` re-checks them against the raw token list,
without going through ``tokenizers``.
"""

import pytest

from jaxflash.models.formats.weights_gguf import smollm2_gguf_path
from jaxflash.models.text.tokenizer import Tokenizer

try:
    GGUF_PATH = smollm2_gguf_path()
except FileNotFoundError as e:  # pragma: no cover - depends on the environment
    pytest.skip(str(e), allow_module_level=True)

# text -> (ids, tokens as stored in the GGUF vocab; Ġ = space, Ċ = newline)
KNOWN = {
    "12345": ([33, 34, 35, 36, 37], ["1", "2", "3", "4", "5"]),
    "Hello world": ([19556, 905], ["Hello", "Ġworld"]),
    " the": ([260], ["Ġthe"]),
    "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n": (
        [1, 4093, 198, 1780, 314, 216, 35, 1232, 216, 36, 47, 2, 198],
        ["<|im_start|>", "user", "Ċ", "What", "Ġis", "Ġ", "3", "Ġ+", "Ġ", "4", "?"]
        + ["<|im_end|>", "Ċ"],
    ),
}

CHATML_USER_ONLY = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is 3 + 4? Answer with just the number.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(GGUF_PATH)


def test_special_ids(tok):
    # bos_token is the GGUF's bos_token_id (<|im_start|>), as transformers reads it,
    # but the file says add_bos_token=False: plain encoding never adds it.
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (2, 2, 1, 49152)
    assert tok.add_bos is False
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    # <|im_end|> is both the eos and the template's end of turn; nothing else stops.
    assert tok.stop_ids == {2}
    assert tok.stop_set.sources[2] == ("eos_token", "chat template end of turn")
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]


@pytest.mark.parametrize("text", list(KNOWN))
def test_known_ids(tok, text):
    assert tok.encode(text) == KNOWN[text][0]


def test_known_ids_match_raw_gguf_vocab():
    import gguf

    vocab = gguf.GGUFReader(GGUF_PATH).fields["tokenizer.ggml.tokens"].contents()
    for ids, tokens in KNOWN.values():
        assert [vocab[i] for i in ids] == tokens


def test_digits_split_individually(tok):
    assert len(tok.encode("12345")) == 5
    # " 2024" -> "Ġ" then four single digits (the Digits pre-tokenizer runs first).
    assert tok.encode(" 2024") == [216, 34, 32, 34, 36]


@pytest.mark.parametrize(
    "text",
    [
        "3 + 4 = 7, and 12345 * 678 = 8369910",
        "héllo wörld — 日本語 ✓ 🙂",
        "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n<|endoftext|>",
        "  leading spaces\n\ttabs\n\n",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_specials_recognised_and_skippable(tok):
    ids = tok.encode("x<|im_end|>y")
    assert ids == [104, 2, 105]
    assert tok.decode(ids, skip_special_tokens=True) == "xy"
    assert tok.decode(ids) == "x<|im_end|>y"


def test_chatml_rendering(tok):
    msgs = [{"role": "user", "content": "What is 3 + 4? Answer with just the number."}]
    assert tok.apply_chat_template(msgs) == CHATML_USER_ONLY
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert no_gen == CHATML_USER_ONLY.removesuffix("<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    assert tok.apply_chat_template(with_system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3 + 4? Answer "
        "with just the number.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bad_inputs(tok):
    with pytest.raises(TypeError, match="text must be str"):
        tok.encode([1, 2])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([49152])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])


def test_template_raise_exception_is_value_error(tok):
    strict = Tokenizer(
        tok.hf_tokenizer,
        special_tokens={"eos_token": "<|im_end|>"},
        chat_template="{{ raise_exception('only user turns') }}",
    )
    with pytest.raises(ValueError, match="only user turns"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_dir_round_trip(tok, tmp_path):
    tok.save_hf(tmp_path)
    again = Tokenizer.from_hf_dir(tmp_path)
    assert (again.eos_id, again.pad_id, again.bos_id, again.vocab_size) == (2, 2, 1, 49152)
    assert (again.add_bos, again.stop_ids) == (False, tok.stop_ids)
    for text, (ids, _) in KNOWN.items():
        assert again.encode(text) == ids
    msgs = [{"role": "user", "content": "What is 3 + 4? Answer with just the number."}]
    assert again.apply_chat_template(msgs) == CHATML_USER_ONLY


def test_hf_dir_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
