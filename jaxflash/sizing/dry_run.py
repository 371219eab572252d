"""Dry run: compile the learner step and the engine for a target mesh, report memory.

A user sizes a pod before paying for it: every program jaxflash would run is
lowered against ``jax.ShapeDtypeStruct``s carrying the shardings it would get
(``jax.jit(...).lower(abstract args).compile()``), nothing is allocated, and
``compiled.memory_analysis()`` gives the per-device bytes XLA plans for it:
arguments (params, optimizer state, batch / KV cache), outputs, what the
outputs alias from donated arguments, and temporaries (activations, gathered
weights, logits chunks).

The numbers are those of the platform the devices belong to: on CPU (e.g. 8
fake devices, ``--xla_force_host_platform_device_count=8``) they are XLA:CPU's,
whose argument and output sizes match an accelerator's (same shapes, same
shardings) but whose temporaries do not (other fusion and scheduling). Run it
where the target devices are, or pass devices from
``jax.experimental.topologies`` (a TPU topology description, needs libtpu) to
compile for a TPU slice without holding one.

Programs: ``train_step`` (``learner.step.make_train_step``) at a batch of
[M micro-batches, b, T]; ``prefill`` (one prompt at the largest bucket) and
``generate`` (one decode step over all slots: the slot loop's ``generate_block`` of
one step) of ``generation.engine.llama_engine.LlamaEngine``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.generation.engine.host_arrays import stop_array
from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.params import as_engine_dtypes, engine_shardings
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.engine.state import state_shardings as engine_state_shardings
from jaxflash.learner.batching import INT_FIELDS, TRAIN_BATCH_FIELDS
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.device_batch import batch_sharding
from jaxflash.learner.state import abstract_train_state
from jaxflash.learner.step import make_train_step
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.transformer import abstract_params, unstack_layers
from jaxflash.sharding.rules import Rules


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramMemory:
    """XLA's per-device memory plan of one compiled program (bytes).

    Attributes:
      name: "train_step", "prefill" or "generate".
      devices: devices of the mesh it is compiled for.
      argument_bytes: inputs resident on one device (params, state, batch, cache).
      output_bytes: outputs on one device.
      alias_bytes: outputs written in place of donated inputs.
      temp_bytes: temporaries (activations, gathered weights, ...).
      code_bytes: generated code.
    """

    name: str
    devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Upper bound of live bytes: arguments + outputs not aliased + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @classmethod
    def of(cls, name: str, devices: int, compiled: Any) -> ProgramMemory:
        m = compiled.memory_analysis()
        if m is None:
            raise RuntimeError(f"{name}: this backend gives no memory analysis")
        return cls(
            name=name,
            devices=devices,
            argument_bytes=int(m.argument_size_in_bytes),
            output_bytes=int(m.output_size_in_bytes),
            alias_bytes=int(m.alias_size_in_bytes),
            temp_bytes=int(m.temp_size_in_bytes),
            code_bytes=int(m.generated_code_size_in_bytes),
        )


def _lowerable(obj: Any, public: str, private: str) -> Any:
    """The jitted function behind a learner/engine callable.

    ``LlamaEngine`` exposes ``prefill_jit`` / ``generate_block_jit``; ``TrainStep`` has no
    AOT entry point yet (``public``), so its ``jax.jit`` attribute is used (``private``).
    Failing here, by name, is what an API change should do.
    """
    fn = getattr(obj, public, None) or getattr(obj, private, None)
    if fn is None or not hasattr(fn, "lower"):
        raise AttributeError(
            f"{type(obj).__name__} has neither {public!r} nor {private!r} with .lower(): "
            "update jaxflash.sizing.dry_run to its ahead-of-time entry point"
        )
    return fn


def compile_train_step(
    model_config: ModelConfig,
    learner_config: LearnerConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    batch_size: int,
    seq_len: int,
) -> Any:
    """Compile the learner step for [batch_size, seq_len] on ``mesh``; nothing allocated.

    Args:
      batch_size: B sequences per step (split into micro-batches of
        ``learner_config.micro_batch_size``; must be a multiple of it).
      seq_len: T tokens per sequence (prompt + response, padded).

    Raises:
      ValueError: B not a positive multiple of the micro-batch size.
    """
    b = learner_config.micro_batch_size
    if batch_size < 1 or batch_size % b:
        raise ValueError(f"batch_size={batch_size} must be a positive multiple of micro={b}")
    step = make_train_step(model_config, learner_config, mesh, rules)
    state = abstract_train_state(model_config, learner_config, mesh, rules)
    sharding = batch_sharding(mesh, rules, b)
    shape = (batch_size // b, b, seq_len)
    batch = {
        k: jax.ShapeDtypeStruct(
            shape, np.int32 if k in INT_FIELDS else np.float32, sharding=sharding
        )
        for k in TRAIN_BATCH_FIELDS
    }
    return _lowerable(step, "jitted", "_jitted").lower(state, batch).compile()


def compile_engine(
    model_config: ModelConfig, engine_config: EngineConfig, mesh: Mesh, rules: Rules
) -> dict[str, Any]:
    """Compile the engine's prefill (largest bucket, ``prefill_rows`` rows) and one
    decode step (``generate``: the slot loop's ``generate_block`` of one step, all
    slots live) for ``mesh``, with the engine's unstacked param layout.

    Returns:
      {"prefill": compiled, "generate": compiled}.
    """
    engine = LlamaEngine(model_config, engine_config, mesh=mesh, rules=rules)
    # The engine decodes with its layers unstacked (one buffer per layer), as placed
    # by ``LlamaEngine.place_params``.
    # (bfloat16 compute over float32 weights: the matmul weights in bfloat16, as placed).
    shapes = as_engine_dtypes(jax.eval_shape(unstack_layers, abstract_params(model_config)),
                              model_config)  # fmt: skip
    shardings = engine_shardings(model_config, mesh, rules)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )
    rep = NamedSharding(mesh, PartitionSpec())
    rows = engine_config.prefill_rows
    bucket = engine.prefiller.prefill_bucket(engine_config.max_prefill_length)
    ids = jax.ShapeDtypeStruct((rows, bucket), np.int32, sharding=rep)
    length = jax.ShapeDtypeStruct((rows,), np.int32, sharding=rep)
    state_sh, _ = engine_state_shardings(model_config, engine_config, mesh, rules)
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(engine.init_decode_state),
        state_sh,
    )
    B = engine_config.max_concurrent_decodes
    live = jax.ShapeDtypeStruct((B,), np.bool_, sharding=rep)
    stop = jax.ShapeDtypeStruct(stop_array([]).shape, np.int32, sharding=rep)
    prefill = _lowerable(engine, "prefill_jit", "_prefill_jit")
    return {
        "prefill": prefill.lower(params, ids, length).compile(),
        "generate": engine.generate_block_jit(1).lower(params, state, live, stop).compile(),
    }


def dry_run(
    model_config: ModelConfig,
    learner_config: LearnerConfig,
    engine_config: EngineConfig,
    *,
    learner_mesh: Mesh,
    learner_rules: Rules,
    generation_mesh: Mesh,
    generation_rules: Rules,
    batch_size: int,
    seq_len: int,
) -> list[ProgramMemory]:
    """Compile every program for its mesh and return their per-device memory plans.

    Args:
      model_config, learner_config, engine_config: what the run would use.
      learner_mesh, learner_rules: the learner's mesh and logical-axis rules.
      generation_mesh, generation_rules: one generation slice's mesh and rules.
      batch_size, seq_len: the learner batch [B, T] per step.

    Returns:
      [train_step, prefill, generate] ProgramMemory.
    """
    out = [
        ProgramMemory.of(
            "train_step",
            learner_mesh.devices.size,
            compile_train_step(
                model_config, learner_config, learner_mesh, learner_rules,
                batch_size=batch_size, seq_len=seq_len,
            ),
        )
    ]  # fmt: skip
    for name, compiled in compile_engine(
        model_config, engine_config, generation_mesh, generation_rules
    ).items():
        out.append(ProgramMemory.of(name, generation_mesh.devices.size, compiled))
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:8.3f}"


def format_report(reports: list[ProgramMemory], *, title: str = "") -> str:
    """A table of per-device GiB for each program (what ``--dry_run`` prints)."""
    lines = [title] if title else []
    lines.append(
        f"{'program':12s} {'devices':>7s} {'args':>8s} {'outputs':>8s} {'aliased':>8s} "
        f"{'temp':>8s} {'peak':>8s}  GiB per device"
    )
    for r in reports:
        lines.append(
            f"{r.name:12s} {r.devices:7d} {_gib(r.argument_bytes)} {_gib(r.output_bytes)} "
            f"{_gib(r.alias_bytes)} {_gib(r.temp_bytes)} {_gib(r.peak_bytes)}"
        )
    return "\n".join(lines)
