"""Hugging Face checkpoints (safetensors + config.json) <-> jaxflash parameters.

``load_hf`` reads a local checkpoint directory of a supported family — Llama (2, 3,
3.1/3.2 with ``rope_type: llama3``, SmolLM2), Qwen2 / Qwen2.5, Qwen3 (dense), Qwen3-MoE,
Mistral, Gemma 3 text (``gemma3_text``: 270M, 1B) — one ``model.safetensors`` or shards listed
in ``model.safetensors.index.json`` — into the nested dict of docs/CONTRACTS.md.
``save_hf`` writes the reverse, so a trained policy loads with
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` as the family's class
(``hf_config.hf_model_type`` picks it from the config's fields; ``hf_config`` maps
config.json to ``ModelConfig`` and back). A config field that no
``ModelConfig`` field represents (another RoPE type, logit softcapping, biases where
the family has none, Qwen's sliding window, ...) is refused with its name, never
dropped.

HF stores every projection as ``nn.Linear.weight`` (out, in); our matrices are
(in, out) split into heads. q/k rows are in HF's rotate-half RoPE order, which is
the order our model uses, so no permutation happens here. Qwen3-MoE stores one
tensor per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, what
transformers 5's ``save_pretrained`` writes and ``from_pretrained`` reads) and the
router as ``mlp.gate.weight`` (E, D); ours are stacked [L, E, ...].
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.params import Params, check_params
from jaxflash.models.decoder.transformer import abstract_params
from jaxflash.models.formats.hf_config import config_from_hf_dict, hf_config_dict

_NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# HF tensors that carry no weights we need (old checkpoints stored RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer_names(i: int, c: ModelConfig) -> dict[str, str | list[str]]:
    """Our stacked-layer key -> HF tensor name for layer i (a list of E names, one
    per expert, for the expert matrices)."""
    p = f"model.layers.{i}."
    names: dict[str, str | list[str]] = {
        "attn_norm_ld": p + "input_layernorm.weight",
        "w_q_ldnh": p + "self_attn.q_proj.weight",
        "w_k_ldkh": p + "self_attn.k_proj.weight",
        "w_v_ldkh": p + "self_attn.v_proj.weight",
        "w_o_lnhd": p + "self_attn.o_proj.weight",
        "w_gate_ldf": p + "mlp.gate_proj.weight",
        "w_up_ldf": p + "mlp.up_proj.weight",
        "w_down_lfd": p + "mlp.down_proj.weight",
    }
    if c.is_moe:
        for key in ("w_gate_ldf", "w_up_ldf", "w_down_lfd"):
            del names[key]
        names["w_router_lde"] = p + "mlp.gate.weight"
        for key, proj in (("w_gate_ledf", "gate"), ("w_up_ledf", "up"), ("w_down_lefd", "down")):
            names[key] = [f"{p}mlp.experts.{e}.{proj}_proj.weight" for e in range(c.n_experts)]
    if c.sandwich_norm:  # Gemma: post_attention_layernorm is the norm *after* attention
        names.update(
            post_attn_norm_ld=p + "post_attention_layernorm.weight",
            mlp_norm_ld=p + "pre_feedforward_layernorm.weight",
            post_mlp_norm_ld=p + "post_feedforward_layernorm.weight",
        )
    else:
        names["mlp_norm_ld"] = p + "post_attention_layernorm.weight"
    if c.qk_norm:
        names.update(
            q_norm_lh=p + "self_attn.q_norm.weight", k_norm_lh=p + "self_attn.k_norm.weight"
        )
    if c.qkv_bias:
        names.update(
            b_q_lnh=p + "self_attn.q_proj.bias",
            b_k_lkh=p + "self_attn.k_proj.bias",
            b_v_lkh=p + "self_attn.v_proj.bias",
        )
    return names


def _to_hf(key: str, x: np.ndarray) -> np.ndarray:
    """One layer's array in our layout -> HF (out, in) / (out,) layout."""
    if key.startswith("b_"):  # [heads, H] -> [heads*H]
        return x.reshape(-1)
    if key in ("w_q_ldnh", "w_k_ldkh", "w_v_ldkh"):  # [D, heads, H] -> (heads*H, D)
        return x.reshape(x.shape[0], -1).T
    if key == "w_o_lnhd":  # [N, H, D] -> (D, N*H)
        return x.reshape(-1, x.shape[-1]).T
    if key.startswith("w_"):  # [in, out] -> (out, in); one expert's matrix too
        return x.T
    return x  # norms


def _from_hf(key: str, x: np.ndarray, c: ModelConfig) -> np.ndarray:
    """Inverse of ``_to_hf`` for one layer (shapes are checked by the caller)."""
    if key.startswith("b_"):
        return x.reshape(-1, c.head_dim)
    if key in ("w_q_ldnh", "w_k_ldkh", "w_v_ldkh"):
        return x.T.reshape(c.d_model, -1, c.head_dim)
    if key == "w_o_lnhd":
        return x.T.reshape(c.n_heads, c.head_dim, c.d_model)
    if key.startswith("w_"):
        return x.T
    return x


