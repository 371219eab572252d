"""The decoder of every supported family, in Flax NNX: Llama 2/3/3.1 (SmolLM2), Qwen2
(qkv_bias), Qwen3 (qk_norm), Qwen3-MoE (n_experts: routed experts, models/decoder/moe.py),
Mistral (sliding_window) and Gemma 3 (qk_norm, norm_offset, gelu_tanh, sandwich_norm,
scale_embeddings, interleaved sliding/full layers). Each
difference is a ``ModelConfig`` field, tested against transformers (tests/models/test_families.py).

Dimension letters: B batch, T time, V vocabulary, D model width, N query heads,
K key/value heads, G = N/K queries per kv head, H head dim, F MLP width,
L layers, S cache length, E experts.

Parameters are stacked over layers (leading axis L) and the forward pass is a
``jax.lax.scan`` over that axis, so 30 layers compile as one (what the learner
differentiates). ``unstack_layers`` turns ``params["layers"]`` into a tuple of L
per-layer dicts; ``forward`` over that layout unrolls the layers in Python and, with a
``LayerKVCache``, updates each layer's own cache buffer in place — what the engine
decodes with, because XLA on CPU copies every layer's weights and the whole cache
out of and back into the stacks at each scanned decode step (the same ops either
way, so both layouts give bit-identical results). The computation is
the pure function ``forward(params, config, ...)`` on a nested dict of arrays —
what the learner differentiates, the engine decodes with and sync transfers; the
``Llama`` module only creates parameters (init, logical axes) and wraps
``forward`` for convenience.

Numerics: the residual stream, RMSNorm, RoPE, attention softmax and logits are
float32; matmul inputs are cast to ``config.compute_dtype`` (float32 or bfloat16,
with float32 master weights when param_dtype is float32).

References: Llama (arXiv 2302.13971), RoPE (arXiv 2104.09864), GQA
(arXiv 2305.13245), SwiGLU / GeGLU (arXiv 2002.05202), RMSNorm (arXiv 1910.07467),
Llama 3 RoPE scaling (arXiv 2407.21783), Mistral sliding window (arXiv 2310.06825),
Qwen3 (arXiv 2505.09388), Gemma 3 (arXiv 2503.19786).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflash.models.adapters import lora
from jaxflash.models.caches.cache_face import ModelCache, NoCache, Site
from jaxflash.models.caches.kv_cache import KVCache
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.block import decoder_layer, final_norm
from jaxflash.models.decoder.logprobs import logits_from_hidden
from jaxflash.models.decoder.params import Params, get_params

INIT_STD = 0.02  # normal init of every matrix (HF initializer_range default)
# remat keeps the outputs of the weight matmuls (projections, MLP) and recomputes
# the rest of the layer (norms, RoPE, attention, SwiGLU's activation) in the
# backward pass: recomputing the matmuls would add a third of the step's FLOPs,
# while at RL sequence lengths the saved outputs are a small part of the memory.
_REMAT_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def logical_axes(config: ModelConfig) -> dict:
    """Logical axis names of every parameter, mirroring ``get_params(model)``.

    Leaves are tuples of names (one per array dim) from: layers, vocab, embed,
    heads, kv_heads, head_dim, mlp, and with experts expert (E, the dim an
    ``expert`` mesh axis splits), expert_mlp (F of one expert) and router (E of the
    router's output, kept whole). Map with ``jax.tree.map(..., is_leaf=lambda
    x: isinstance(x, tuple))`` or ``jaxflash.sharding.rules.logical_to_shardings``.
    """
    layers = {
        "attn_norm_ld": ("layers", "embed"),
        "mlp_norm_ld": ("layers", "embed"),
        "w_q_ldnh": ("layers", "embed", "heads", "head_dim"),
        "w_k_ldkh": ("layers", "embed", "kv_heads", "head_dim"),
        "w_v_ldkh": ("layers", "embed", "kv_heads", "head_dim"),
        "w_o_lnhd": ("layers", "heads", "head_dim", "embed"),
        "w_gate_ldf": ("layers", "embed", "mlp"),
        "w_up_ldf": ("layers", "embed", "mlp"),
        "w_down_lfd": ("layers", "mlp", "embed"),
    }
    if config.is_moe:  # the routed experts replace the dense MLP on every layer
        for name in ("w_gate_ldf", "w_up_ldf", "w_down_lfd"):
            del layers[name]
        layers["w_router_lde"] = ("layers", "embed", "router")
        layers["w_gate_ledf"] = ("layers", "expert", "embed", "expert_mlp")
        layers["w_up_ledf"] = ("layers", "expert", "embed", "expert_mlp")
        layers["w_down_lefd"] = ("layers", "expert", "expert_mlp", "embed")
    if config.qk_norm:
        layers["q_norm_lh"] = ("layers", "head_dim")
        layers["k_norm_lh"] = ("layers", "head_dim")
    if config.sandwich_norm:
        layers["post_attn_norm_ld"] = ("layers", "embed")
        layers["post_mlp_norm_ld"] = ("layers", "embed")
    if config.qkv_bias:
        layers["b_q_lnh"] = ("layers", "heads", "head_dim")
        layers["b_k_lkh"] = ("layers", "kv_heads", "head_dim")
        layers["b_v_lkh"] = ("layers", "kv_heads", "head_dim")
    axes = {"embed_vd": ("vocab", "embed"), "final_norm_d": ("embed",), "layers": layers}
    if not config.tie_embeddings:
        axes["lm_head_dv"] = ("embed", "vocab")
    return axes


def _shapes(config: ModelConfig) -> dict:
    c = config
    dims = {
        "layers": c.n_layers,
        "vocab": c.vocab_size,
        "embed": c.d_model,
        "heads": c.n_heads,
        "kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "mlp": c.d_ff,
        "expert": c.n_experts,
        "router": c.n_experts,
        "expert_mlp": c.moe_d_ff,
    }
    return jax.tree.map(
        lambda axes: tuple(dims[a] for a in axes),
        logical_axes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )


class _Layers(nnx.Module):
    """Holds the [L, ...] stacked per-layer parameters (no computation)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        shapes, axes = _shapes(config)["layers"], logical_axes(config)["layers"]
        normal = nnx.initializers.normal(INIT_STD)
        dtype = config.jnp_param_dtype
        for name in sorted(shapes):
            if "norm" in name:  # effective scale 1: (norm_offset + w) = 1
                value = jnp.full(shapes[name], 1.0 - config.norm_offset, dtype)
            elif name.startswith("b_"):
                value = jnp.zeros(shapes[name], dtype)
            else:
                value = normal(rngs.params(), shapes[name], dtype)
            setattr(self, name, nnx.Param(value, logical_axes=axes[name]))


