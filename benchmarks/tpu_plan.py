"""Per-chip peak of every program, per preset and TPU slice, compiled without a TPU,
and the simulator's forecast on their roofline costs.

    pip install -e '.[tpu]'
    python benchmarks/tpu_plan.py --out benchmarks/results/tpu_plan.json   # docs/TPU.md table
    python benchmarks/tpu_plan.py --only qwen2p5_1p5b
    python benchmarks/tpu_plan.py --table benchmarks/results/tpu_plan.json

Each case is a disjoint placement on one slice, at the settings of the configs a
user starts from (``configs/tpu_qwen2p5_1p5b_v5e.py``, ``configs/tpu_llama3p1_8b_v5p.py``):
fp32 master weights, bf16 compute, splash attention (``model.attention=auto`` on
TPU), ``model.remat_policy="full"``, ``learner.packing``, a paged KV cache of
``page_size`` 32; GRPO
batches of prompts x 8 samples, prompts of 1,024 tokens and the rest of T response;
the learner on the first chips (fsdp, one sequence per chip per micro-batch),
generation engines of ``data`` x ``tensor`` chips after it (as many as fill the slice:
KV heads over tensor, pages and slots over data), attending with the paged TPU kernel
where it tiles one chip's heads. Programs: train step, prefill at buckets 16 and 1,024
(the others lie between), decode block of 8 steps, publish and install. Memory
figures are XLA's for libtpu 0.0.42.1's compiler; "refused" means that compiler
refused the program for HBM; the decode bytes are the compiled block's HBM walk
(``sizing.hbm_traffic``) and XLA's own count.
The forecast (``jaxflash.runtime.simulate.forecast``) is model figures: roofline costs
through the simulator, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported: libtpu only compiles

from jaxflash.sizing.chips import parse_topology  # noqa: E402

PROMPT = 1024
PAGE = 32


@dataclasses.dataclass(frozen=True)
class Case:
    """One preset on one slice (chips, tokens)."""

    preset: str
    topology: str
    learner: int  # fsdp chips
    tensor: int  # an engine's tensor axis (KV heads split over it)
    slots: int  # per engine
    pool_tokens: int  # per engine
    batch: int  # sequences per learner step
    length: int  # T = prompt + response budget
    data: int = 1  # an engine's data axis (slot groups: pages and slots split over it)

    @property
    def engine_chips(self) -> int:
        return self.data * self.tensor

    @property
    def engine_mesh(self) -> dict:
        return (
            {"data": self.data, "tensor": self.tensor} if self.data > 1 else {"tensor": self.tensor}
        )


CASES = [
    # 2 KV heads over tensor=2, the pool's pages and the slots over data=4: one engine.
    Case("qwen2p5_1p5b", "v5e-16", 8, 2, 128, 524288, 64, 8192, data=4),
    Case("qwen2p5_7b", "v5p-128", 32, 4, 256, 2097152, 256, 32768),
    Case("llama3p1_8b", "v5p-128", 32, 8, 256, 2097152, 256, 32768),
    Case("qwen3_8b", "v5p-128", 32, 8, 256, 2097152, 256, 32768),
]


def run_case(case: Case, *, forecast: bool = True) -> dict:
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.learner.config import LearnerConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES
    from jaxflash.sizing.plan import plan_programs
    from jaxflash.sizing.tpu import topology_devices

    topo = parse_topology(case.topology)
    devices = topology_devices(topo)
    model = get_preset(case.preset, compute_dtype="bfloat16", remat=True,
                       remat_policy="full", max_seq_len=case.length, logits_chunk=256)  # fmt: skip
    engine = EngineConfig(
        max_concurrent_decodes=case.slots, max_prefill_length=PROMPT,
        max_target_length=case.length, decode_block=8, kv_cache="paged", page_size=PAGE,
        num_pages=case.pool_tokens // PAGE,
    )  # fmt: skip
    n = case.learner
    lmesh = make_mesh(devices[:n], {"fsdp": n})
    gmesh = make_mesh(devices[n : n + case.engine_chips], case.engine_mesh)
    learner = LearnerConfig(lr=1e-6, micro_batch_size=n, packing=True)
    t0 = time.perf_counter()
    plan = plan_programs(
        model, learner, engine,
        learner_mesh=lmesh, learner_rules=LEARNER_RULES,
        generation_mesh=gmesh, generation_rules=GENERATOR_RULES,
        batch_size=case.batch, seq_len=case.length, prefill_buckets=[16, PROMPT],
    )  # fmt: skip
    compile_s = time.perf_counter() - t0
    cap = topo.chip.usable_hbm_bytes // max(1, len(devices) // topo.chips)
    out = {
        **dataclasses.asdict(case),
        "capacity_gib": cap / 2**30,
        "engines": (topo.chips - n) // case.engine_chips,
        "compile_s": round(compile_s, 1),
        "kv": plan.kv.describe(),
        "decode_bytes": decode_bytes(plan),
        "programs": [
            {
                "name": c.name,
                "peak_gib": round(c.resident_bytes / 2**30, 2),
                "args_gib": round(c.argument_bytes / 2**30, 2),
                "temp_gib": round(c.temp_bytes / 2**30, 2),
                "held_gib": round(c.held_bytes / 2**30, 2),
                "refused": c.refused,
                "gflop": round(c.flops / 1e9, 1),
                "gbytes": round(c.bytes_accessed / 1e9, 2),
                "hbm_gbytes": round(c.hbm_bytes / 1e9, 2),
                "fits_10pct": (not c.refused) and c.resident_bytes <= 0.9 * cap,
            }
            for c in plan.costs
        ],
    }
    out["plan"] = plan.to_dict()  # the compiled costs: --reforecast reuses them
    if forecast:
        out["forecast"] = forecast_summary(case, plan)
    return out


def decode_bytes(plan) -> dict:
    """A decode step's bytes per chip at a half-full pool (GB): XLA's count, the HBM walk,
    the kernel's KV reads (on paper), and weights + in-use KV (paper); the two ratios."""
    from jaxflash.sizing.kv_pool import decode_traffic

    block = next(c for c in plan.costs if c.name.startswith("decode_block"))
    if block.refused:
        return {}
    t = decode_traffic(
        plan.kv, xla_bytes=block.bytes_accessed, steps=plan.decode_steps,
        weight_bytes=plan.engine_weight_bytes, hbm_bytes=block.hbm_bytes,
    )  # fmt: skip
    out = {
        "attention": plan.kv.attention,
        "xla_gb": round(t.xla / 1e9, 3),
        "hbm_gb": round(t.hbm / 1e9, 3),
        "kernel_kv_gb": round(t.kernel_unseen / 1e9, 3),
        "weights_gb": round(t.weights / 1e9, 3),
        "kv_in_use_gb": round(t.kv_in_use / 1e9, 3),
        "xla_ratio": round((t.xla + t.kernel_unseen) / t.paper, 2),
    }
    if t.hbm > 0:
        out["hbm_ratio"] = round((t.hbm + t.kernel_unseen) / t.paper, 2)
    return out


