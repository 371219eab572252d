"""The engine's parameter layout: layers unstacked, placed on the generation mesh.

The learner and weight sync hold params with layers stacked on a leading [L] axis
(``models.llama``). The engine decodes with the layers unrolled, each layer's
weights a separate buffer, because slicing a layer out of the stack inside the
decode program copies its weights at every step (about 60 ms of the step at the
SmolLM2-135M shape on CPU). ``place`` converts once per weight update instead:
stacked params (host or device, any sharding) -> unstacked params on the engine
mesh with each layer leaf sharded like its stacked parent minus the layer axis.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.models import lora as lora_lib
from jaxflash.models.config import ModelConfig
from jaxflash.models.llama import abstract_params, logical_axes, lora_model_layout, unstack_layers
from jaxflash.models.lora import LoraConfig
from jaxflash.sharding.rules import Rules, logical_to_shardings


def engine_shardings(
    model_config: ModelConfig, mesh: Mesh, rules: Rules | None, lora: LoraConfig | None = None
) -> Any:
    """NamedShardings of unstacked params on ``mesh`` (replicated without rules).

    Args:
      lora: the LoRA model's layout (stored base + adapters, ``models.lora``) instead
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


def place(params: Any, shardings: Any, mesh: Mesh) -> Any:
    """Unstacked params on the engine mesh.

    Stacked or unstacked input. Leaves already on exactly the mesh's devices with
    the target sharding are kept; device arrays of a stacked layout are sliced by
    one jitted program (one copy of the weights per weight update); host (numpy)
    leaves are sliced on the host (views) and copied once.

    Args:
      params: nested dict (models CONTRACTS layout, layers stacked or not).
      shardings: ``engine_shardings(...)``.
      mesh: the engine mesh.

    Returns:
      Params with ``layers`` a tuple of per-layer dicts, every leaf on ``mesh``.
    """
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
        unstacked = _unstacker(jax.tree.structure(out), tuple(jax.tree.leaves(out)))(layers)
        params = {**params, "layers": unstacked}
    elif stacked:
        params = unstack_layers(jax.tree.map(np.asarray, params))

    def put(leaf, sh: NamedSharding):
        if on_mesh(leaf) and leaf.sharding.is_equivalent_to(sh, leaf.ndim):
            return leaf
        return jax.device_put(leaf, sh)

    return jax.tree.map(put, params, shardings)


UNSTACK_TRACES = [0]  # times the unstacking was traced (tests: one per layout, not per update)


@functools.lru_cache(maxsize=16)
def _unstacker(out_tree: Any, out_leaves: tuple) -> Any:
    """The jitted layer unstacking for one target layout, built once and reused.

    A fresh ``jax.jit`` per update recompiled at every publish (about 12 s a step at
    the SmolLM2-135M shape on CPU); keyed by the output shardings (hashable), jit's
    own cache then covers the input shapes and shardings.
    """

    def unstack(layers):
        UNSTACK_TRACES[0] += 1
        return unstack_layers({"layers": layers})["layers"]

    return jax.jit(unstack, out_shardings=jax.tree.unflatten(out_tree, out_leaves))
