"""Low-rank adapters (LoRA, arXiv 2106.09685) over a frozen, optionally quantized base
(QLoRA, arXiv 2305.14314), in the decoder's own terms.

A target projection W [*in, *out] (per layer) gets an adapter pair A [*in, r] and
B [r, *out] and is applied unmerged:

    y = x·W + (alpha / r) · (x·A)·B

A starts Gaussian (std 1/sqrt(fan_in)) and B at zero, so a fresh adapter leaves the
model exactly as it was (the paper's init). Targets by projection name: q, k, v, o,
gate, up, down, and optionally lm_head (the unembedding; merged into [D, V] once per
forward, W + s·A·B, because the log-softmax runs over vocabulary chunks of it).

Layout. Adapters live inside the model's own params tree, next to the weight they
adapt: ``params["layers"]["lora_q"] = Adapter(a=[L, D, r], b=[L, r, N, H])``, and
``params["lora_head"]`` for the head. So the layer scan, ``unstack_layers``, the
engine's placement and the publish path all carry them without knowing about LoRA;
``split`` / ``merge`` separate the trainable adapters from the frozen base by name.
The scale alpha/r is static pytree metadata of each ``Adapter`` (never a traced or
trained value).

Base storage (``LoraConfig.base_dtype``): float32, bfloat16, or quantized: int8 with a
per-output-channel scale, or int4 with a per-group scale over the input axis
(``group_size`` inputs per scale). A quantized weight is a ``QArray``; its ``astype``
dequantises, so the decoder's ``w.astype(compute_dtype)`` dequantises on the fly,
one layer at a time inside the scan (``models.adapters.quant``). Embeddings, norms and biases stay
unquantized.

Why not ``qwix``: qwix's LoRA provider intercepts ``einsum``/``dot_general`` inside a
Flax module's method and finds the weight among *that module's own attributes*; here
the computation is the pure ``transformer.forward`` on a dict, the weights reach each
einsum as slices of ``[L, ...]`` stacks inside a ``lax.scan``, and the learner,
engine and sync move plain pytrees, so no weight is ever found (docs/LORA.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxflash.models.adapters.quant import QArray, dequantize, quantize
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.sharding.rules import Rules, logical_to_spec

# target -> (weight key in params["layers"], input logical axes, output logical axes)
TARGETS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "q": ("w_q_ldnh", ("embed",), ("heads", "head_dim")),
    "k": ("w_k_ldkh", ("embed",), ("kv_heads", "head_dim")),
    "v": ("w_v_ldkh", ("embed",), ("kv_heads", "head_dim")),
    "o": ("w_o_lnhd", ("heads", "head_dim"), ("embed",)),
    "gate": ("w_gate_ldf", ("embed",), ("mlp",)),
    "up": ("w_up_ldf", ("embed",), ("mlp",)),
    "down": ("w_down_lfd", ("mlp",), ("embed",)),
}
HEAD = "lm_head"
_HEAD_AXES = (("embed",), ("vocab",))
_WEIGHT_TARGET = {w: t for t, (w, _, _) in TARGETS.items()}
BASE_DTYPES = ("float32", "bfloat16", "int8", "int4")
PREFIX = "lora_"  # params keys of adapters: lora_<target>, and lora_head


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """``learner.lora``: which projections get adapters, their size and the base storage.

    Attributes:
      rank: r, the adapters' inner width (>= 1).
      alpha: the scale numerator; updates are scaled by alpha / r.
      dropout: dropout on the adapter path's input; only 0.0 is supported (RL LoRA
        recipes use none, and the model's forward takes no RNG).
      targets: projection names from q, k, v, o, gate, up, down, lm_head.
      base_dtype: storage of the frozen base: float32 | bfloat16 | int8 | int4.
      group_size: int4 only: inputs per scale along each weight's input axis
        (must divide it); int8 uses one scale per output channel.
    """

    rank: int
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    base_dtype: str = "float32"
    group_size: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):  # "q,k,v" from a command line
            names = tuple(t.strip() for t in self.targets.split(",") if t.strip())
            object.__setattr__(self, "targets", names)
        else:
            object.__setattr__(self, "targets", tuple(self.targets))
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(
                f"LearnerConfig.lora.rank must be an int >= 1 (0 in the config turns LoRA "
                f"off), got {self.rank!r}"
            )
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LearnerConfig.lora.alpha must be finite and > 0, got {self.alpha}")
        if self.dropout != 0.0:
            raise ValueError(
                f"LearnerConfig.lora.dropout={self.dropout}: only 0.0 is supported "
                "(the decoder's forward takes no RNG)"
            )
        known = (*TARGETS, HEAD)
        bad = [t for t in self.targets if t not in known]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"LearnerConfig.lora.targets must be distinct names from {known}, "
                f"got {self.targets!r}"
            )
        if self.targets == (HEAD,):
            raise ValueError("LearnerConfig.lora.targets: lm_head needs at least one layer target")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"LearnerConfig.lora.base_dtype must be one of {BASE_DTYPES}, "
                f"got {self.base_dtype!r}"
            )
        if self.group_size < 1:
            raise ValueError(f"LearnerConfig.lora.group_size must be >= 1, got {self.group_size}")

    @property
    def scale(self) -> float:
        """alpha / r, the factor of the adapter path."""
        return float(self.alpha) / self.rank

    @classmethod
    def from_mapping(cls, c: Mapping[str, Any]) -> LoraConfig | None:
        """The config of ``learner.lora`` (a dict); None when rank is 0 (LoRA off).

        Raises:
          ValueError: an unknown key (naming it) or an invalid value.
        """
        c = dict(c)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(c) - known)
        if unknown:
            raise ValueError(f"LearnerConfig.lora: unknown keys {unknown}; known {sorted(known)}")
        if int(c.get("rank", 0)) == 0:
            # LoRA off: a field set away from its default would be silently ignored.
            default, given = cls(rank=1), cls(**{**c, "rank": 1})
            changed = [
                f.name
                for f in dataclasses.fields(cls)
                if f.name != "rank" and getattr(given, f.name) != getattr(default, f.name)
            ]
            if changed:
                raise ValueError(
                    f"learner.lora.{changed[0]} is set but learner.lora.rank is 0 (LoRA off): "
                    "set learner.lora.rank > 0 to train adapters"
                )
            return None
        return cls(**c)


# ------------------------------------------------------------------ pytree nodes


@flax.struct.dataclass
class Adapter:
    """One adapter pair; leaves ``a`` [(L,) *in, r] and ``b`` [(L,) r, *out] (float32).

    ``scale`` (alpha / r) is static metadata, not a leaf.
    """

    a: Any
    b: Any
    scale: float = flax.struct.field(pytree_node=False, default=1.0)


# ------------------------------------------------------------------ layout


def _target_axes(target: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    if target == HEAD:
        return "lm_head", *_HEAD_AXES
    return TARGETS[target]


def adapter_layout(model_config: ModelConfig, lora: LoraConfig) -> tuple[Any, Any]:
    """(shapes, logical axes) of the adapters tree (what the optimizer and publish see).

    Returns:
      Two trees ``{"layers": {"lora_q": Adapter, ...}, "lora_head": Adapter}`` (head
      only when targeted): float32 ``ShapeDtypeStruct`` leaves, and tuples of logical
      axis names (the rank axis is "lora_rank", replicated by every rules table).
    """
    mlp_targets = sorted({"gate", "up", "down"} & set(lora.targets))
    if getattr(model_config, "n_experts", 0) and mlp_targets:
        raise ValueError(
            f"learner.lora.targets {mlp_targets} adapt a dense MLP; this model's MLP is a "
            "mixture of experts (n_experts="
            f"{model_config.n_experts}): target the attention projections (q, k, v, o)"
        )
    dims = {
        "layers": model_config.n_layers,
        "vocab": model_config.vocab_size,
        "embed": model_config.d_model,
        "heads": model_config.n_heads,
        "kv_heads": model_config.n_kv_heads,
        "head_dim": model_config.head_dim,
        "mlp": model_config.d_ff,
        "lora_rank": lora.rank,
    }

    def pair(lead: tuple[str, ...], ins, outs):
        a_axes, b_axes = (*lead, *ins, "lora_rank"), (*lead, "lora_rank", *outs)

        def sds(axes):
            return jax.ShapeDtypeStruct(tuple(dims[a] for a in axes), jnp.float32)

        return (
            Adapter(a=sds(a_axes), b=sds(b_axes), scale=lora.scale),
            Adapter(a=a_axes, b=b_axes, scale=lora.scale),
        )

    shapes: dict[str, Any] = {"layers": {}}
    axes: dict[str, Any] = {"layers": {}}
    for t in lora.targets:
        _, ins, outs = _target_axes(t)
        if t == HEAD:
            shapes["lora_head"], axes["lora_head"] = pair((), ins, outs)
        else:
            shapes["layers"][PREFIX + t], axes["layers"][PREFIX + t] = pair(("layers",), ins, outs)
    return shapes, axes


def _quantized_names(params_layers: Mapping[str, Any]) -> list[str]:
    return [w for w in _WEIGHT_TARGET if w in params_layers]


def base_layout(base_shapes: Any, base_axes: Any, lora: LoraConfig) -> tuple[Any, Any]:
    """(shapes, axes) of the frozen base as stored under ``lora.base_dtype``.

    Args:
      base_shapes, base_axes: ``transformer.abstract_params`` / ``transformer.logical_axes``.
    """
    if lora.base_dtype in ("float32", "bfloat16"):
        dt = jnp.dtype(lora.base_dtype)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), base_shapes), base_axes
    shapes = jax.eval_shape(lambda p: quantize_base(p, lora), base_shapes)
    axes = {**base_axes, "layers": dict(base_axes["layers"])}
    for name in _quantized_names(base_axes["layers"]):
        n_out = len(TARGETS[_WEIGHT_TARGET[name]][2])
        ax = base_axes["layers"][name]
        axes["layers"][name] = QArray(
            q=ax, scale=(ax[0], None, *ax[len(ax) - n_out :]), n_out=n_out
        )
    if "lm_head_dv" in base_axes:
        ax = base_axes["lm_head_dv"]
        axes["lm_head_dv"] = QArray(q=ax, scale=(None, ax[1]), n_out=1)
    return shapes, axes


def quantize_base(params: Any, lora: LoraConfig) -> Any:
    """The base params in ``lora.base_dtype``: cast, or projections (and an untied
    lm_head) quantized to ``QArray`` with the rest unchanged. Traceable (jit it)."""
    if lora.base_dtype in ("float32", "bfloat16"):
        return jax.tree.map(lambda x: x.astype(lora.base_dtype), params)
    bits = 8 if lora.base_dtype == "int8" else 4
    layers = dict(params["layers"])
    for name in _quantized_names(layers):
        n_out = len(TARGETS[_WEIGHT_TARGET[name]][2])
        layers[name] = quantize(
            layers[name], n_out=n_out, n_lead=1, bits=bits, group_size=lora.group_size
        )
    out = {**params, "layers": layers}
    if "lm_head_dv" in params:
        out["lm_head_dv"] = quantize(
            params["lm_head_dv"], n_out=1, n_lead=0, bits=bits, group_size=lora.group_size
        )
    return out


def init_adapters(model_config: ModelConfig, lora: LoraConfig, key: jax.Array) -> Any:
    """Fresh adapters: A ~ N(0, 1/fan_in), B = 0 (arXiv 2106.09685, section 4.1)."""
    shapes, axes = adapter_layout(model_config, lora)
    leaves, treedef = jax.tree.flatten(shapes)
    axis_leaves = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, s, ax in zip(keys, leaves, axis_leaves, strict=True):
        if ax[-1] == "lora_rank":  # an A: fan_in is every axis but the layer and rank axes
            fan_in = math.prod(n for n, a in zip(s.shape, ax, strict=True) if a != "layers") // (
                lora.rank
            )
            out.append(jax.random.normal(k, s.shape, s.dtype) * fan_in**-0.5)
        else:
            out.append(jnp.zeros(s.shape, s.dtype))
    return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------ trees


def is_adapter_key(key: str) -> bool:
    return key.startswith(PREFIX)


def split(params: Any) -> tuple[Any, Any]:
    """(adapters, base) of a LoRA model's params; adapters keep the nesting
    (``{"layers": {...}, "lora_head": ...}``); layers stacked or unstacked."""

    def layer_split(lp):
        return (
            {k: v for k, v in lp.items() if is_adapter_key(k)},
            {k: v for k, v in lp.items() if not is_adapter_key(k)},
        )

    layers = params["layers"]
    if isinstance(layers, tuple | list):
        pairs = [layer_split(lp) for lp in layers]
        ad_layers, base_layers = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    else:
        ad_layers, base_layers = layer_split(layers)
    adapters = {"layers": ad_layers, **{k: v for k, v in params.items() if is_adapter_key(k)}}
    base = {k: v for k, v in params.items() if k != "layers" and not is_adapter_key(k)}
    return adapters, {**base, "layers": base_layers}


def merge(base: Any, adapters: Any) -> Any:
    """The LoRA model's params: ``base`` with the adapters beside their weights (no
    copy). Both trees must have the same layers layout (stacked, or unstacked)."""
    layers, ad_layers = base["layers"], adapters["layers"]
    if isinstance(layers, tuple | list):
        merged = tuple({**lp, **ap} for lp, ap in zip(layers, ad_layers, strict=True))
    else:
        merged = {**layers, **ad_layers}
    return {**base, **{k: v for k, v in adapters.items() if k != "layers"}, "layers": merged}


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays of ``tree`` (what a publish of it moves)."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------ the decoder's hooks


def _delta(x: jax.Array, adapter: Adapter, n_in: int) -> jax.Array:
    """s · (x·A)·B, contracting the trailing ``n_in`` axes of x; in x's dtype."""
    cd = x.dtype
    xa = jnp.tensordot(x, adapter.a.astype(cd), axes=n_in)
    return jnp.tensordot(xa, adapter.b.astype(cd), axes=1) * jnp.asarray(adapter.scale, cd)