def forecast_summary(case: Case, plan) -> dict:
    """The simulator's figures on a plan's roofline costs (model figures, seconds of
    simulation, no compile): sync colocated, the best async split, the kernel what-if."""
    from jaxflash.runtime.simulate.forecast import make_forecast
    from jaxflash.runtime.simulate.plan_costs import RunShape

    topo = parse_topology(case.topology)
    cap = topo.chip.usable_hbm_bytes
    shape = RunShape(
        slice_chips=topo.chips, learner_chips=case.learner, gen_chips=case.engine_chips,
        slots=case.slots, prompts_per_step=case.batch // 8, group_size=8,
        prompt_tokens=PROMPT, max_new_tokens=case.length - PROMPT, async_ratio=2,
        packing=True, micro_batch_size=case.learner, seq_len=case.length, hbm_bytes=cap,
    )  # fmt: skip
    try:
        f = make_forecast(plan, topo.chip, shape)
    except ValueError as err:
        return {"error": str(err)}
    out = {
        "sync_colocated": round(f.colocated.result.samples_per_s, 3),
        "best_async_a2": round(f.best.result.samples_per_s, 3),
        "best_split": f"{f.best.learner_chips}+{f.best.servers}x{case.engine_chips}",
        "sync_same_split": round(f.sync_same_split.result.samples_per_s, 3),
    }
    if f.what_if is not None:
        run = f.what_if[1]
        out["kernel_what_if"] = round(run.result.samples_per_s, 3)
        out["kernel_what_if_split"] = f"{run.learner_chips}+{run.servers}x{case.engine_chips}"
    return out


