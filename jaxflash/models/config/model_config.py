"""Model configuration of the one decoder (Llama, Qwen2/3, Qwen3-MoE, Mistral, Gemma 3): frozen,
validated, presets. Each field names one real architectural difference; a family is a
combination of fields, never a subclass.

Dimension letters: B batch, T time, V vocabulary, D model width, N query heads,
K key/value heads, H head dim, F MLP hidden width, L layers, S cache length,
E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROPE_SCALINGS = ("none", "llama3")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_IMPLS = ("auto", "dense", "blockwise", "dot_product", "splash")
"""ModelConfig.attention's names (the paths are in ``models.caches.attention``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of the decoder (Llama architecture plus named variants).

    Attributes:
      vocab_size: V, rows of the embedding / columns of the logits (a
        checkpoint's config.json ``vocab_size``, often padded to a multiple of
        64 or 128).
      valid_vocab_size: ids the tokenizer can produce; ids in
        [valid_vocab_size, V) are padding rows, masked out of every sampling
        and scoring distribution. None: all V ids are valid. Set it with
        ``reconcile_vocab``.
      d_model: D, residual stream width.
      n_layers: L, number of decoder blocks (stacked on one leading axis).
      n_heads: N, query heads.
      n_kv_heads: K, key/value heads (grouped-query attention); must divide N.
      head_dim: H, width of one head (even: RoPE rotates pairs).
      d_ff: F, SwiGLU hidden width.
      rope_theta: RoPE base frequency.
      rms_norm_eps: epsilon inside RMSNorm's rsqrt.
      tie_embeddings: logits use embed_vd transposed (no lm_head_dv).
      qkv_bias: q/k/v projections carry biases (Qwen2 style).
      max_seq_len: longest sequence (prompt + response) the model is used for.
      param_dtype: "float32" | "bfloat16" — storage dtype of the weights.
      compute_dtype: "float32" | "bfloat16" — dtype of the matmuls; softmax,
        RMSNorm, RoPE, the residual stream and logits stay float32.
      remat: rematerialise each layer in the backward pass (``jax.checkpoint``) except
        the outputs of its weight matmuls, which are saved
        (``dots_with_no_batch_dims_saveable``): per token and layer the projections
        and MLP activations (about 5 D + 2 F floats) stay alive, everything else is
        recomputed.
      remat_policy: "dots" (the above) or "full": only each layer's input is saved and
        the whole layer, matmuls too, is recomputed (a third more FLOPs; at 8k tokens
        per chip the saved matmul outputs are most of a 1.5B model's step memory).
      logits_chunk: tokens per chunk of the chunked log-softmax (see decoder/logprobs.py).
      attention: how cache-free self-attention (the learner's forward) is computed:
        "auto" (splash on TPU, jax.nn.dot_product_attention on GPU, blockwise
        elsewhere), "dense" (the [T, T] reference), "blockwise", "dot_product" or
        "splash" (``models.caches.attention``). Cached passes (the engine's decode and
        prefill buckets up to ``EngineConfig.prefill_dense_max``) are dense; longer
        prefill buckets attend through this path (``models.caches.cache_face.FreshPrefill``).
      rope_scaling: "none" or "llama3" (Llama 3.1/3.2 frequency-dependent scaling of
        the RoPE inverse frequencies; HF ``rope_type: llama3``). Other HF rope types
        (linear, dynamic, yarn, longrope) are refused at import.
      rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor,
        rope_original_max_len: the llama3 parameters (HF ``factor``,
        ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``); ignored when rope_scaling is "none".
      qk_norm: per-head RMSNorm (over H) of q and k before RoPE (Qwen3, Gemma 3);
        adds ``q_norm_lh`` / ``k_norm_lh``.
      norm_offset: RMSNorm multiplies by (norm_offset + w): 0.0 (Llama, Qwen) or
        1.0 (Gemma, weights stored as offsets from 1; init zeros).
      mlp_activation: gate activation of the gated MLP: "silu" (SwiGLU) or
        "gelu_tanh" (GeGLU with the tanh approximation, Gemma).
      sandwich_norm: RMSNorm also after attention and after the MLP, before each
        residual add (Gemma 2/3); adds ``post_attn_norm_ld`` / ``post_mlp_norm_ld``.
      scale_embeddings: multiply token embeddings by sqrt(D), rounded to the param
        dtype first (as HF Gemma does).
      query_pre_attn_scalar: attention scores are scaled by its ^-0.5; None uses
        head_dim (Gemma 3 sets it from its config).
      sliding_window: W; a sliding layer's query at position p sees keys at
        positions j with p - W < j <= p (HF's convention). None: no sliding layer.
      layer_types: per layer "full_attention" or "sliding_attention" (HF's names;
        Gemma 3 interleaves 5 sliding : 1 full). Empty: every layer is full.
      rope_local_theta: RoPE base of sliding layers (Gemma 3: 10000); None uses
        rope_theta.
      n_experts: E routed experts replacing the MLP of every layer (Qwen3-MoE; HF
        ``num_experts``); 0: a dense MLP (``d_ff``). No shared expert; every layer is a
        MoE layer (HF ``decoder_sparse_step`` other than 1 and ``mlp_only_layers``
        are refused at import). See jaxflash/models/decoder/moe.py.
      n_experts_per_token: k experts each token is routed to (HF
        ``num_experts_per_tok``); 1 <= k <= E with experts, else 0.
      moe_d_ff: hidden width of one expert's SwiGLU (HF ``moe_intermediate_size``);
        ``d_ff`` is then unused by the model (kept for config.json round trips).
      norm_topk_prob: renormalise the k selected router probabilities to sum to 1
        (HF ``norm_topk_prob``; Qwen3-MoE checkpoints set it).
      exact_numerics: the exact mode: the engine's prefill and decode and the learner's
        forward compute each token's logits with the same operations in the same
        order whatever the batch around it (fixed row blocks, one attention layout
        and order: ``models.caches.exact``), so behaviour and learner logprobs of the
        same weights are bitwise equal (docs/CONSISTENCY.md: cost, when to use it).
        Dense models only; the paged cache's TPU kernel is refused.
      router_aux_loss_coef: the checkpoint's load-balancing loss weight (HF
        ``router_aux_loss_coef``), kept for export; the learner applies
        ``LearnerConfig.router_aux_loss_coef``, not this.
    """

    vocab_size: int
    valid_vocab_size: int | None = None
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_seq_len: int = 2048
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False
    remat_policy: str = "dots"
    logits_chunk: int = 256
    attention: str = "auto"
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    qk_norm: bool = False
    norm_offset: float = 0.0
    mlp_activation: str = "silu"
    sandwich_norm: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    n_experts: int = 0
    n_experts_per_token: int = 0
    moe_d_ff: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    exact_numerics: bool = False

    def __post_init__(self) -> None:
        # JSON (a generation program's config) brings lists back: keep the config hashable.
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "max_seq_len",
            "logits_chunk",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        valid = self.valid_vocab_size
        if valid is not None and (
            not isinstance(valid, int)
            or isinstance(valid, bool)
            or not 1 <= valid <= self.vocab_size
        ):
            raise ValueError(
                f"ModelConfig.valid_vocab_size must be an int in [1, vocab_size="
                f"{self.vocab_size}] or None, got {valid!r}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        self._check_variants()
        check_attention(self.attention, self.sliding_window)
        if self.remat_policy not in ("dots", "full"):
            raise ValueError(
                f"ModelConfig.remat_policy must be dots | full, got {self.remat_policy!r}"
            )
        self._check_experts()
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, "
                    f"got {getattr(self, name)!r}"
                )

    def _check_variants(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"ModelConfig.rope_scaling must be one of {ROPE_SCALINGS}, "
                f"got {self.rope_scaling!r}"
            )
        if self.rope_scaling == "llama3" and not (
            self.rope_scaling_factor >= 1.0
            and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_max_len >= 1
        ):
            raise ValueError(
                "ModelConfig: llama3 rope scaling needs rope_scaling_factor >= 1, "
                "0 < rope_low_freq_factor < rope_high_freq_factor and rope_original_max_len "
                f">= 1, got {self.rope_scaling_factor}, {self.rope_low_freq_factor}, "
                f"{self.rope_high_freq_factor}, {self.rope_original_max_len}"
            )
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.mlp_activation must be one of {MLP_ACTIVATIONS}, "
                f"got {self.mlp_activation!r}"
            )
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"ModelConfig.norm_offset must be 0.0 or 1.0, got {self.norm_offset}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(
                f"ModelConfig.query_pre_attn_scalar must be > 0 or None, "
                f"got {self.query_pre_attn_scalar}"
            )
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ValueError(
                f"ModelConfig.rope_local_theta must be > 0 or None, got {self.rope_local_theta}"
            )
        types = self.layer_types
        if types and len(types) != self.n_layers:
            raise ValueError(
                f"ModelConfig.layer_types has {len(types)} entries, n_layers={self.n_layers}"
            )
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"ModelConfig.layer_types: unknown {bad}; known: {LAYER_TYPES}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be an int >= 1, got {window!r}")
        if ("sliding_attention" in types) != (window is not None):
            raise ValueError(
                "ModelConfig.sliding_window must be set exactly when layer_types has a "
                f"sliding_attention layer (sliding_window={window!r})"
            )

    def _check_experts(self) -> None:
        e, k, f = self.n_experts, self.n_experts_per_token, self.moe_d_ff
        for name, value in (("n_experts", e), ("n_experts_per_token", k), ("moe_d_ff", f)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be an int >= 0, got {value!r}")
        if e == 0 and (k or f or self.norm_topk_prob):
            raise ValueError(
                "ModelConfig.n_experts_per_token / moe_d_ff / norm_topk_prob need n_experts > 0 "
                f"(got n_experts_per_token={k}, moe_d_ff={f}, norm_topk_prob={self.norm_topk_prob})"
            )
        if e and not 1 <= k <= e:
            raise ValueError(f"ModelConfig.n_experts_per_token={k} must be in [1, n_experts={e}]")
        if e and f < 1:
            raise ValueError(f"ModelConfig.moe_d_ff must be >= 1 with n_experts={e}, got {f}")
        if e and self.exact_numerics:
            raise ValueError(
                "ModelConfig.exact_numerics (model.exact_numerics) covers dense models: a routed "
                f"mixture of experts (n_experts={e}) groups tokens by expert, so a token's MLP "
                "depends on its batch"
            )
        coef = self.router_aux_loss_coef
        if not (isinstance(coef, int | float) and coef >= 0):
            raise ValueError(f"ModelConfig.router_aux_loss_coef must be >= 0, got {coef!r}")

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a routed mixture of experts (``n_experts > 0``)."""
        return self.n_experts > 0

    def layer_is_sliding(self, i: int) -> bool:
        """Whether layer ``i`` uses sliding-window attention (and the local RoPE base)."""
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"

    @property
    def mixed_layers(self) -> bool:
        """Some layers are sliding and some full (per-layer flags ride the layer scan)."""
        return len(set(self.layer_types)) > 1

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return _DTYPES[self.param_dtype]

    @property
    def jnp_compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.compute_dtype]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (N // K)."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> ModelConfig:
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def reconcile_vocab(config: ModelConfig, tokenizer_vocab_size: int) -> ModelConfig:
    """Match a checkpoint's embedding rows to its tokenizer (call once at load).

    Args:
      config: the model's configuration (``vocab_size`` = embedding rows).
      tokenizer_vocab_size: ids the tokenizer can produce (``Tokenizer.vocab_size``).

    Returns:
      ``config`` with ``valid_vocab_size`` set when the embedding is padded
      (e.g. config.json 151936 rows, tokenizer 151665 ids), None when they match.

    Raises:
      ValueError: the tokenizer has more ids than the model has rows (ids the
        model cannot embed or predict), naming both sizes.
    """
    if tokenizer_vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer_vocab_size} ids but the model's vocab_size is "
            f"{config.vocab_size}: ids >= {config.vocab_size} cannot be embedded or predicted "
            "(wrong tokenizer for this checkpoint?)"
        )
    valid = None if tokenizer_vocab_size == config.vocab_size else int(tokenizer_vocab_size)
    return config.replace(valid_vocab_size=valid)


def check_attention(name: str, sliding_window: int | None) -> None:
    """Validate ``ModelConfig.attention``.

    Raises:
      ValueError: an unknown name (lists the valid ones), or "dot_product" / "splash"
        for a model with sliding-window layers.
    """
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"ModelConfig.attention must be one of {ATTENTION_IMPLS}, got {name!r}")
    if sliding_window is not None and name in ("dot_product", "splash"):
        raise ValueError(
            f"ModelConfig.attention={name!r} does not take sliding-window layers "
            f"(sliding_window={sliding_window}); use 'blockwise', 'dense' or 'auto'"
        )