class Llama(nnx.Module):
    """The decoder as an NNX module; parameters per docs/CONTRACTS.md.

    Args:
      config: shapes and numerics.
      rngs: ``nnx.Rngs`` for the normal(0.02) init (norms scale by 1, biases 0).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        shapes, axes = _shapes(config), logical_axes(config)
        normal = nnx.initializers.normal(INIT_STD)
        dtype = config.jnp_param_dtype
        self.embed_vd = nnx.Param(
            normal(rngs.params(), shapes["embed_vd"], dtype), logical_axes=axes["embed_vd"]
        )
        self.layers = _Layers(config, rngs)
        self.final_norm_d = nnx.Param(
            jnp.full(shapes["final_norm_d"], 1.0 - config.norm_offset, dtype),
            logical_axes=("embed",),
        )
        if not config.tie_embeddings:
            self.lm_head_dv = nnx.Param(
                normal(rngs.params(), shapes["lm_head_dv"], dtype), logical_axes=("embed", "vocab")
            )

    def hidden(
        self, input_ids_bt: jax.Array, positions_bt: jax.Array, *, kv_cache: KVCache | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        """Final-normed hidden states; see ``forward``."""
        return forward(get_params(self), self.config, input_ids_bt, positions_bt, kv_cache)

    def unembed_dv(self) -> jax.Array:
        """[D, V] unembedding (embed_vd transposed when tied)."""
        return unembed(get_params(self), self.config)

    def __call__(
        self, input_ids_bt: jax.Array, positions_bt: jax.Array, *, kv_cache: KVCache | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        """(float32 logits [B, T, V], updated cache or None); see ``forward``."""
        h_btd, kv_cache = self.hidden(input_ids_bt, positions_bt, kv_cache=kv_cache)
        return logits_from_hidden(h_btd, self.unembed_dv()), kv_cache


def init_params(config: ModelConfig, seed: int = 0) -> Params:
    """Freshly initialised parameters as a nested dict (jit it with out_shardings
    to create them already sharded)."""
    return get_params(Llama(config, rngs=nnx.Rngs(seed)))


def abstract_params(config: ModelConfig) -> Params:
    """Nested dict of ``jax.ShapeDtypeStruct`` — the layout, without allocating."""
    return get_params(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))


def unembed(params: Params, config: ModelConfig) -> jax.Array:
    """[D, V] unembedding matrix: ``embed_vd.T`` if tied, else ``lm_head_dv`` (plus
    the merged head adapter of a LoRA model, ``models.adapters.lora``)."""
    w_dv = params["embed_vd"].T if config.tie_embeddings else params["lm_head_dv"]
    return lora.head_weight(w_dv, params)


def lora_model_layout(config: ModelConfig, lora_config: lora.LoraConfig) -> tuple[Params, Params]:
    """(shapes, logical axes) of a LoRA model's params: the stored base with the adapters
    beside their weights (what the engine holds, layers stacked; ``models.adapters.lora``)."""
    b_shapes, b_axes = lora.base_layout(abstract_params(config), logical_axes(config), lora_config)
    a_shapes, a_axes = lora.adapter_layout(config, lora_config)
    return lora.merge(b_shapes, a_shapes), lora.merge(b_axes, a_axes)


def unstack_layers(params: Params) -> Params:
    """The same params with ``layers`` as a tuple of L per-layer dicts (no [L] axis).

    ``forward`` over this layout unrolls the layers (see the module docstring).
    Params already unstacked are returned unchanged.
    """
    layers = params["layers"]
    if isinstance(layers, tuple | list):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n))}


def stack_layers(params: Params) -> Params:
    """Inverse of ``unstack_layers``: ``layers`` as one dict of [L, ...] arrays."""
    layers = params["layers"]
    if not isinstance(layers, tuple | list):
        return params
    return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def forward(
    params: Params,
    config: ModelConfig,
    input_ids_bt: jax.Array,
    positions_bt: jax.Array,
    kv_cache: ModelCache | None = None,
    *,
    segment_ids_bt: jax.Array | None = None,
    fresh_cache: bool = False,
) -> tuple[jax.Array, ModelCache | None]:
    """Pure forward pass: token ids -> final-normed hidden states.

    Without a cache, attention is causal over the T axis (token t sees tokens
    0..t of its row); ``positions_bt`` only sets RoPE angles. With a cache, each
    token's k/v is first written at cache position ``positions_bt[b, t]`` of row
    b, then the token attends to cache entries j <= positions_bt[b, t] (stale
    entries beyond it are ignored, so slots are reused without clearing). Each
    layer calls its cache's ``attend`` (``models.caches.cache_face``), whatever its kind.

    Args:
      params: nested dict per docs/CONTRACTS.md (``get_params`` / ``init_params``),
        layers stacked ([L, ...] arrays, run as a ``lax.scan``) or unstacked
        (``unstack_layers``: a tuple of per-layer dicts, run unrolled).
      config: static model configuration (hashable; close over it under jit).
      input_ids_bt: int32 [B, T] token ids in [0, V).
      positions_bt: int32 [B, T] absolute 0-based positions; with a cache they
        must be < S (positions outside [0, S) are not written to the cache).
      kv_cache: optional ``cache_face.ModelCache`` with the same B: ``KVCache``
        [L, B, S, K, H] for stacked params, ``LayerKVCache`` (L x [B, S, K, H]) or
        ``PagedKVCache`` (``models.caches.paged_kv_cache``: page pools + a page table) for
        unstacked ones (``ModelCache.stacked`` says which).
      segment_ids_bt: without a cache only: int32 [B, T] ids of the sequences packed
        into each row (a token attends to earlier tokens of its own segment; RoPE
        positions should restart per segment). None: each row is one sequence.
        Attention runs as ``config.attention`` says (``models.caches.attention``).
      fresh_cache: the (dense) cache holds nothing a query may see, and row b's
        tokens sit at positions 0..T-1 (a prefill): attention is then causal
        self-attention over the T new tokens, computed as ``config.attention`` says
        (O(T) memory except "dense"), and k/v are written into the cache after it. Same result as
        the cached pass to float rounding, without its [T, S] scores
        (``cache_face.FreshPrefill``).

    Returns:
      (h_btd float32 [B, T, D], updated cache of the same type, or None). Logits
      are ``logits_from_hidden(h_btd, unembed(params, config))``.

    Raises:
      ValueError: if input and position shapes differ, the cache's batch differs,
        the cache layout does not match the params layout, segment ids come with
        a cache or in another shape, or ``fresh_cache`` comes without a dense cache.
    """
    if fresh_cache and kv_cache is None:
        raise ValueError("forward: fresh_cache=True needs a KVCache or LayerKVCache, got None")
    h_btd, cache, _ = _forward(
        params, config, input_ids_bt, positions_bt, kv_cache, False, segment_ids_bt, fresh_cache
    )
    return h_btd, cache


def forward_with_router_logits(
    params: Params,
    config: ModelConfig,
    input_ids_bt: jax.Array,
    positions_bt: jax.Array,
    *,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``forward`` without a cache that also returns every layer's router logits.

    Args:
      params, config, input_ids_bt, positions_bt, segment_ids_bt: as in ``forward``;
        ``config`` must have experts (``n_experts > 0``).

    Returns:
      (h_btd float32 [B, T, D], router logits float32 [L, B, T, E]) — what the
      load-balancing loss (``moe.load_balancing_loss``) reads.

    Raises:
      ValueError: a dense config, or the errors of ``forward``.
    """
    if not config.is_moe:
        raise ValueError("forward_with_router_logits: the config has no experts (n_experts=0)")
    h_btd, _, router = _forward(
        params, config, input_ids_bt, positions_bt, None, True, segment_ids_bt
    )
    return h_btd, router[0]