def add_delta(y: jax.Array, x: jax.Array, lp: Mapping[str, Any], weight: str) -> jax.Array:
    """``y`` + the adapter of ``weight`` applied to ``x`` (y unchanged without one).

    Args:
      y: [B, T, *out] the base projection x·W.
      x: [B, T, *in] its input, compute dtype.
      lp: one layer's params (may hold ``lora_<target>``).
      weight: the base weight's key, e.g. "w_q_ldnh".
    """
    target = _WEIGHT_TARGET[weight]
    adapter = lp.get(PREFIX + target)
    if adapter is None:
        return y
    return y + _delta(x, adapter, len(TARGETS[target][1])).astype(y.dtype)


def adapted_weights(lp: Mapping[str, Any]) -> frozenset[str]:
    """The base weights of one layer's params that carry an adapter (their keys, e.g.
    "w_q_ldnh"); empty without LoRA, so the decoder adds no adapter code."""
    return frozenset(w for w, t in _WEIGHT_TARGET.items() if PREFIX + t in lp)


def head_weight(w_dv: jax.Array, params: Mapping[str, Any]) -> jax.Array:
    """The unembedding [D, V] (dequantised if stored as a ``QArray``) with the head
    adapter merged (W + s·A·B), if any."""
    if isinstance(w_dv, QArray):
        w_dv = dequantize(w_dv)
    adapter = params.get("lora_head")
    if adapter is None:
        return w_dv
    dt = w_dv.dtype
    return w_dv + (jnp.asarray(adapter.scale, jnp.float32) * (adapter.a @ adapter.b)).astype(dt)


# ------------------------------------------------------------------ shardings


def layout_shardings(axes: Any, shapes: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedSharding per leaf of a LoRA layout (``adapter_layout`` / ``base_layout`` /
    ``transformer.lora_model_layout``); the rank axis and a QArray's group axis are replicated."""

    def one(ax: tuple, s: Any) -> NamedSharding:
        ax = tuple(None if a == "lora_rank" else a for a in ax)
        return NamedSharding(mesh, logical_to_spec(ax, mesh, rules, tuple(s.shape)))

    return jax.tree.map(one, axes, shapes, is_leaf=lambda x: isinstance(x, tuple))
