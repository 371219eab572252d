"""Compile a run's programs for its placement; per device: memory, cost, fit, roofline.

``plan_programs`` lowers every program a run executes (``sizing.programs``) on
the learner mesh and one generation slice and compiles it for their devices:
local ones, fake CPU devices, or a TPU slice's compile-only chips
(``sizing.tpu``). Per program and device it keeps XLA's memory plan
(``memory_analysis()``: arguments, outputs, aliased outputs, temporaries), its
``cost_analysis()`` (FLOPs and HBM bytes accessed, per device for SPMD
programs), and what else stays resident on those chips while it runs
(``held_bytes``): the learner's TrainState while the engine prefills on a
colocated placement, the KV cache during a prefill, the old weights during an
install. A program the TPU compiler refuses for memory (RESOURCE_EXHAUSTED) is
kept with the compiler's numbers and marked ``refused``.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxflash.generation.engine.state import EngineConfig
from jaxflash.learner.config import LearnerConfig
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.sharding.rules import Rules
from jaxflash.sizing import programs as sp
from jaxflash.sizing.hbm_traffic import hbm_traffic
from jaxflash.sizing.kv_pool import KvPool, decode_traffic
from jaxflash.sizing.paper import train_step_flops

DECODE_FILL = 0.5
"""Pool fill at which the plan prices KV reads it computes on paper (the kernel path)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramCost:
    """One compiled program, per device (bytes, FLOPs).

    Attributes:
      name: e.g. "train_step", "prefill_512", "decode_block_8", "publish".
      role: "learner", "generation" or "target" (an elastic move's new learner chips).
      devices: devices of its mesh.
      argument_bytes, output_bytes, alias_bytes, temp_bytes: XLA's memory plan.
      flops, bytes_accessed: ``cost_analysis()`` per device, times ``count``.
      held_bytes: other long-lived buffers on the same devices while it runs.
      refused: the compiler's message when it refused the program for memory
        ("" when it compiled); peak is then the compiler's total requirement.
      capacity_bytes: HBM the compiler said is available ("refused" only), else 0.
      unseen_bytes: HBM bytes XLA's cost analysis cannot see (reads inside a Mosaic
        kernel), computed on paper; added to ``bytes_accessed`` in the roofline.
      unseen_flops: FLOPs it cannot see (loop bodies counted once, Mosaic kernels),
        computed on paper (``sizing.paper``); added to ``flops`` in the roofline.
      hbm_bytes: HBM bytes read from the compiled TPU program instruction by
        instruction (``sizing.hbm_traffic``: VMEM staging not counted, loop bodies x
        their trips); 0 where not computed (other programs, CPU, or a walk that does
        not reproduce XLA's own count). Replaces ``bytes_accessed`` in the roofline.
    """

    name: str
    role: str
    devices: int
    argument_bytes: int
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    held_bytes: int = 0
    refused: str = ""
    capacity_bytes: int = 0
    unseen_bytes: float = 0.0
    unseen_flops: float = 0.0
    hbm_bytes: float = 0.0

    @property
    def traffic_bytes(self) -> float:
        """The bytes the roofline uses: the HBM walk's where computed, else XLA's count,
        plus what neither sees (computed on paper)."""
        return (self.hbm_bytes if self.hbm_bytes > 0 else self.bytes_accessed) + self.unseen_bytes

    @property
    def peak_bytes(self) -> int:
        """Upper bound of the program's live bytes: args + unaliased outputs + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def resident_bytes(self) -> int:
        """What the device must hold while it runs: the program's peak + held buffers."""
        return self.peak_bytes + self.held_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What ``plan_programs`` compiled, per device.

    Attributes:
      costs: one ProgramCost per program, in the order the table prints them.
      kv: the engine's KV cache as the compiled DecodeState allocates it.
      engine_weight_bytes: the engine's weights one generation chip holds.
      learner_state_bytes: the learner's TrainState one learner chip holds.
      decode_steps: decode steps in the ``decode_block_<n>`` program.
    """

    costs: list[ProgramCost]
    kv: KvPool
    engine_weight_bytes: int
    learner_state_bytes: int
    decode_steps: int

    def by_name(self) -> dict[str, ProgramCost]:
        return {c.name: c for c in self.costs}

    def to_dict(self) -> dict:
        """JSON form: the compiled costs, reusable without compiling (``from_dict``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(
            costs=[ProgramCost(**c) for c in d["costs"]], kv=KvPool(**d["kv"]),
            engine_weight_bytes=int(d["engine_weight_bytes"]),
            learner_state_bytes=int(d["learner_state_bytes"]),
            decode_steps=int(d["decode_steps"]),
        )  # fmt: skip


_UNITS = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_NUM = r"([\d.]+)\s*([KMGT]?)i?B?"


def _bytes(value: str, unit: str) -> int:
    return int(float(value) * _UNITS[unit or "B"])


def parse_oom(message: str) -> tuple[int, int] | None:
    """(bytes required, bytes available) from the TPU compiler's RESOURCE_EXHAUSTED
    message, e.g. "... HLO temporaries (21.25G) exceeds available HBM (15.75G)" or
    "Used 21.25G of 15.75G hbm"; None when it is not such a message."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    m = re.search(rf"\({_NUM}\) exceeds available HBM \({_NUM}\)", message)
    if m is None:
        m = re.search(rf"Used {_NUM} of {_NUM} hbm", message)
    if m is None:
        return None
    return _bytes(m.group(1), m.group(2)), _bytes(m.group(3), m.group(4))


_CACHE_READ_WARNING = "Error reading persistent compilation cache entry"


def measure(prog: sp.Lowerable, *, held_bytes: int = 0) -> ProgramCost:
    """Compile ``prog`` and read its memory plan and cost (see ProgramCost).

    Raises:
      RuntimeError: the backend gives no memory analysis.
      jax.errors.JaxRuntimeError: a compile error other than running out of HBM.
    """
    base = dict(name=prog.name, role=prog.role, devices=prog.mesh.devices.size)
    try:
        with warnings.catch_warnings():
            # With a persistent compilation cache set (common on TPU VMs), jax stores a
            # compile-only chip's executable but cannot load it back ("PjRtCompiler must
            # be constructed with a Client"): it warns and compiles again, as without a
            # cache. Nothing is lost; the warning is noise in the plan.
            warnings.filterwarnings("ignore", _CACHE_READ_WARNING, UserWarning)
            compiled = prog.lower().compile()
    except jax.errors.JaxRuntimeError as err:
        oom = parse_oom(str(err))
        if oom is None:
            raise
        line = str(err).strip().splitlines()[0]
        # The compiler's "total memory required" counts arguments and outputs too.
        return ProgramCost(
            **base, argument_bytes=prog.arg_bytes, temp_bytes=max(0, oom[0] - prog.arg_bytes),
            held_bytes=held_bytes,
            refused=line, capacity_bytes=oom[1],
        )  # fmt: skip
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError(f"{prog.name}: this backend gives no memory analysis")
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list | tuple):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    xla_bytes = max(0.0, float(cost.get("bytes accessed", 0.0)))
    hbm = 0.0
    if prog.loop_trips and prog.mesh.devices.flat[0].platform == "tpu":
        walk = hbm_traffic(compiled.as_text(), trips=prog.loop_trips, xla_bytes=xla_bytes)
        hbm = walk.hbm if walk.agrees else 0.0  # else XLA's count, as before
    return ProgramCost(
        **base,
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        temp_bytes=int(m.temp_size_in_bytes),
        # max(0, .): XLA reports -1 for a program it has no count for.
        flops=max(0.0, float(cost.get("flops", 0.0))) * prog.count,
        bytes_accessed=xla_bytes * prog.count,
        held_bytes=held_bytes,
        hbm_bytes=hbm * (1 if prog.loop_trips else prog.count),
    )


def _merge(name: str, costs: Sequence[ProgramCost]) -> ProgramCost:
    """An elastic move's leaf programs as one row: summed cost, the largest peak."""
    top = max(costs, key=lambda c: c.resident_bytes)
    return dataclasses.replace(
        top,
        name=name,
        flops=sum(c.flops for c in costs),
        bytes_accessed=sum(c.bytes_accessed for c in costs),
        refused=next((c.refused for c in costs if c.refused), ""),
    )


def plan_programs(
    model: ModelConfig,
    learner: LearnerConfig,
    engine: EngineConfig,
    *,
    learner_mesh: Mesh,
    learner_rules: Rules,
    generation_mesh: Mesh,
    generation_rules: Rules,
    batch_size: int,
    seq_len: int,
    colocated: bool = False,
    elastic_meshes: Sequence[Mesh] = (),
    prefill_buckets: Sequence[int] | None = None,
) -> Plan:
    """Compile every program of a run for its meshes and return their costs.

    Args:
      model, learner, engine: the run's configurations.
      learner_mesh, learner_rules: the learner's mesh and logical-axis rules.
      generation_mesh, generation_rules: one generation slice's mesh and rules.
      batch_size, seq_len: the learner batch [B, T] per step.
      colocated: the generation slice shares the learner's devices (then each
        role's long-lived buffers are held while the other's programs run).
      elastic_meshes: learner meshes an elastic move may go to (each gives one
        ``elastic_<a>to<b>`` row).
      prefill_buckets: prefill only these buckets (default: every bucket).

    Returns:
      The ``Plan``: a ProgramCost per program (train_step, prefill_<bucket>...,
      decode_block_<n>, publish, install, elastic_<a>to<b>...), the engine's KV
      cache as allocated and its weights per chip.
    """
    train, state = sp.train_step_program(
        model, learner, learner_mesh, learner_rules, batch_size=batch_size, seq_len=seq_len
    )
    gen, eng_params, dstate = sp.engine_programs(
        model, engine, generation_mesh, generation_rules, buckets=prefill_buckets, lora=learner.lora
    )
    pub, install = sp.publish_programs(
        model, state.params, generation_mesh, generation_rules, lora=learner.lora
    )
    state_b, params_b = sp.per_device_bytes(state), sp.per_device_bytes(state.params)
    eng_b, cache_b = sp.per_device_bytes(eng_params), sp.per_device_bytes(dstate)
    other_l = eng_b + cache_b if colocated else 0  # engine buffers on the learner's chips
    other_g = state_b if colocated else 0  # learner buffers on the engine's chips
    train_cost = measure(train, held_bytes=other_l)
    # XLA counts one micro-batch of one layer (scan bodies once) and no splash kernel.
    paper = train_step_flops(model, batch=batch_size, seq_len=seq_len, kl=learner.uses_reference)
    unseen = max(0.0, paper / learner_mesh.devices.size - train_cost.flops)
    out = [dataclasses.replace(train_cost, unseen_flops=0.0 if train_cost.refused else unseen)]
    kv = KvPool.from_state(dstate)
    for prog in gen:
        held = other_g + (cache_b if prog.name.startswith("prefill") else 0)
        cost = measure(prog, held_bytes=held)
        if prog.name.startswith("decode_block") and kv.attention == "tpu_kernel":
            # XLA does not count the Mosaic kernel's KV reads: add them on paper.
            t = decode_traffic(kv, xla_bytes=cost.bytes_accessed, steps=engine.decode_block,
                               weight_bytes=eng_b, fill=DECODE_FILL,
                               hbm_bytes=cost.hbm_bytes)  # fmt: skip
            cost = dataclasses.replace(cost, unseen_bytes=t.kernel_unseen * engine.decode_block)
        out.append(cost)
    out.append(measure(pub, held_bytes=state_b - params_b + other_l))
    out.append(measure(install, held_bytes=eng_b + cache_b + other_g))
    for target in elastic_meshes:
        progs = sp.elastic_programs(model, learner, state, target, learner_rules)
        name = f"elastic_{learner_mesh.devices.size}to{target.devices.size}"
        if not progs:
            out.append(ProgramCost(name=name, role="learner", devices=learner_mesh.devices.size,
                                   argument_bytes=0, held_bytes=state_b))  # fmt: skip
            continue
        costs = [
            measure(p, held_bytes=(state_b - p.arg_bytes) if p.role == "learner" else 0)
            for p in progs
        ]
        out.append(_merge(name, costs))
    return Plan(
        costs=out, kv=kv, engine_weight_bytes=eng_b,
        learner_state_bytes=state_b, decode_steps=engine.decode_block,
    )  # fmt: skip


def local_capacity(devices: Sequence[Any]) -> int | None:
    """HBM limit of a local accelerator device (``memory_stats()["bytes_limit"]``),
    None where the device has none (CPU, compile-only TPU chips)."""
    try:
        stats = devices[0].memory_stats()
    except Exception:  # noqa: BLE001 (compile-only and CPU devices raise or return None)
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
