"""The engine's parameter layout: layers unstacked, placed on the generation mesh.

The learner and weight sync hold params with layers stacked on a leading [L] axis
(``models.decoder.transformer``). The engine decodes with the layers unrolled, each layer's
weights a separate buffer, because slicing a layer out of the stack inside the
decode program copies its weights at every step (about 60 ms of the step at the
SmolLM2-135M shape on CPU). ``place`` converts once per weight update instead:
stacked params (host or device, any sharding) -> unstacked params on the engine
mesh with each layer leaf sharded like its stacked parent minus the layer axis.

With bfloat16 compute over float32 master weights, ``place`` also stores every
layer weight the model only multiplies in the compute dtype (``engine_dtypes``:
the projection, MLP and expert matrices and the qkv biases, which
``models.decoder.transformer`` casts to ``compute_dtype`` before use anyway). A decode step then
reads 2 bytes per weight instead of 4, and the decode program no longer converts
the float32 copy on every call (XLA hoists that convert out of the decode loop but
runs it once per block: on the compiled TPU program of Qwen2.5-1.5B, 6 bytes of
HBM traffic per weight per block and a bfloat16 copy of every layer in its
temporaries). Tokens and logprobs are bit-identical (the same cast, done once).
Norm scales and the embedding stay in the param dtype: RMSNorm runs in float32 and
the logits are a float32 matmul with float32 master weights, as in the learner.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.models.adapters import lora as lora_lib
from jaxflash.models.adapters.lora import LoraConfig
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.transformer import (
    abstract_params,
    logical_axes,
    lora_model_layout,
    unstack_layers,
)
from jaxflash.sharding.rules import Rules, logical_to_shardings


def engine_shardings(
    model_config: ModelConfig, mesh: Mesh, rules: Rules | None, lora: LoraConfig | None = None
) -> Any:
    """NamedShardings of unstacked params on ``mesh`` (replicated without rules).

    Args:
      lora: the LoRA model's layout (stored base + adapters, ``models.adapters.lora``) instead
        of the plain model's.

    Returns:
      The params tree of ``unstack_layers(params)`` with a NamedSharding per leaf.
    """
    rep = NamedSharding(mesh, PartitionSpec())
    if lora is not None:
        shapes, axes = lora_model_layout(model_config, lora)
        if rules is None:
            stacked = jax.tree.map(lambda _: rep, shapes)
        else:
            stacked = lora_lib.layout_shardings(axes, shapes, mesh, rules)
    elif rules is None:
        stacked = jax.tree.map(lambda _: rep, abstract_params(model_config))
    else:
        stacked = logical_to_shardings(
            logical_axes(model_config), mesh, rules, shapes=abstract_params(model_config)
        )

    def drop_layer_axis(sh: NamedSharding) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*tuple(sh.spec)[1:]))

    layer = jax.tree.map(drop_layer_axis, stacked["layers"])
    return {**stacked, "layers": (layer,) * model_config.n_layers}


def narrow_dtype(model_config: ModelConfig, lora: LoraConfig | None = None) -> Any:
    """The dtype the engine stores its matmul-only layer weights in, or None (as given).

    The compute dtype when it is narrower than the param dtype (bfloat16 compute
    over float32 master weights) and the engine serves no LoRA adapters (a LoRA
    engine's stored base has its own dtype, ``LoraConfig.base_dtype``).
    """
    param, compute = model_config.jnp_param_dtype, model_config.jnp_compute_dtype
    if lora is not None or jnp.dtype(compute).itemsize >= jnp.dtype(param).itemsize:
        return None
    return compute


def _matmul_only(name: str) -> bool:
    """A layer leaf ``models.decoder.transformer`` only uses cast to the compute dtype: the weight
    matrices (``w_*``: projections, MLP, router and experts) and the qkv biases."""
    return name.startswith(("w_", "b_"))


def engine_dtypes(params: Any, model_config: ModelConfig, lora: LoraConfig | None = None) -> Any:
    """``params``' tree (stacked or unstacked, arrays or ShapeDtypeStructs) with the
    dtype the engine holds each leaf in (module docstring; ``narrow_dtype``)."""
    narrow = narrow_dtype(model_config, lora)

    def layer(lp: dict) -> dict:
        return {
            k: narrow if narrow is not None and _matmul_only(k) else v.dtype for k, v in lp.items()
        }

    layers = params["layers"]
    out = jax.tree.map(lambda x: x.dtype, {k: v for k, v in params.items() if k != "layers"})
    if isinstance(layers, tuple | list):
        return {**out, "layers": tuple(layer(lp) for lp in layers)}
    return {**out, "layers": layer(layers)}


def as_engine_dtypes(params: Any, model_config: ModelConfig, lora: LoraConfig | None = None):
    """``params`` (stacked or unstacked, arrays or ShapeDtypeStructs) in the engine's
    dtypes (``engine_dtypes``); a no-op without a narrower compute dtype."""
    if narrow_dtype(model_config, lora) is None:
        return params
    dtypes = engine_dtypes(params, model_config, lora)

    def cast(x, dtype):
        if x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, params, dtypes)


@functools.lru_cache(maxsize=64)
def _caster(dtype: Any, sharding: NamedSharding) -> Any:
    """A jitted cast to ``dtype`` on ``sharding`` (one per dtype and layout, reused)."""
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)


def place(
    params: Any,
    shardings: Any,
    mesh: Mesh,
    model_config: ModelConfig | None = None,
    lora: LoraConfig | None = None,
) -> Any:
    """Unstacked params on the engine mesh.

    Stacked or unstacked input. Leaves already on exactly the mesh's devices with
    the target sharding are kept; device arrays of a stacked layout are sliced by
    one jitted program (one copy of the weights per weight update); host (numpy)
    leaves are sliced on the host (views) and copied once.

    Args:
      params: nested dict (models CONTRACTS layout, layers stacked or not).
      shardings: ``engine_shardings(...)``.
      mesh: the engine mesh.
      model_config, lora: the engine's model; with them, the matmul-only layer
        weights are stored in a narrower compute dtype (``engine_dtypes``), cast in
        the same program that unstacks device arrays. None keeps every dtype.

    Returns:
      Params with ``layers`` a tuple of per-layer dicts, every leaf on ``mesh``.
    """
    narrow = None if model_config is None else narrow_dtype(model_config, lora)
    devices = set(mesh.devices.flat)

    def on_mesh(leaf) -> bool:
        return isinstance(leaf, jax.Array) and set(leaf.sharding.device_set) == devices

    stacked = not isinstance(params["layers"], tuple | list)
    if stacked and any(isinstance(x, jax.Array) for x in jax.tree.leaves(params["layers"])):
        # Device arrays: bring the stack onto the mesh (sharded like the target,
        # plus the layer axis) if needed, then slice it in one program.
        def stack_sharding(sh: NamedSharding) -> NamedSharding:
            return NamedSharding(mesh, PartitionSpec(None, *sh.spec))

        layer_sh = jax.tree.map(stack_sharding, shardings["layers"][0])
        layers = jax.tree.map(
            lambda x, sh: x if on_mesh(x) else jax.device_put(x, sh), params["layers"], layer_sh
        )
        out = shardings["layers"]
        unstacker = _unstacker(jax.tree.structure(out), tuple(jax.tree.leaves(out)), narrow)
        unstacked = unstacker(layers)
        params = {**params, "layers": unstacked}
    elif stacked:
        params = unstack_layers(jax.tree.map(np.asarray, params))

    def put(leaf, sh: NamedSharding):
        if on_mesh(leaf) and leaf.sharding.is_equivalent_to(sh, leaf.ndim):
            return leaf
        return jax.device_put(leaf, sh)

    placed = jax.tree.map(put, params, shardings)
    if narrow is None:
        return placed
    # Leaves not cast by the unstacking (host params, unstacked ones): one cast each.
    dtypes = engine_dtypes(placed, model_config, lora)
    return jax.tree.map(
        lambda x, d, sh: x if x.dtype == d else _caster(d, sh)(x), placed, dtypes, shardings
    )


UNSTACK_TRACES = [0]  # times the unstacking was traced (tests: one per layout, not per update)


def unstack_to_engine(layers: Any, narrow: Any = None) -> tuple:
    """Stacked layers -> a tuple of per-layer dicts, the matmul-only weights cast to
    ``narrow`` (``narrow_dtype``; None keeps dtypes): the install program's body."""
    unstacked = unstack_layers({"layers": layers})["layers"]
    if narrow is None:
        return unstacked
    return tuple(
        {k: v.astype(narrow) if _matmul_only(k) else v for k, v in lp.items()} for lp in unstacked
    )


@functools.lru_cache(maxsize=16)
def _unstacker(out_tree: Any, out_leaves: tuple, narrow: Any = None) -> Any:
    """The jitted layer unstacking (and cast, ``unstack_to_engine``) for one target
    layout, built once and reused.

    A fresh ``jax.jit`` per update recompiled at every publish (about 12 s a step at
    the SmolLM2-135M shape on CPU); keyed by the output shardings (hashable) and the
    dtype, jit's own cache then covers the input shapes and shardings.
    """

    def unstack(layers):
        UNSTACK_TRACES[0] += 1
        return unstack_to_engine(layers, narrow)

    return jax.jit(unstack, out_shardings=jax.tree.unflatten(out_tree, out_leaves))
