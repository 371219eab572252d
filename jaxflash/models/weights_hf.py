"""Hugging Face checkpoints (safetensors + config.json) <-> jaxflash parameters.

``load_hf`` reads a local checkpoint directory of a supported family — Llama (2, 3,
3.1/3.2 with ``rope_type: llama3``, SmolLM2), Qwen2 / Qwen2.5, Qwen3 (dense), Mistral,
Gemma 3 text (``gemma3_text``: 270M, 1B) — one ``model.safetensors`` or shards listed
in ``model.safetensors.index.json`` — into the nested dict of docs/CONTRACTS.md.
``save_hf`` writes the reverse, so a trained policy loads with
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` as the family's class
(``hf_model_type`` picks it from the config's fields). A config field that no
``ModelConfig`` field represents (another RoPE type, logit softcapping, biases where
the family has none, Qwen's sliding window, ...) is refused with its name, never
dropped.

HF stores every projection as ``nn.Linear.weight`` (out, in); our matrices are
(in, out) split into heads. q/k rows are in HF's rotate-half RoPE order, which is
the order our model uses, so no permutation happens here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxflash.models.config import ModelConfig
from jaxflash.models.llama import abstract_params
from jaxflash.models.params import Params, check_params

_NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# HF tensors that carry no weights we need (old checkpoints stored RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer_names(i: int, c: ModelConfig) -> dict[str, str]:
    """Our stacked-layer key -> HF tensor name for layer i."""
    p = f"model.layers.{i}."
    names = {
        "attn_norm_ld": p + "input_layernorm.weight",
        "w_q_ldnh": p + "self_attn.q_proj.weight",
        "w_k_ldkh": p + "self_attn.k_proj.weight",
        "w_v_ldkh": p + "self_attn.v_proj.weight",
        "w_o_lnhd": p + "self_attn.o_proj.weight",
        "w_gate_ldf": p + "mlp.gate_proj.weight",
        "w_up_ldf": p + "mlp.up_proj.weight",
        "w_down_lfd": p + "mlp.down_proj.weight",
    }
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
    if key.startswith("w_"):  # [in, out] -> (out, in)
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
    """Shape HF stores for one layer of ``key``."""
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
        "b_q_lnh": (q,),
        "b_k_lkh": (kv,),
        "b_v_lkh": (kv,),
    }[key]


def hf_model_type(config: ModelConfig) -> str:
    """The transformers ``model_type`` whose architecture ``config`` describes.

    gemma3_text when the Gemma fields are set (norm_offset 1, gelu_tanh, sandwich
    norms, scaled embeddings, q/k norm), qwen3 for q/k norm, qwen2 for q/k/v biases,
    mistral for sliding-window attention on every layer, else llama.

    Raises:
      ValueError: a combination of fields no supported family has (naming them).
    """
    c = config
    gemma = {
        "norm_offset=1.0": c.norm_offset == 1.0,
        "mlp_activation='gelu_tanh'": c.mlp_activation == "gelu_tanh",
        "sandwich_norm": c.sandwich_norm,
        "scale_embeddings": c.scale_embeddings,
    }
    if any(gemma.values()):
        missing = [k for k, v in gemma.items() if not v] + ([] if c.qk_norm else ["qk_norm"])
        if missing or c.qkv_bias or c.rope_scaling != "none":
            raise ValueError(
                f"hf_model_type: a Gemma-style config also needs {missing}, no qkv_bias and "
                f"rope_scaling='none' (got qkv_bias={c.qkv_bias}, rope_scaling={c.rope_scaling!r})"
            )
        return "gemma3_text"
    if c.query_pre_attn_scalar is not None or c.rope_local_theta is not None:
        raise ValueError(
            "hf_model_type: query_pre_attn_scalar / rope_local_theta exist only in Gemma 3 "
            "(set its other fields)"
        )
    sliding = c.sliding_window is not None
    if sliding and set(c.layer_types) != {"sliding_attention"}:
        raise ValueError(
            "hf_model_type: mixed sliding/full layers exist only in Gemma 3 "
            f"(layer_types={c.layer_types})"
        )
    if (c.qk_norm or c.qkv_bias) and (sliding or c.rope_scaling != "none"):
        raise ValueError(
            "hf_model_type: Qwen2/Qwen3 exports support neither sliding_window nor rope_scaling"
        )
    if c.qk_norm and c.qkv_bias:
        raise ValueError("hf_model_type: qk_norm with qkv_bias is no supported family")
    if c.qk_norm:
        return "qwen3"
    if c.qkv_bias:
        return "qwen2"
    if sliding:
        if c.rope_scaling != "none":
            raise ValueError("hf_model_type: Mistral with rope_scaling is not supported")
        return "mistral"
    return "llama"


def hf_config_dict(config: ModelConfig, *, eos_id: int | None = None) -> dict[str, Any]:
    """config.json contents for ``config`` (transformers 4.x field names, read by 5.x too).

    The family is ``hf_model_type(config)``. Qwen2 carries the q/k/v biases (HF
    Llama's ``attention_bias`` would also add an o_proj bias, which our model does
    not have).
    """
    c = config
    model_type = hf_model_type(c)
    rope_scaling = None
    if c.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": c.rope_scaling_factor,
            "low_freq_factor": c.rope_low_freq_factor,
            "high_freq_factor": c.rope_high_freq_factor,
            "original_max_position_embeddings": c.rope_original_max_len,
        }
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": c.param_dtype,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layers)
        if model_type == "qwen3":
            out.update(attention_bias=False)
    elif model_type == "mistral":
        out.update(sliding_window=c.sliding_window)
    else:  # gemma3_text
        del out["hidden_act"]
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            # transformers' strict config wants an int (every Gemma 3 uses one)
            query_pre_attn_scalar=int(c.query_pre_attn_scalar or c.head_dim),
            sliding_window=c.sliding_window,
            layer_types=list(c.layer_types) or ["full_attention"] * c.n_layers,
            rope_local_base_freq=c.rope_local_theta or c.rope_theta,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            attention_bias=False,
            use_bidirectional_attention=False,
        )
    if eos_id is not None:
        out.update(eos_token_id=eos_id, pad_token_id=eos_id)
    return out


def save_hf(
    directory: str | os.PathLike, config: ModelConfig, params: Params, tokenizer: Any = None
) -> None:
    """Write ``model.safetensors`` + ``config.json`` (+ tokenizer files) to ``directory``.

    Args:
      directory: created if missing; existing files of the same names are replaced.
      config: the model's configuration.
      params: nested dict (numpy or jax arrays) in the layout of docs/CONTRACTS.md,
        dtype ``config.param_dtype``; written in that dtype.
      tokenizer: optional ``jaxflash.models.tokenizer.Tokenizer``; writes
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
            tensors[name] = _to_hf(key, layers[key][i])
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    eos_id = None if tokenizer is None else tokenizer.eos_id
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(config, eos_id=eos_id), f, indent=2)
    if tokenizer is not None:
        tokenizer.save_hf(directory)