def _kind(name: str) -> str:
    return name.split("_")[0] if name.startswith("prefill") else name


def _decode_cell(d: dict) -> str:
    """HBM walk (+ kernel KV) / XLA (+ kernel KV) / weights + in-use KV, at half a pool."""
    if not d:
        return "-"
    paper = d["weights_gb"] + d["kv_in_use_gb"]
    hbm = f"{d['hbm_gb'] + d['kernel_kv_gb']:.2f}" if d.get("hbm_gb") else "-"
    return f"{hbm} / {d['xla_gb'] + d['kernel_kv_gb']:.2f} / {paper:.2f} ({d['attention']})"


def markdown(results: list[dict]) -> str:
    """One row per case: per-chip peak (program + what is held meanwhile) of each program,
    then the forecast's trained samples/s (model figures)."""
    names = []
    for r in results:
        for p in r["programs"]:
            if _kind(p["name"]) not in names:
                names.append(_kind(p["name"]))
    head = "| preset | slice | T | learner | generation | batch | slots / pool per engine | "
    head += " | ".join(names) + " | decode GB per step and chip: HBM / XLA / paper |"
    head += " forecast samples/s (sync coloc / async a=2, split) |"
    rows = [head, "|" + "---|" * (9 + len(names))]
    for r in results:
        cells = {}
        for p in r["programs"]:  # the largest prefill bucket is the last
            mark = "refused" if p["refused"] else ("ok" if p["fits_10pct"] else "over 90 %")
            cells[_kind(p["name"])] = f"{p['peak_gib']:.2f} ({mark})"
        f = r.get("forecast") or {}
        fc = (
            f"{f['sync_colocated']} / {f['best_async_a2']} ({f['best_split']})"
            if "best_async_a2" in f
            else f.get("error", "-")
        )
        if f.get("kernel_what_if"):
            fc += f"; kernel what-if {f['kernel_what_if']} ({f['kernel_what_if_split']})"
        data = r.get("data", 1)
        gen = (
            f"{r['engines']} x " + (f"data={data} x " if data > 1 else "") + f"tensor={r['tensor']}"
        )
        rows.append(
            f"| {r['preset']} | {r['topology']} ({r['capacity_gib']:.2f} GiB) | {r['length']} | "
            f"fsdp={r['learner']} | {gen} | {r['batch']} | {r['slots']} / {r['pool_tokens']:,} | "
            + " | ".join(cells.get(n, "-") for n in names)
            + f" | {_decode_cell(r.get('decode_bytes') or {})} | {fc} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="JSON file (rewritten after every case)")
    ap.add_argument("--only", default="", help="one preset")
    ap.add_argument("--no_forecast", action="store_true", help="compile only")
    ap.add_argument("--table", default="", help="print the markdown table of a results file")
    ap.add_argument(
        "--reforecast", default="", help="recompute a results file's forecasts (no compile)"
    )
    args = ap.parse_args()
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            print(markdown(json.load(f)))
        return
    if args.reforecast:
        from jaxflash.sizing.plan import Plan

        with open(args.reforecast, encoding="utf-8") as f:
            results = json.load(f)
        names = {f.name for f in dataclasses.fields(Case)}
        for r in results:
            case = Case(**{k: v for k, v in r.items() if k in names})
            r["forecast"] = forecast_summary(case, Plan.from_dict(r["plan"]))
            print(case.preset, r["forecast"], flush=True)
        with open(args.reforecast, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        return
    for case in CASES:
        parse_topology(case.topology)  # a typo fails before any compile
    results = []
    for case in CASES:
        if args.only and case.preset != args.only:
            continue
        r = run_case(case, forecast=not args.no_forecast)
        results.append(r)
        cells = " | ".join(
            f"{p['name']} {'refused' if p['refused'] else p['peak_gib']}" for p in r["programs"]
        )
        print(f"{case.preset} {case.topology} T={case.length} ({r['compile_s']} s): {cells}; "
              f"forecast {r.get('forecast')}", flush=True)  # fmt: skip
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
