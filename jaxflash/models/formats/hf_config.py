"""Hugging Face ``config.json`` <-> ``ModelConfig``: which family, which fields.

``config_from_hf_dict`` reads a supported family's config (Llama 2/3/3.1-3.2 with
``rope_type: llama3``, Qwen2 / Qwen2.5, Qwen3 dense, Qwen3-MoE, Mistral, Gemma 3 text) into a
``ModelConfig``; ``hf_config_dict`` writes one back and ``hf_model_type`` names the
family a ``ModelConfig`` exports as. A field no ``ModelConfig`` field represents
(another RoPE type, logit softcapping, biases where the family has none, Qwen's
sliding window, ...) is refused with its name, never dropped. The tensors are
``weights_hf``'s.
"""

from __future__ import annotations

from typing import Any

from jaxflash.models.config.model_config import ModelConfig

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def hf_model_type(config: ModelConfig) -> str:
    """The transformers ``model_type`` whose architecture ``config`` describes.

    gemma3_text when the Gemma fields are set (norm_offset 1, gelu_tanh, sandwich
    norms, scaled embeddings, q/k norm), qwen3_moe for experts (with q/k norm), qwen3
    for q/k norm, qwen2 for q/k/v biases,
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
    if c.is_moe and (any(gemma.values()) or not c.qk_norm or c.qkv_bias):
        raise ValueError(
            "hf_model_type: experts (n_experts > 0) exist only as Qwen3-MoE: qk_norm, no "
            f"qkv_bias, no Gemma fields (got qk_norm={c.qk_norm}, qkv_bias={c.qkv_bias})"
        )
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
        return "qwen3_moe" if c.is_moe else "qwen3"
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
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layers)
        if model_type != "qwen2":
            out.update(attention_bias=False)
        if model_type == "qwen3_moe":
            out.update(
                num_experts=c.n_experts,
                num_experts_per_tok=c.n_experts_per_token,
                moe_intermediate_size=c.moe_d_ff,
                norm_topk_prob=c.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                router_aux_loss_coef=c.router_aux_loss_coef,
                output_router_logits=False,
            )
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


def _moe_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The expert fields of a qwen3_moe config.json. transformers 5 writes
    ``num_local_experts`` for ``num_experts``; both are read.

    Raises:
      ValueError: no experts, or dense MLP layers among them (``decoder_sparse_step``
        other than 1, a non-empty ``mlp_only_layers``): every layer of the stacked
        decoder has the same parameters, so a mix is not represented.
    """
    n_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    if n_experts < 1:
        raise ValueError(
            f"load_hf: {path}: num_experts={n_experts}: a qwen3_moe config without experts "
            "is a dense model (export it as model_type qwen3)"
        )
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_layers = list(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense_layers:
        raise ValueError(
            f"load_hf: {path}: decoder_sparse_step={step}, mlp_only_layers={dense_layers}: "
            "dense MLP layers between expert layers are not supported (every layer must be "
            "a MoE layer: decoder_sparse_step=1, mlp_only_layers=[])"
        )
    return dict(
        n_experts=n_experts,
        n_experts_per_token=int(cfg["num_experts_per_tok"]),
        moe_d_ff=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
    )


def config_from_hf_dict(cfg: dict[str, Any], *, path: str = "config.json") -> ModelConfig:
    """ModelConfig from a ``config.json`` dict (transformers 4.x or 5.x field names).

    model_type llama, qwen2, qwen3, qwen3_moe, mistral or gemma3_text (a multimodal
    ``gemma3`` config is refused: use the text-only checkpoint).

    Raises:
      ValueError: unsupported model_type, activation, biases, RoPE type, logit
        softcapping, sliding-window setting or (Qwen3-MoE) dense layers among the
        expert layers (the message names the field).
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
    if model_type == "qwen3_moe":
        fields.update(_moe_fields(cfg, path))
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
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
        qk_norm=model_type in ("qwen3", "qwen3_moe") or gemma,
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        **fields,
    )