def forward_routed(
    params: Params,
    config: ModelConfig,
    input_ids_bt: jax.Array,
    positions_bt: jax.Array,
    kv_cache: ModelCache | None = None,
    *,
    replay_btlk: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    fresh_cache: bool = False,
) -> tuple[jax.Array, ModelCache | None, jax.Array, jax.Array]:
    """``forward`` of a MoE model that returns every layer's routing, and can replay one
    (R3, arXiv 2510.11370: recorded experts, gate weights from the live router,
    ``moe.route``; replaying the live routes changes no bit).

    Args:
      params, config, input_ids_bt, positions_bt, kv_cache, segment_ids_bt,
        fresh_cache: as in ``forward``; ``config`` must have experts.
      replay_btlk: optional int [B, T, L, k] experts to replay (-1: route live).

    Returns:
      (h_btd float32 [B, T, D], updated cache or None, router logits float32
      [L, B, T, E], the live top-k experts int32 [B, T, L, k] — the engine records
      these as a sample's routes).

    Raises:
      ValueError: a dense config, a ``replay_btlk`` that is not [B, T, L, k], or the
        errors of ``forward``.
    """
    if not config.is_moe:
        raise ValueError("forward_routed: the config has no experts (n_experts=0)")
    want = (*input_ids_bt.shape, config.n_layers, config.n_experts_per_token)
    if replay_btlk is not None and tuple(replay_btlk.shape) != want:
        raise ValueError(f"forward_routed: replay_btlk {replay_btlk.shape} must be {want}")
    replay_lbtk = None if replay_btlk is None else jnp.moveaxis(replay_btlk, 2, 0)
    h_btd, cache, (logits_lbte, live_lbtk) = _forward(
        params,
        config,
        input_ids_bt,
        positions_bt,
        kv_cache,
        True,
        segment_ids_bt,
        fresh_cache,
        replay_lbtk,
    )
    return h_btd, cache, logits_lbte, jnp.moveaxis(live_lbtk, 0, 2)


