"""The dry run's table: per program and device, memory, headroom, cost and roofline;
for a program that does not fit, the number that breaks it and the setting to change."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxflash.sizing.chips import ChipSpec, roofline_seconds
from jaxflash.sizing.plan import ProgramCost

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """The run's settings a user would change when a program does not fit (for advice).

    Attributes mirror the config keys the advice names.
    """

    micro_batch_size: int
    remat: bool
    batch_size: int
    seq_len: int
    num_slots: int
    cache_len: int
    max_prefill_length: int
    prefill_rows: int
    learner_mesh: dict
    generation_mesh: dict
    n_kv_heads: int
    colocated: bool
    kv_cache: str = "dense"
    page_size: int = 0
    num_pages: int = 0


def advice(cost: ProgramCost, s: Settings) -> str:
    """Which setting to change for ``cost`` (a program over its chips' HBM)."""
    held = (
        f"; {cost.held_bytes / GIB:.2f} GiB held by the other role on shared chips: "
        "mesh.colocated=False"
        if s.colocated and cost.held_bytes > 0.25 * cost.resident_bytes
        else ""
    )
    lm, gm = s.learner_mesh, s.generation_mesh
    if cost.name == "train_step":
        if cost.temp_bytes >= cost.argument_bytes:
            fix = (
                f"temporaries {cost.temp_bytes / GIB:.2f} GiB (activations of "
                f"{s.micro_batch_size} x {s.seq_len} tokens, dense [T, T] attention): lower "
                f"learner.micro_batch_size (now {s.micro_batch_size})"
            )
            fix += ", keep model.remat=True" if s.remat else ", set model.remat=True"
            fix += " or shorten rollout.max_new_tokens"
        else:
            fix = (
                f"arguments {cost.argument_bytes / GIB:.2f} GiB (params + optimizer state): "
                f"more learner chips (mesh.learner {lm})"
            )
        return fix + held
    if cost.name.startswith("prefill"):
        return (
            f"temporaries {cost.temp_bytes / GIB:.2f} GiB: lower rollout.max_prefill_length "
            f"(now {s.max_prefill_length}) or the prefill rows (now {s.prefill_rows}); "
            f"{cost.held_bytes / GIB:.2f} GiB is the KV cache held meanwhile" + held
        )
    if cost.name.startswith("decode_block"):
        tensor = int(gm.get("tensor", 1))
        split = (
            f"mesh.generation.tensor={tensor} splits the cache by KV heads only up to "
            f"n_kv_heads={s.n_kv_heads}"
        )
        if s.kv_cache == "paged":
            return (
                f"paged KV pool of rollout.num_pages={s.num_pages} x rollout.page_size="
                f"{s.page_size} tokens: lower rollout.num_pages (a request needing more "
                f"pages than the pool is refused) or rollout.num_slots (now {s.num_slots}; "
                f"the reference path gathers every slot's {s.cache_len} positions) ({split})" + held
            )
        return (
            f"dense KV cache of rollout.num_slots={s.num_slots} x {s.cache_len} positions: "
            f"lower rollout.num_slots or rollout.max_new_tokens, or rollout.kv_cache=paged "
            f"({split})" + held
        )
    if cost.name in ("publish", "install"):
        return (
            "a second copy of the weights on the same chips: more chips for that role "
            f"(mesh.learner {lm} / mesh.generation {gm})" + held
        )
    if cost.name.startswith("elastic"):
        return "a whole leaf per chip while gathering: move smaller slices (mesh.generation)"
    return "more chips"


def _g(n: float) -> str:
    return f"{n / GIB:7.3f}"


def format_plan(
    costs: Sequence[ProgramCost],
    *,
    title: str = "",
    chip: ChipSpec | None = None,
    share: int = 1,
    capacity: int | None = None,
    settings: Settings | None = None,
) -> str:
    """The table ``--dry_run`` prints (GiB per device; ms of roofline time).

    Args:
      costs: from ``plan.plan_programs``.
      title: first line.
      chip: the TPU chip's figures (roofline and HBM); None on CPU (no roofline).
      share: devices per chip (2 where libtpu gives each v4 TensorCore a device).
      capacity: HBM per device (bytes); default the chip's usable HBM / share.
      settings: the run's settings, for the advice under a program that does not fit.
    """
    if capacity is None and chip is not None:
        capacity = chip.usable_hbm_bytes // share
    lines = [title] if title else []
    lines.append(
        f"{'program':18s} {'dev':>4s} {'args':>7s} {'temp':>7s} {'peak':>7s} {'held':>7s} "
        f"{'HBM':>7s} {'free':>7s} {'GFLOP':>9s} {'GB':>7s} {'HBM GB':>7s} {'roofline':>9s}"
    )
    broken = []
    for c in costs:
        cap = c.capacity_bytes or capacity
        free = "      -" if cap is None else _g(cap - c.resident_bytes)
        hbm = "      -" if cap is None else _g(cap)
        if chip is None or c.refused:
            roof = "        -"
        else:
            flops = c.flops + c.unseen_flops
            ms = roofline_seconds(flops, c.traffic_bytes, chip, share=share) * 1e3
            roof = f"{ms:7.2f}ms" + ("*" if c.unseen_bytes or c.unseen_flops else "")
        flops = "        -" if c.refused else f"{c.flops / 1e9:9.1f}"
        gbytes = "      -" if c.refused else f"{c.bytes_accessed / 1e9:7.2f}"
        hbm_gb = f"{c.hbm_bytes / 1e9:7.2f}" if c.hbm_bytes > 0 else "      -"
        mark = " REFUSED" if c.refused else ""
        lines.append(
            f"{c.name:18s} {c.devices:4d} {_g(c.argument_bytes)} {_g(c.temp_bytes)} "
            f"{_g(c.peak_bytes)} {_g(c.held_bytes)} {hbm} {free} {flops} {gbytes} {hbm_gb} "
            f"{roof}{mark}"
        )
        if cap is not None and (c.refused or c.resident_bytes > cap):
            broken.append((c, cap))
    lines.append(
        "GiB per device: args, temp(oraries), peak = args + outputs - aliased + temp; held = "
        "other buffers resident meanwhile; free = HBM - peak - held"
    )
    lines.append(
        "GB: XLA's cost analysis (every memory space: on TPU it counts each weight again "
        "for its staging through VMEM); HBM GB: the compiled program's HBM reads and "
        "writes, instruction by instruction (sizing.hbm_traffic), used in the roofline "
        "where given (- : XLA's GB is used: only TPU decode blocks are walked, and a walk "
        "that does not reproduce XLA's count under XLA's rules is not trusted)"
    )
    if chip is not None:
        lines.append(
            f"roofline = max(FLOPs / {chip.peak_flops / 1e12:.0f} TFLOP/s, bytes / "
            f"{chip.hbm_bandwidth / 1e9:.0f} GB/s) per {chip.kind} chip ({chip.source})"
            + (f", 1/{share} each per device" if share > 1 else "")
        )
    if any(c.unseen_bytes or c.unseen_flops for c in costs):
        lines.append(
            "* with what XLA's cost analysis does not see, computed on paper (GFLOP and GB "
            "are XLA's): it counts a loop body once (the train step's micro-batch and layer "
            "scans, the decode block's steps) and nothing inside a Mosaic kernel (splash "
            "attention; the paged kernel's KV reads)"
        )
    for c, cap in broken:
        over = c.resident_bytes - cap
        why = f"compiler: {c.refused}" if c.refused else f"needs {c.resident_bytes / GIB:.2f} GiB"
        line = (
            f"DOES NOT FIT: {c.name} needs {c.resident_bytes / GIB:.2f} GiB per device "
            f"of {cap / GIB:.2f} GiB (over by {over / GIB:.2f} GiB; {why})"
        )
        if settings is not None:
            line += f"\n  change: {advice(c, settings)}"
        lines.append(line)
    return "\n".join(lines)


def format_lora_saving(lora: ProgramCost, full: ProgramCost, what: str) -> str:
    """The learner's memory under LoRA against full fine-tuning of the same model, batch
    and mesh: both ``train_step`` programs compiled (GiB per device).

    Args:
      lora, full: the two ``train_step`` costs (``plan.measure``).
      what: the LoRA settings, e.g. "rank 16 over an int8 base".
    """

    def one(c: ProgramCost) -> str:
        refused = " (REFUSED by the compiler)" if c.refused else ""
        return (
            f"peak {c.peak_bytes / GIB:.3f} GiB (args {c.argument_bytes / GIB:.3f}, "
            f"temp {c.temp_bytes / GIB:.3f}){refused}"
        )

    saved = full.peak_bytes - lora.peak_bytes
    share = 100.0 * saved / full.peak_bytes if full.peak_bytes else 0.0
    return (
        f"learner train_step per device, LoRA {what}: {one(lora)}; full fine-tuning: "
        f"{one(full)}; LoRA saves {saved / GIB:.3f} GiB ({share:.0f} %)"
    )
