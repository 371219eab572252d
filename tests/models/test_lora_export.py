"""LoRA export (models.formats.lora_export): peft loads the adapter onto the transformers model
and gives jaxflash's logits; the merged full model does too (bound of test_families)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.models.adapters import lora
from jaxflash.models.decoder import transformer
from jaxflash.models.decoder.logprobs import logits_from_hidden
from jaxflash.models.formats.lora_export import merged_params, save_peft
from jaxflash.models.formats.weights_hf import load_hf, save_hf

torch = pytest.importorskip("torch", reason="crosscheck extra (torch) not installed")
transformers = pytest.importorskip("transformers", reason="transformers not installed")
peft = pytest.importorskip("peft", reason="peft not installed")

PROMPTS = [[7, 3, 200], [5, 17, 250, 2, 99, 42, 7]]
TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF directory, our config, our params) of a random untied Llama."""
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    directory = tmp_path_factory.mktemp("hf_base")
    model.save_pretrained(directory)
    config, params = load_hf(directory)
    return directory, config, params


def _logits_fn(params, ids, pos, config):
    h, _ = transformer.forward(params, config, ids, pos)
    return logits_from_hidden(h, transformer.unembed(params, config))


_logits = jax.jit(_logits_fn, static_argnums=3)


def _ours(config, params):
    """One right-padded batch (causal: padding never reaches earlier positions)."""
    width = max(map(len, PROMPTS))
    ids = np.zeros((len(PROMPTS), width), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = p
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
    out = np.asarray(_logits(params, jnp.asarray(ids), jnp.asarray(pos), config))
    return [out[i, : len(p)] for i, p in enumerate(PROMPTS)]


def _theirs(model):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in PROMPTS]


def _assert_close(ours, theirs):
    scale = max(float(np.max(np.abs(t))) for t in theirs)
    gap = max(float(np.max(np.abs(o - t))) for o, t in zip(ours, theirs, strict=True))
    assert gap <= 1e-5 * max(scale, 1.0), (gap, scale)  # test_families' HF bound


def test_peft_loads_the_adapter_and_the_merged_model_matches(base, tmp_path):
    directory, config, params = base
    lc = lora.LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
    adapters = lora.init_adapters(config, lc, jax.random.PRNGKey(0))
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    adapters = jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    )  # B != 0: the adapters change the logits
    ours = _ours(config, lora.merge(params, adapters))
    base_logits = _ours(config, params)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(ours, base_logits, strict=True)) > 0.01

    save_peft(tmp_path / "adapter", config, lc, adapters, base_model=str(directory))
    meta = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert meta["r"] == 4 and meta["lora_alpha"] == 8.0 and "q_proj" in meta["target_modules"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    # Every adapter tensor we wrote was loaded (none left at peft's init: B = 0).
    state = with_adapter.state_dict()
    name = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.default.weight"
    np.testing.assert_allclose(
        state[name].numpy(),
        np.asarray(adapters["layers"]["lora_o"].b[1]).reshape(4, -1).T,
    )
    _assert_close(ours, _theirs(with_adapter))

    merged = merged_params(config, params, adapters)
    save_hf(tmp_path / "merged", config, merged)
    full = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    ).eval()
    _assert_close(ours, _theirs(full))


def test_save_peft_refuses_adapters_of_other_targets(base, tmp_path):
    _, config, _ = base
    adapters = lora.init_adapters(
        config, lora.LoraConfig(rank=2, targets=("q",)), jax.random.PRNGKey(0)
    )
    with pytest.raises(ValueError, match="adapters hold targets"):
        save_peft(tmp_path, config, lora.LoraConfig(rank=2, targets=("q", "v")), adapters)
