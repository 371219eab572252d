"""``launch/tpu_pod.py --dry_run [--topology v5e-16]``: size a run before paying for chips.

Compiles every program the experiment would execute (``jaxflash.sizing.programs``:
the train step, prefill at every bucket, the decode block, the weight publish and
install, elastic reshards) ahead of time, against abstract arrays
(``jax.jit(...).lower(...).compile()``: nothing is allocated, no weights are read),
on the placement the config gives (``runtime.placement.carve``: learner devices
first, then the generation slices), and prints per program and device its memory,
the headroom to the chip's HBM, FLOPs, bytes and roofline time
(``jaxflash.sizing.report``).

Devices: with ``topology`` (e.g. ``v5e-16``, needs the ``jaxflash[tpu]`` extra) the
compile-only chips of that TPU slice; otherwise this host's devices: fake CPU
devices on a laptop (temporaries are then XLA:CPU's), the real chips on a TPU VM.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.config.presets import get_preset
from jaxflash.runtime.config.elastic_spec import floors, learner_axes
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.specs import ConfigError
from jaxflash.runtime.fleet.placement import carve
from jaxflash.runtime.model_setup import engine_config

ASSUMED_PROMPT_TOKENS = 256
"""Prompt length assumed when the config derives it from the data at run time."""

# device_kind of a local TPU -> chip table key (jaxflash.sizing.chips).
_LOCAL_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e"}


def devices_needed(exp: ExperimentConfig) -> int:
    """Devices the placement needs (``runtime.placement.carve``)."""
    m = exp.mesh
    n_learner = math.prod(int(v) for v in m.learner.values())
    n_gen = math.prod(int(v) for v in m.generation.values())
    if m.colocated:
        return max(n_learner, n_gen)
    return n_learner + max(1, m.num_generation_slices) * n_gen


def _model(exp: ExperimentConfig, max_seq_len: int) -> tuple[ModelConfig, str]:
    spec = exp.model
    if spec.source == "hf":
        raise ConfigError(
            "--dry_run with model.source=hf: the shapes come from a preset; pass "
            "--config.model.source=random --config.model.preset=<the checkpoint's family>"
        )
    # A GGUF source is the SmolLM2-135M file: the smollm2_135m preset has its shapes.
    config = get_preset(spec.preset)
    config = config.replace(
        compute_dtype=spec.compute_dtype,
        remat=spec.remat,
        remat_policy=spec.remat_policy,
        logits_chunk=spec.logits_chunk,
        attention=spec.attention,
        exact_numerics=spec.exact_numerics,
        max_seq_len=max(config.max_seq_len, max_seq_len),
    )
    return config, f"{spec.preset} ({spec.source})"


def _elastic_meshes(exp: ExperimentConfig, devices: list[Any], n_learner: int) -> list[Any]:
    """Learner meshes an elastic move reaches from mesh.learner: each size of a fixed
    device_schedule, or (adaptive) one generation slice more and one fewer."""
    from jaxflash.sharding.mesh import make_mesh  # noqa: PLC0415

    c, m = exp.controller, exp.mesh
    if not c.elastic:
        return []
    floor, slice_size = floors(m)
    total = n_learner + m.num_generation_slices * slice_size
    if c.kind == "fixed":
        sizes = sorted({n for _, n in c.device_steps()} - {n_learner})
    else:
        sizes = [n for n in (n_learner - slice_size, n_learner + slice_size)
                 if floor <= n <= total - slice_size]  # fmt: skip
    # The learner keeps its devices in order and grows into the next slices
    # (sync.reshard_plan), so a learner of n devices is devices [0, n).
    return [make_mesh(devices[:n], learner_axes(m.learner, n)) for n in sizes]


def _devices(topology: str | None) -> tuple[list[Any], Any, int, str]:
    """(devices, ChipSpec or None, devices per chip, what they are) for the plan."""
    from jaxflash.sizing.chips import CHIPS, parse_topology  # noqa: PLC0415

    if topology:
        from jaxflash.sizing.tpu import MissingTpuExtraError, topology_devices  # noqa: PLC0415

        try:
            topo = parse_topology(topology)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            devices = topology_devices(topo)
        except (MissingTpuExtraError, ValueError) as err:
            raise ConfigError(str(err)) from None
        share = max(1, len(devices) // topo.chips)
        what = f"TPU {topo.gcp_name} ({topo.libtpu_name}, {topo.chips} chips, compile only)"
        return devices, topo.chip, share, what
    devices = jax.devices()
    kind = _LOCAL_KINDS.get(devices[0].device_kind) if devices[0].platform == "tpu" else None
    chip = CHIPS.get(kind) if kind else None
    return devices, chip, 1, f"{len(devices)} local {devices[0].platform} devices"


def dry_run_report(exp: ExperimentConfig, topology: str | None = None) -> str:
    """The table of ``exp``'s programs compiled for their devices (see module doc).

    Args:
      exp: the experiment.
      topology: a TPU slice name (``v5e-16``, ``v5p-64``, ``v5e:4x4``); None: this
        host's devices.

    Raises:
      ConfigError: model.source=hf (no shapes without reading the checkpoint), an
        unknown topology (listing the valid ones), libtpu missing (one line naming
        the package), or a placement needing more devices than there are.
    """
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES  # noqa: PLC0415
    from jaxflash.sizing.plan import local_capacity, plan_programs  # noqa: PLC0415
    from jaxflash.sizing.report import Settings, format_plan  # noqa: PLC0415

    r = exp.rollout
    prompt = r.max_prefill_length or exp.data.max_prompt_tokens
    note = ""
    if not prompt:
        prompt = ASSUMED_PROMPT_TOKENS
        note = (
            f"\n(the run derives the prompt length from the data; this plan assumes "
            f"{prompt} tokens: set --config.data.max_prompt_tokens to size another)"
        )
    exp = exp.with_prompt_lengths(prompt)
    seq_len = exp.rollout.max_prefill_length + r.sampling.max_new_tokens
    model, what = _model(exp, seq_len)
    devices, chip, share, where = _devices(topology)
    spec = exp.mesh
    if spec.generation_processes:  # generation programs: slices after the learner here
        import dataclasses  # noqa: PLC0415

        spec = dataclasses.replace(
            spec, generation_processes=False, generation_addresses=(), generation_hosts=1
        )
    try:
        placement = carve(spec, devices)
    except ValueError as err:
        raise ConfigError(f"--dry_run on {where}: {err}") from None
    lmesh, gmesh = placement.learner, placement.generation[0]
    used = devices_needed(exp)
    if used < len(devices):
        note += (
            f"\n({used} of {len(devices)} devices placed: set mesh.learner, mesh.generation "
            f"and mesh.num_generation_slices (with mesh.colocated=False) to use the rest)"
        )
    batch = r.prompts_per_step * r.group_size
    econf = engine_config(rollout=exp.rollout, env=exp.env)
    plan = plan_programs(
        model, exp.learner, econf,
        learner_mesh=lmesh, learner_rules=LEARNER_RULES,
        generation_mesh=gmesh, generation_rules=GENERATOR_RULES,
        batch_size=batch, seq_len=seq_len, colocated=placement.colocated,
        elastic_meshes=_elastic_meshes(exp, devices, lmesh.devices.size),
    )  # fmt: skip
    settings = Settings(
        micro_batch_size=exp.learner.micro_batch_size, remat=model.remat, batch_size=batch,
        seq_len=seq_len, num_slots=r.num_slots, cache_len=econf.max_target_length,
        max_prefill_length=econf.max_prefill_length, prefill_rows=econf.prefill_rows,
        learner_mesh=dict(lmesh.shape), generation_mesh=dict(gmesh.shape),
        n_kv_heads=model.n_kv_heads, colocated=placement.colocated,
        kv_cache=econf.kv_cache, page_size=econf.page_size, num_pages=econf.pool_pages,
    )  # fmt: skip
    kl = ", KL reference inside train_step" if exp.learner.uses_reference else ""
    kv = plan.kv
    cache = (
        f"cache {seq_len}"
        if kv.kind == "dense"
        else f"paged KV pool {kv.pool_tokens:,} tokens ({kv.pages:,} pages x {kv.page_size}) "
        f"for {kv.slots} slots of up to {kv.positions} positions, attention {kv.attention}"
    )
    remat = f"{model.remat} ({model.remat_policy})" if model.remat else "False"
    title = (
        f"{what}, {model.param_dtype} params, {model.compute_dtype} compute, remat "
        f"{remat}, on {where}: {placement.describe()}\n"
        f"learner {dict(lmesh.shape)} batch [{batch}, {seq_len}] micro "
        f"{exp.learner.micro_batch_size}{kl}; one generation slice {dict(gmesh.shape)} "
        f"{r.num_slots} slots, prefill {exp.rollout.max_prefill_length}, {cache}, "
        f"decode block {econf.decode_block}"
    )
    capacity = None if chip is not None and topology else local_capacity(devices)
    table = format_plan(
        plan.costs, title=title, chip=chip, share=share, capacity=capacity, settings=settings
    )
    table += "\n" + _kv_lines(plan)
    if chip is not None:
        table += "\n" + _forecast(exp, plan, chip, share, len(devices), topology, capacity)
    lora = exp.learner.lora
    if lora is not None:  # what LoRA saves: full fine-tuning's step, compiled alike
        import dataclasses  # noqa: PLC0415

        from jaxflash.sizing.plan import measure  # noqa: PLC0415
        from jaxflash.sizing.programs import train_step_program  # noqa: PLC0415
        from jaxflash.sizing.report import format_lora_saving  # noqa: PLC0415

        full, _ = train_step_program(
            model, dataclasses.replace(exp.learner, lora=None), lmesh, LEARNER_RULES,
            batch_size=batch, seq_len=seq_len,
        )  # fmt: skip
        what = f"rank {lora.rank} over a {lora.base_dtype} base"
        table += "\n" + format_lora_saving(plan.costs[0], measure(full), what)
    return table + note


def _kv_lines(plan: Any) -> str:
    """The engine's KV cache as allocated, and the decode step's bytes: XLA vs paper."""
    from jaxflash.sizing.kv_pool import decode_traffic, format_traffic  # noqa: PLC0415

    block = next(c for c in plan.costs if c.name.startswith("decode_block"))
    lines = [f"KV per generation chip: {plan.kv.describe()}"]
    if not block.refused:
        t = decode_traffic(
            plan.kv, xla_bytes=block.bytes_accessed, steps=plan.decode_steps,
            weight_bytes=plan.engine_weight_bytes, hbm_bytes=block.hbm_bytes,
        )  # fmt: skip
        lines.append(format_traffic(block.name, t, plan.kv))
    return "\n".join(lines)


def _forecast(
    exp: ExperimentConfig, plan: Any, chip: Any, share: int, n_devices: int,
    topology: str | None, capacity: int | None,
) -> str:  # fmt: skip
    """The simulator's forecast of trained samples/s over the slice's splits
    (``simulate.forecast``); a line saying why where it cannot be made."""
    from jaxflash.runtime.simulate.forecast import forecast_report  # noqa: PLC0415
    from jaxflash.runtime.simulate.plan_costs import RunShape  # noqa: PLC0415

    r, m = exp.rollout, exp.mesh
    learner = math.prod(int(v) for v in m.learner.values())
    alpha = r.async_ratio or 2
    shape = RunShape(
        slice_chips=n_devices, learner_chips=learner,
        gen_chips=math.prod(int(v) for v in m.generation.values()), slots=r.num_slots,
        prompts_per_step=r.prompts_per_step, group_size=r.group_size,
        prompt_tokens=r.max_prefill_length, max_new_tokens=r.sampling.max_new_tokens,
        async_ratio=alpha, packing=exp.learner.packing,
        micro_batch_size=exp.learner.micro_batch_size,
        seq_len=r.max_prefill_length + r.sampling.max_new_tokens,
        hbm_bytes=capacity or chip.usable_hbm_bytes // share,
    )  # fmt: skip
    try:
        text = forecast_report(plan, chip, shape, topology=topology or "", share=share)
    except ValueError as err:
        return f"forecast: not made ({err})"
    if not r.async_ratio:
        text += f"\n  (the config runs rollout.async_ratio=0; async is shown at a={alpha})"
    return text