def _forward(
    params,
    config,
    input_ids_bt,
    positions_bt,
    kv_cache,
    collect_router,
    segments,
    fresh=False,
    replay_lbtk=None,
):
    """``forward``, plus the stacked (router logits [L, B, T, E], live experts
    [L, B, T, k]) when ``collect_router``; ``replay_lbtk``: experts to replay."""
    if input_ids_bt.shape != positions_bt.shape or input_ids_bt.ndim != 2:
        raise ValueError(
            f"forward: input_ids_bt {input_ids_bt.shape} and positions_bt "
            f"{positions_bt.shape} must both be [B, T]"
        )
    if segments is not None and (kv_cache is not None or segments.shape != input_ids_bt.shape):
        raise ValueError(
            f"forward: segment_ids_bt {segments.shape} must be [B, T] like input_ids_bt "
            f"{input_ids_bt.shape}, and is for a pass without a cache"
        )
    unrolled = isinstance(params["layers"], tuple | list)
    n_layers = len(params["layers"]) if unrolled else None
    if kv_cache is None:  # the layer caches: one per layer unrolled, one stacked for the scan
        layer_caches = (NoCache(),) * n_layers if unrolled else NoCache()
    else:
        if kv_cache.stacked == unrolled:
            want = "a LayerKVCache or PagedKVCache" if unrolled else "a KVCache"
            raise ValueError(
                f"forward: {'unstacked' if unrolled else 'stacked'} params need {want}, "
                f"got {type(kv_cache).__name__}"
            )
        if kv_cache.batch != input_ids_bt.shape[0]:
            raise ValueError(
                f"forward: kv_cache batch {kv_cache.batch} != input batch {input_ids_bt.shape[0]}"
            )
        layer_caches = kv_cache.layers(fresh=fresh)
    embed_btd = jnp.take(params["embed_vd"], input_ids_bt, axis=0)
    if config.scale_embeddings:  # HF Gemma: the sqrt(D) factor is rounded to the param dtype
        embed_btd = embed_btd * jnp.asarray(config.d_model**0.5, embed_btd.dtype)
    h_btd = embed_btd.astype(jnp.float32)
    sliding_l = [config.layer_is_sliding(i) for i in range(config.n_layers)]

    def layer_fn(sliding: bool | None):
        """The (rematerialised) layer; ``sliding`` static, or None: read from xs[2]."""

        def body(h_btd, xs):
            lp, cache, sliding_flag, replay_btk = xs
            site = Site(positions_bt, sliding_flag if sliding is None else sliding, segments)
            h_btd, cache, router = decoder_layer(config, h_btd, lp, cache, site, replay_btk)
            return h_btd, (cache, router if collect_router else None)

        if not config.remat:
            return body
        return jax.checkpoint(body, policy=_REMAT_POLICY if config.remat_policy == "dots" else None)

    if unrolled:
        bodies = {flag: layer_fn(flag) for flag in set(sliding_l)}
        # fresh: h is materialised after every layer, else the TPU compiler fuses all the
        # residual adds into one at the end that keeps every layer's f32 [B, T, D] MLP output
        # alive (Qwen2.5-1.5B, T = 2048, v5e: 1.01 vs 0.08 GiB; benchmarks/prefill_memory.py).
        new_caches, routers = [], []
        for i, (lp, cache, sliding) in enumerate(
            zip(params["layers"], layer_caches, sliding_l, strict=True)
        ):
            replay_btk = None if replay_lbtk is None else replay_lbtk[i]
            h_btd, (cache, router) = bodies[sliding](h_btd, (lp, cache, None, replay_btk))
            if fresh:
                h_btd = jax.lax.optimization_barrier(h_btd)
            new_caches.append(cache)
            routers.append(router)
        new_caches = tuple(new_caches)
        router_lbte = jax.tree.map(lambda *xs: jnp.stack(xs), *routers) if collect_router else None
    else:
        # the per-layer sliding flag rides the scan with mixed layers
        flags = jnp.asarray(sliding_l) if config.mixed_layers else None
        xs = (params["layers"], layer_caches, flags, replay_lbtk)
        body = layer_fn(None if config.mixed_layers else sliding_l[0])
        h_btd, (new_caches, router_lbte) = jax.lax.scan(body, h_btd, xs)
    cache = None if kv_cache is None else kv_cache.with_layers(new_caches)
    h_btd = final_norm(params, config, h_btd)
    return h_btd, cache, router_lbte
