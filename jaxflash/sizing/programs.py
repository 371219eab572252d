"""Every device program of a run, lowered against abstract arrays with their shardings.

Each ``*_program`` returns ``Lowerable``s: a name, the role whose chips run it,
and a thunk giving ``jax.jit(...).lower(abstract args)``. ``jaxflash.sizing.plan``
compiles them (for the local devices, fake CPU devices, or a TPU slice's
compile-only chips) and reads XLA's memory and cost analyses.

Programs (what the live run executes):

- ``train_step``: the learner step at [M, b, T] (``learner.step``), with the KL
  reference's forward inside it when ``learner.kl_coef > 0``; attention as
  ``model.attention`` resolves on the mesh's chips (splash on TPU).
- ``prefill_<bucket>``: the engine's prefill at each power-of-two bucket up to
  ``max_prefill_length`` (``prefill_rows`` rows).
- ``decode_block_<n>``: the slot loop's ``generate_block`` of ``decode_block``
  steps over all slots.
- ``publish``: the learner -> generation weight copy's program (``sync.publish``):
  params resharded on the learner's chips to the engine's layout.
- ``install``: the engine placing published (stacked) weights as its unstacked
  layers (``generation.engine.params.place``; with bfloat16 compute over float32
  weights, the matmul weights cast to bfloat16 in the same program), on the
  generation chips.
- ``elastic_<a>to<b>``: the per-leaf programs ``sync.reshard`` runs when an
  elastic move resizes the learner from a to b devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.generation.engine.host_arrays import stop_array
from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.params import (
    as_engine_dtypes,
    engine_shardings,
    narrow_dtype,
    unstack_to_engine,
)
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.engine.state import state_shardings as engine_state_shardings
from jaxflash.learner.batching import INT_FIELDS, TRAIN_BATCH_FIELDS
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.device_batch import batch_sharding, mesh_context
from jaxflash.learner.state import abstract_train_state, state_shardings
from jaxflash.learner.step import make_train_step
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
from jaxflash.sync.publish import staging_shardings
from jaxflash.sync.reshard import shards_present, staging_sharding


@dataclasses.dataclass(frozen=True)
class Lowerable:
    """One program to compile.

    Attributes:
      name: e.g. "train_step", "prefill_512".
      role: "learner" or "generation": whose chips run it.
      mesh: the mesh it runs on.
      lower: () -> ``jax.stages.Lowered``.
      arg_bytes: per-device bytes of its arguments (from their shardings), for a
        program the compiler refuses as too large.
      count: how many times the run executes it per occasion (an elastic move's
        leaves of one shape), or the trips of the while loop it is (a decode block's
        steps: XLA's cost analysis counts a loop body once); costs are multiplied by it.
      loop_trips: a decode block's steps: its HBM bytes are also read from the compiled
        TPU program instruction by instruction (``sizing.hbm_traffic``), the loop body
        counted this many times; 0 for programs without that count.
    """

    name: str
    role: str
    mesh: Mesh
    lower: Callable[[], Any]
    arg_bytes: int
    count: int = 1
    loop_trips: int = 0


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct``s / arrays (the
    largest shard over devices; replicated leaves count whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _abstract(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def train_step_program(
    model: ModelConfig,
    learner: LearnerConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    batch_size: int,
    seq_len: int,
) -> tuple[Lowerable, Any]:
    """The learner step at [batch_size, seq_len]; also returns the abstract TrainState.

    Raises:
      ValueError: batch_size not a positive multiple of ``learner.micro_batch_size``.
    """
    b = learner.micro_batch_size
    if batch_size < 1 or batch_size % b:
        raise ValueError(f"batch_size={batch_size} must be a positive multiple of micro={b}")
    step = make_train_step(model, learner, mesh, rules)
    state = abstract_train_state(model, learner, mesh, rules)
    sharding = batch_sharding(mesh, rules, b)
    shape = (batch_size // b, b, seq_len)
    batch = {
        k: jax.ShapeDtypeStruct(
            shape, np.int32 if k in INT_FIELDS else np.float32, sharding=sharding
        )
        for k in TRAIN_BATCH_FIELDS
    }
    jitted = step._jitted  # noqa: SLF001 (TrainStep has no AOT entry point of its own)

    def lower():
        # On TPU attention is the splash kernel: its shard_map reads the mesh, and a
        # Pallas kernel lowers for compile-only chips once one is the default device.
        with mesh_context(mesh, model), jax.default_device(mesh.devices.flat[0]):
            return jitted.lower(state, batch)

    prog = Lowerable("train_step", "learner", mesh, lower, per_device_bytes((state, batch)))
    return prog, state


def prefill_buckets(config: EngineConfig) -> list[int]:
    """Every prefill bucket the engine can compile: powers of two from
    ``min_prefill_bucket``, and ``max_prefill_length`` itself."""
    out, b = [], config.min_prefill_bucket
    while b < config.max_prefill_length:
        out.append(b)
        b *= 2
    return [*out, config.max_prefill_length]


def engine_programs(
    model: ModelConfig,
    config: EngineConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    buckets: Sequence[int] | None = None,
    lora: LoraConfig | None = None,
) -> tuple[list[Lowerable], Any, Any]:
    """Prefill at every bucket (or at ``buckets``) and the decode block on one slice.

    Args:
      lora: a LoRA engine's programs: the stored (cast / quantized) base with the
        adapters beside their weights.

    Returns:
      (programs, abstract engine params (unstacked, in the dtypes the engine holds:
      ``generation.engine.params.engine_dtypes``), abstract DecodeState).
    """
    engine = LlamaEngine(model, config, mesh=mesh, rules=rules, lora=lora)
    stacked = abstract_params(model) if lora is None else lora_model_layout(model, lora)[0]
    shapes = jax.eval_shape(unstack_layers, stacked)
    shapes = as_engine_dtypes(shapes, model, lora)
    params = _abstract(shapes, engine_shardings(model, mesh, rules, lora))
    rep = NamedSharding(mesh, PartitionSpec())
    # The engine's own config: "auto" paged attention resolved (the kernel flag is part
    # of the state's tree).
    state_sh, _ = engine_state_shardings(model, engine.config, mesh, rules)
    state = _abstract(jax.eval_shape(engine.init_decode_state), state_sh)
    rows = config.prefill_rows
    out = []
    for bucket in prefill_buckets(config) if buckets is None else buckets:
        ids = jax.ShapeDtypeStruct((rows, bucket), np.int32, sharding=rep)
        length = jax.ShapeDtypeStruct((rows,), np.int32, sharding=rep)
        lower = lambda ids=ids, length=length: engine.prefill_jit.lower(params, ids, length)  # noqa: E731
        arg = per_device_bytes((params, ids, length))
        out.append(Lowerable(f"prefill_{bucket}", "generation", mesh, lower, arg))
    B, steps = config.max_concurrent_decodes, config.decode_block
    live = jax.ShapeDtypeStruct((B,), np.bool_, sharding=rep)
    stop = jax.ShapeDtypeStruct(stop_array([]).shape, np.int32, sharding=rep)
    block = engine.generate_block_jit(steps)  # the slot loop's program

    def lower():
        # A Pallas kernel (the paged engine's ragged_paged_attention) lowers for
        # compile-only chips once one is the default device (Mosaic reads its kind).
        with jax.default_device(mesh.devices.flat[0]):
            return block.lower(params, state, live, stop)

    # count=steps: the block is a while loop, whose body XLA's cost analysis counts once.
    arg = per_device_bytes((params, state))
    out.append(
        Lowerable(f"decode_block_{steps}", "generation", mesh, lower, arg, count=steps,
                  loop_trips=steps)
    )  # fmt: skip
    return out, params, state


def publish_programs(
    model: ModelConfig,
    learner_params: Any,
    generation_mesh: Mesh,
    rules: Rules,
    lora: LoraConfig | None = None,
) -> list[Lowerable]:
    """The weight publish: staging reshard on the learner's chips (``sync.publish``),
    then the engine's unstacking of the copy on the generation chips. Under ``lora``
    both move the adapters only (``learner_params`` are the adapters; the base is
    placed once, outside the step)."""
    learner_mesh = jax.tree.leaves(learner_params)[0].sharding.mesh
    if lora is None:
        shapes = abstract_params(model)
        targets = logical_to_shardings(logical_axes(model), generation_mesh, rules, shapes=shapes)
        eng = engine_shardings(model, generation_mesh, rules)
    else:
        shapes, axes = lora_lib.adapter_layout(model, lora)
        targets = lora_lib.layout_shardings(axes, shapes, generation_mesh, rules)
        eng = lora_lib.split(engine_shardings(model, generation_mesh, rules, lora))[0]
    staging = staging_shardings(learner_params, targets)
    fn = jax.jit(lambda p: p, out_shardings=staging)
    publish = Lowerable(
        "publish", "learner", learner_mesh, lambda: fn.lower(learner_params),
        per_device_bytes(learner_params),
    )  # fmt: skip
    # What the engine receives: stacked layers on its mesh (the layer axis unsplit).
    stack_sh = jax.tree.map(
        lambda sh: NamedSharding(generation_mesh, PartitionSpec(None, *sh.spec)), eng["layers"][0]
    )
    stacked = _abstract(shapes["layers"], stack_sh)
    narrow = narrow_dtype(model, lora)
    unstack = jax.jit(lambda layers: unstack_to_engine(layers, narrow), out_shardings=eng["layers"])
    install = Lowerable(
        "install", "generation", generation_mesh, lambda: unstack.lower(stacked),
        per_device_bytes(stacked),
    )  # fmt: skip
    return [publish, install]


def elastic_programs(
    model: ModelConfig,
    learner: LearnerConfig,
    state: Any,
    target_mesh: Mesh,
    rules: Rules,
) -> list[Lowerable]:
    """The device programs ``sync.reshard`` runs to move the TrainState onto
    ``target_mesh``, one per distinct leaf (count = leaves of that shape and layout).

    Per leaf (see ``sync.reshard``): ``direct`` is a device-to-device copy (no
    program); ``staged`` a jitted identity on the source chips; ``via_replicated``
    an all-gather on the source chips then a slice on the target chips.
    """
    targets = state_shardings(model, learner, target_mesh, rules)
    source = jax.tree.leaves(state.params)[0].sharding.mesh
    name = f"elastic_{source.devices.size}to{target_mesh.devices.size}"
    groups: dict[tuple, list] = {}
    leaves = jax.tree.leaves(state)
    tleaves = jax.tree.leaves(targets, is_leaf=lambda s: isinstance(s, NamedSharding))
    for x, t in zip(leaves, tleaves, strict=True):
        key = (x.shape, str(x.dtype), x.sharding, t)
        groups.setdefault(key, []).append(x)
    out = []
    for (_, _, src, tgt), xs in groups.items():
        x = xs[0]
        if shards_present(src, tgt, x.shape):
            continue  # direct: device_put, no program
        staging = staging_sharding(src.mesh, tgt.mesh, tgt.spec)
        if staging is not None and shards_present(staging, tgt, x.shape):
            fn = jax.jit(lambda a: a, out_shardings=staging)
            out.append(
                Lowerable(f"{name}_staged", "learner", src.mesh,
                          lambda fn=fn, x=x: fn.lower(x), per_device_bytes(x), len(xs))
            )  # fmt: skip
            continue
        gather = jax.jit(lambda a: a, out_shardings=NamedSharding(src.mesh, PartitionSpec()))
        out.append(
            Lowerable(f"{name}_gather", "learner", src.mesh,
                      lambda g=gather, x=x: g.lower(x), per_device_bytes(x), len(xs))
        )  # fmt: skip
        whole = jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(tgt.mesh, PartitionSpec())
        )
        split = jax.jit(lambda a: a, out_shardings=tgt)
        out.append(
            Lowerable(f"{name}_slice", "target", tgt.mesh,
                      lambda s=split, w=whole: s.lower(w), per_device_bytes(whole), len(xs))
        )  # fmt: skip
    return out