def _hf_shape(key: str, c: ModelConfig) -> tuple[int, ...]:
    """Shape HF stores for one layer (one expert) of ``key``."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return {
        "attn_norm_ld": (c.d_model,),
        "mlp_norm_ld": (c.d_model,),
        "post_attn_norm_ld": (c.d_model,),
        "post_mlp_norm_ld": (c.d_model,),
        "q_norm_lh": (c.head_dim,),
        "k_norm_lh": (c.head_dim,),
        "w_q_ldnh": (q, c.d_model),
        "w_k_ldkh": (kv, c.d_model),
        "w_v_ldkh": (kv, c.d_model),
        "w_o_lnhd": (c.d_model, q),
        "w_gate_ldf": (c.d_ff, c.d_model),
        "w_up_ldf": (c.d_ff, c.d_model),
        "w_down_lfd": (c.d_model, c.d_ff),
        "w_router_lde": (c.n_experts, c.d_model),
        "w_gate_ledf": (c.moe_d_ff, c.d_model),
        "w_up_ledf": (c.moe_d_ff, c.d_model),
        "w_down_lefd": (c.d_model, c.moe_d_ff),
        "b_q_lnh": (q,),
        "b_k_lkh": (kv,),
        "b_v_lkh": (kv,),
    }[key]


def save_hf(
    directory: str | os.PathLike, config: ModelConfig, params: Params, tokenizer: Any = None
) -> None:
    """Write ``model.safetensors`` + ``config.json`` (+ tokenizer files) to ``directory``.

    Args:
      directory: created if missing; existing files of the same names are replaced.
      config: the model's configuration.
      params: nested dict (numpy or jax arrays) in the layout of docs/CONTRACTS.md,
        dtype ``config.param_dtype``; written in that dtype.
      tokenizer: optional ``jaxflash.models.text.tokenizer.Tokenizer``; writes
        ``tokenizer.json`` + ``tokenizer_config.json`` (chat template, eos).

    Raises:
      ValueError: if ``params`` does not match ``config`` (names the path).
    """
    check_params(abstract_params(config), params, what="save_hf params")
    host = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    layers = {k: np.asarray(v) for k, v in params["layers"].items()}
    tensors = {
        "model.embed_tokens.weight": host["embed_vd"],
        "model.norm.weight": host["final_norm_d"],
    }
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = host["lm_head_dv"].T
    for i in range(config.n_layers):
        for key, name in _layer_names(i, config).items():
            if isinstance(name, list):  # one tensor per expert
                tensors.update(
                    {n: _to_hf(key, x) for n, x in zip(name, layers[key][i], strict=True)}
                )
            else:
                tensors[name] = _to_hf(key, layers[key][i])
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    eos_id = None if tokenizer is None else tokenizer.eos_id
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(config, eos_id=eos_id), f, indent=2)
    if tokenizer is not None:
        tokenizer.save_hf(directory)


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, s) for s in shards]
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"load_hf: {directory} has neither model.safetensors nor model.safetensors.index.json"
    )


def load_hf(
    directory: str | os.PathLike, *, param_dtype: str = "float32"
) -> tuple[ModelConfig, Params]:
    """Read a local checkpoint directory (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 3
    text).

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or sharded
        ``model-XXXXX-of-YYYYY.safetensors`` + ``model.safetensors.index.json``).
      param_dtype: "float32" | "bfloat16": dtype of the returned arrays (stored
        tensors of any float dtype are cast) and of ``config.param_dtype``.

    Returns:
      (config, params): params a nested dict of numpy arrays per docs/CONTRACTS.md.

    Raises:
      FileNotFoundError: config.json or the weights are missing.
      ValueError: unsupported config, or a tensor missing, of the wrong shape, or
        unknown (so no weight is silently dropped); the message names it.
    """
    directory = os.fspath(directory)
    if param_dtype not in _NUMPY_DTYPES:
        raise ValueError(f"load_hf: param_dtype must be one of {sorted(_NUMPY_DTYPES)}")
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"load_hf: no config.json in {directory}")
    with open(cfg_path, encoding="utf-8") as f:
        config = config_from_hf_dict(json.load(f), path=cfg_path).replace(param_dtype=param_dtype)
    c, dtype = config, _NUMPY_DTYPES[param_dtype]

    stored: dict[str, tuple[str, Any]] = {}  # HF name -> (file, open handle)
    for path in _safetensors_files(directory):
        handle = safe_open(path, framework="numpy")
        stored.update({name: (path, handle) for name in handle.keys()})

    used: set[str] = set()

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in stored:
            raise ValueError(f"load_hf: {directory}: tensor {name} is missing")
        path, h = stored[name]
        x = h.get_tensor(name)
        if x.shape != shape:
            raise ValueError(f"load_hf: {path}: {name} has shape {x.shape}, expected {shape}")
        used.add(name)
        return x.astype(dtype)

    def read_layer(key: str, name: str | list[str]) -> np.ndarray:
        if isinstance(name, list):  # experts, stacked on a leading E axis
            return np.stack([read_layer(key, n) for n in name])
        return _from_hf(key, read(name, _hf_shape(key, c)), c)

    layer_names = [_layer_names(i, c) for i in range(c.n_layers)]
    params: Params = {
        "embed_vd": read("model.embed_tokens.weight", (c.vocab_size, c.d_model)),
        "final_norm_d": read("model.norm.weight", (c.d_model,)),
        "layers": {
            key: np.stack([read_layer(key, n[key]) for n in layer_names]) for key in layer_names[0]
        },
    }
    if not c.tie_embeddings:
        params["lm_head_dv"] = np.ascontiguousarray(
            read("lm_head.weight", (c.vocab_size, c.d_model)).T
        )
    elif "lm_head.weight" in stored:
        used.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    unknown = sorted(n for n in stored if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise ValueError(
            f"load_hf: {directory}: tensors our model has no place for: {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}"
        )
    return config, params
