"""Every model family against transformers (an independent implementation).

For each family a tiny random-weight model is built by transformers 5 from a config
(no download), saved with ``save_pretrained`` and imported with ``load_hf``; fp32
logits on prompts of several lengths must agree within 1e-5 x max|logit|. Our HF
export (``save_hf``) is read back by transformers with the same logits, and by
``load_hf`` bit for bit. Weights are redrawn with a larger spread than HF's 0.02
init (norm weights too), so attention is far from uniform and a wrong mask, RoPE
frequency, norm offset or head layout moves the logits by O(1).

Families and what each exercises: llama3 (Llama 3.1 ``rope_type: llama3``, wavelengths
on both sides of the cutoffs), qwen2 (q/k/v biases), qwen3 (q/k norm, head_dim !=
D / N), mistral (sliding window 4 on every layer, shorter than the prompts), gemma3
(sliding + full layers with their own RoPE bases, (1 + w) norms, sandwich norms,
GeGLU, sqrt(D) embeddings, query_pre_attn_scalar != head_dim, tied head).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder import transformer
from jaxflash.models.decoder.logprobs import logits_from_hidden
from jaxflash.models.formats.hf_config import config_from_hf_dict, hf_model_type
from jaxflash.models.formats.weights_hf import load_hf, save_hf

torch = pytest.importorskip("torch", reason="crosscheck extra (torch) not installed")
transformers = pytest.importorskip(
    "transformers", reason="crosscheck extra (transformers) not installed"
)

_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "llama3": (
        "llama",
        dict(
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=24, rope_theta=1e6)),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=4, rope_theta=1e4)),
    "gemma3": (
        "gemma3_text",
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_theta=1e6,
            rope_local_base_freq=100.0,
        ),
    ),
}
PROMPTS = [[7, 3, 200], [5, 17, 250, 2, 99, 42, 7], [1, 9, 4, 33, 8, 8, 120, 61, 5, 14, 77, 3]]


def _hf_model(family: str):
    model_type, extra = FAMILIES[family]
    cfg = transformers.AutoConfig.for_model(model_type, **{**_SHAPE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms are offsets from 1; others scale directly
                centre = 0.0 if family == "gemma3" else 1.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.ndim == 2 and "embed" not in name else 1
                std = 0.5 if fan_in == 1 else 1.5 / fan_in**0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model


def _hf_logits(model, prompts):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in prompts]


_forward = jax.jit(
    lambda params, config, ids, pos: logits_from_hidden(
        transformer.forward(params, config, ids, pos)[0], transformer.unembed(params, config)
    ),
    static_argnums=1,
)


def _our_logits(config: ModelConfig, params, prompts):
    """One right-padded batch (causal: padding never reaches earlier positions)."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
    out = np.asarray(_forward(params, config, jnp.asarray(ids), jnp.asarray(pos)))
    return [out[i, : len(p)] for i, p in enumerate(prompts)]


def _assert_close(ours, theirs, what):
    scale = max(float(np.max(np.abs(t))) for t in theirs)
    gap = max(float(np.max(np.abs(o - t))) for o, t in zip(ours, theirs, strict=True))
    print(f"{what}: max |logit gap| {gap:.2e}, max |logit| {scale:.1f}")
    assert scale > 1.0  # the redrawn weights give informative logits
    # A layout / RoPE / mask / norm error gives gaps of O(1) here; float32 rounding
    # of two implementations of the same sums stays orders of magnitude below.
    assert gap <= 1e-5 * scale


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its directory, our config, our params)."""
    name = request.param
    model = _hf_model(name)
    directory = tmp_path_factory.mktemp(f"hf_{name}")
    model.save_pretrained(directory)
    config, params = load_hf(directory)
    return name, model, directory, config, params


def test_import_matches_transformers(family):
    name, model, _, config, params = family
    assert hf_model_type(config) == FAMILIES[name][0]
    _assert_close(_our_logits(config, params, PROMPTS), _hf_logits(model, PROMPTS), name)


def test_export_read_back_by_transformers(family, tmp_path):
    name, _, _, config, params = family
    save_hf(tmp_path, config, params)
    back_config, back = load_hf(tmp_path)
    assert back_config == config
    jax.tree.map(np.testing.assert_array_equal, back, params)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert (
        type(theirs).__name__
        == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    )
    _assert_close(_our_logits(config, params, PROMPTS), _hf_logits(theirs, PROMPTS), name)


def test_sliding_window_is_honoured():
    """Direct check of the window semantics (HF's: key j visible iff p - W < j <= p):
    a token W or more positions back cannot change a sliding layer's output."""
    config = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        d_ff=48,
        sliding_window=3,
        layer_types=("sliding_attention",),
    )
    params = transformer.init_params(config, seed=0)
    ids = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    pos = jnp.arange(6)[None]
    base = transformer.forward(params, config, ids, pos)[0]
    changed = transformer.forward(params, config, ids.at[0, 1].set(40), pos)[0]
    # Position 1 is in the window of positions 1..3 only (p - 3 < 1 <= p).
    np.testing.assert_array_equal(base[0, 4:], changed[0, 4:])
    assert not np.allclose(base[0, 1:4], changed[0, 1:4])


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_soft"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_soft"),
        ({"model_type": "gemma3", "text_config": {}}, "model_type='gemma3'"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ],
)
def test_unsupported_variants_are_refused_by_name(bad, match):
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        **bad,
    }
    with pytest.raises(ValueError, match=match):
        config_from_hf_dict(cfg)