def _rope_params(cfg: dict[str, Any], key: str | None, path: str) -> dict[str, Any]:
    """One RoPE parameter set: transformers 5's ``rope_parameters`` (per layer type
    when ``key``), else 4.x's ``rope_scaling`` + ``rope_theta``."""
    rope = cfg.get("rope_parameters")
    if rope is not None and key is not None:
        rope = rope.get(key)
    if rope is None:
        rope = dict(cfg.get("rope_scaling") or {})
        if key == "sliding_attention":  # Gemma 3 (4.x): scaling applies to full layers only
            rope = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    rope = dict(rope)
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    supported = ("default", "llama3") if key is None else ("default",)
    if kind not in supported:
        raise ValueError(
            f"load_hf: {path}: rope_type={kind!r}{f' ({key} layers)' if key else ''} is not "
            f"supported (supported: {supported}); RoPE parameters {rope!r}"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"load_hf: {path}: partial_rotary_factor {rope!r} is not supported")
    return {**rope, "rope_type": kind}


def _refuse_set(cfg: dict[str, Any], path: str, *names: str) -> None:
    """Refuse a config field our model does not implement unless it is null/false/absent."""
    for name in names:
        if cfg.get(name):
            raise ValueError(
                f"load_hf: {path}: {name}={cfg[name]!r} is not supported for "
                f"model_type={cfg.get('model_type')!r}"
            )


