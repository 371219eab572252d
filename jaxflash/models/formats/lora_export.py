"""LoRA adapters out of jaxflash: the Hugging Face adapter format that ``peft`` loads
onto the transformers model, and a merged full model.

``save_peft`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` with
peft's names (checked against peft 0.21's ``save_pretrained``):
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r] (``nn.Linear`` layout), ``base_model.model.lm_head.*``
for the head. Scaling is peft's plain ``lora_alpha / r`` (no rsLoRA). The base model
is the one ``weights_hf.save_hf`` exports (same head order of q/k rows), so
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), dir)``
computes what jaxflash computes.

``merged_params`` folds the adapters into float weights, W + s·A·B (a quantized base
is dequantised first), for ``save_hf``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxflash.models.adapters import lora
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.params import Params

# target -> HF module path inside a decoder layer
_HF_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "lm_head": "lm_head",
}


def _as_linear(adapter: lora.Adapter) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A.weight [r, in], lora_B.weight [out, r]) of one layer's adapter."""
    a, b = np.asarray(adapter.a, np.float32), np.asarray(adapter.b, np.float32)
    r = a.shape[-1]
    return a.reshape(-1, r).T, b.reshape(r, -1).T


def save_peft(
    directory: str | os.PathLike,
    model_config: ModelConfig,
    lora_config: lora.LoraConfig,
    adapters: Any,
    *,
    base_model: str = "",
) -> None:
    """Write the adapters as a peft LoRA adapter (float32 tensors).

    Args:
      directory: created if missing; the two files are replaced.
      model_config: the base model's configuration.
      lora_config: rank, alpha and targets of ``adapters``.
      adapters: ``TrainState.params`` of a LoRA learner (layers stacked; host or device).
      base_model: recorded as ``base_model_name_or_path`` (a hub id or directory).

    Raises:
      ValueError: adapters whose targets differ from ``lora_config.targets``.
    """
    adapters = jax.device_get(adapters)
    have = {k.removeprefix(lora.PREFIX) for k in adapters["layers"]}
    if "lora_head" in adapters:
        have.add(lora.HEAD)
    if have != set(lora_config.targets):
        raise ValueError(
            f"save_peft: adapters hold targets {sorted(have)}, lora_config says "
            f"{sorted(lora_config.targets)}"
        )
    tensors: dict[str, np.ndarray] = {}
    for target in lora_config.targets:
        if target == lora.HEAD:
            a, b = _as_linear(adapters["lora_head"])
            tensors["base_model.model.lm_head.lora_A.weight"] = a
            tensors["base_model.model.lm_head.lora_B.weight"] = b
            continue
        stacked = adapters["layers"][lora.PREFIX + target]
        for i in range(model_config.n_layers):
            a, b = _as_linear(jax.tree.map(lambda x, i=i: x[i], stacked))
            name = f"base_model.model.model.layers.{i}.{_HF_MODULES[target]}"
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = b
    os.makedirs(directory, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(
        tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"}
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": lora_config.rank,
        "lora_alpha": lora_config.alpha,
        "lora_dropout": lora_config.dropout,
        "target_modules": sorted(_HF_MODULES[t].split(".")[-1] for t in lora_config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def merged_params(model_config: ModelConfig, base: Any, adapters: Any) -> Params:
    """Full model params with the adapters folded in: W + (alpha/r)·A·B per target.

    Args:
      model_config: the model (its ``param_dtype`` is the output dtype).
      base: the stored base (float, or with ``QArray`` weights: dequantised here).
      adapters: the adapters (layers stacked).

    Returns:
      Nested dict in the plain model's layout (``save_hf`` writes it).
    """
    base, adapters = jax.device_get(base), jax.device_get(adapters)

    def dense(x):
        x = lora.dequantize(x) if isinstance(x, lora.QArray) else x
        return np.asarray(x, np.float32)

    is_q = lambda x: isinstance(x, lora.QArray)  # noqa: E731
    out = jax.tree.map(dense, base, is_leaf=is_q)
    for key, ad in adapters["layers"].items():
        target = key.removeprefix(lora.PREFIX)
        weight = lora.TARGETS[target][0]
        a, b = np.asarray(ad.a, np.float32), np.asarray(ad.b, np.float32)
        # [L, *in, r] x [L, r, *out] -> [L, *in, *out]
        a_lir = a.reshape(a.shape[0], -1, a.shape[-1])
        b_lro = b.reshape(b.shape[0], b.shape[1], -1)
        w = out["layers"][weight]
        out["layers"][weight] = w + ad.scale * np.einsum("lir,lro->lio", a_lir, b_lro).reshape(
            w.shape
        )
    if "lora_head" in adapters:
        ad = adapters["lora_head"]
        delta = ad.scale * (np.asarray(ad.a, np.float32) @ np.asarray(ad.b, np.float32))
        if model_config.tie_embeddings:
            # A merged head unties it: the embedding keeps the base rows.
            raise ValueError(
                "merged_params: an lm_head adapter on tied embeddings would untie them; "
                "export it with save_peft, or train without the lm_head target"
            )
        out["lm_head_dv"] = out["lm_head_dv"] + delta
    dtype = model_config.jnp_param_dtype
    return jax.tree.map(lambda x: np.asarray(x).astype(dtype), out)