def config_from_hf_dict(cfg: dict[str, Any], *, path: str = "config.json") -> ModelConfig:
    """ModelConfig from a ``config.json`` dict (transformers 4.x or 5.x field names).

    model_type llama, qwen2, qwen3, mistral or gemma3_text (a multimodal ``gemma3``
    config is refused: use the text-only checkpoint).

    Raises:
      ValueError: unsupported model_type, activation, biases, RoPE type, logit
        softcapping or sliding-window setting (the message names the field).
    """
    model_type = cfg.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"load_hf: {path}: model_type={model_type!r} is not supported "
            f"(supported: {sorted(_ARCHITECTURES)})"
        )
    gemma = model_type == "gemma3_text"
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if gemma and float(scalar) != int(scalar):
        raise ValueError(f"load_hf: {path}: query_pre_attn_scalar={scalar!r} must be an integer")
    act = cfg.get("hidden_activation" if gemma else "hidden_act", "silu")
    if act not in _ACTIVATIONS or _ACTIVATIONS[act] != ("gelu_tanh" if gemma else "silu"):
        field = "hidden_activation" if gemma else "hidden_act"
        raise ValueError(f"load_hf: {path}: {field}={act!r} is not supported for {model_type}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(
            f"load_hf: {path}: attention_bias/mlp_bias on {model_type} is not supported"
        )
    fields: dict[str, Any] = {}
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ValueError(f"load_hf: {path}: use_sliding_window=True is not supported")
    if model_type == "mistral" and cfg.get("sliding_window") is not None:
        n = int(cfg["num_hidden_layers"])
        fields.update(
            sliding_window=int(cfg["sliding_window"]), layer_types=("sliding_attention",) * n
        )
    if model_type not in ("mistral", "gemma3_text") and cfg.get("layer_types"):
        if set(cfg["layer_types"]) != {"full_attention"}:
            raise ValueError(f"load_hf: {path}: layer_types={cfg['layer_types']!r} not supported")
    if gemma:
        _refuse_set(
            cfg,
            path,
            "final_logit_softcapping",
            "attn_logit_softcapping",
            "use_bidirectional_attention",
        )
        local = _rope_params(cfg, "sliding_attention", path)
        rope = _rope_params(cfg, "full_attention", path)
        types = tuple(cfg.get("layer_types") or ())
        if not types:  # 4.x configs: every sliding_window_pattern-th layer is full
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            types = tuple(
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(int(cfg["num_hidden_layers"]))
            )
        sliding = "sliding_attention" in types
        fields.update(
            norm_offset=1.0,
            mlp_activation="gelu_tanh",
            sandwich_norm=True,
            scale_embeddings=True,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            layer_types=types,
            sliding_window=int(cfg["sliding_window"]) if sliding else None,
            rope_local_theta=float(local["rope_theta"]),
        )
    else:
        rope = _rope_params(cfg, None, path)
    if rope["rope_type"] == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rope]
        if missing:
            raise ValueError(f"load_hf: {path}: llama3 RoPE parameters lack {missing}: {rope!r}")
        if model_type != "llama":
            raise ValueError(f"load_hf: {path}: rope_type 'llama3' on {model_type} is unsupported")
        fields.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
        )
    d_model, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        d_model=d_model,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or d_model // n_heads),
        d_ff=int(cfg["intermediate_size"]),
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3" or gemma,
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        **fields,
    )


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
    """Read a local checkpoint directory (Llama, Qwen2, Qwen3, Mistral, Gemma 3 text).

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

    layer_names = [_layer_names(i, c) for i in range(c.n_layers)]
    params: Params = {
        "embed_vd": read("model.embed_tokens.weight", (c.vocab_size, c.d_model)),
        "final_norm_d": read("model.norm.weight", (c.d_model,)),
        "layers": {
            key: np.stack([_from_hf(key, read(n[key], _hf_shape(key, c)), c) for n in layer_names])
            for key in layer_names[0]
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
