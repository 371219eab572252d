"""Per-chip peak of every program, per preset and TPU slice, compiled without a TPU.

    pip install -e '.[tpu]'
    python benchmarks/tpu_plan.py --out benchmarks/results/tpu_plan.json   # docs/TPU.md table
    python benchmarks/tpu_plan.py --only qwen2p5_1p5b --lengths 2048
    python benchmarks/tpu_plan.py --micro_batch_size 1 --slots 32 --out ..._small.json

Each case is a disjoint placement on one slice: the learner on the first chips
(fsdp), generation slices of ``tensor`` chips after it, at the settings a user
would start from (fp32 master weights, bf16 compute, remat on, GRPO batch of
prompts x 8 samples, prompt = T / 4, the rest response). Programs: train step,
prefill at the largest bucket (the smaller buckets need less), decode block of 8
steps, publish and install. Memory figures are XLA's for libtpu 0.0.42.1's
compiler; "refused" means that compiler refused the program for HBM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported: libtpu only compiles

from jaxflash.sizing.chips import parse_topology  # noqa: E402

# (preset, slice, learner chips, generation tensor size, slots, batch sequences, micro)
CASES = [
    ("qwen2p5_1p5b", "v5e-16", 8, 8, 128, 64, 8),
    ("qwen2p5_7b", "v5p-64", 16, 8, 256, 256, 4),
    ("llama3p1_8b", "v5p-64", 16, 8, 256, 256, 4),
    ("qwen3_8b", "v5p-64", 16, 8, 256, 256, 4),
]


def run_case(case: tuple, length: int, *, micro: int = 0, slots: int = 0) -> dict:
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.learner.config import LearnerConfig
    from jaxflash.models.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES
    from jaxflash.sizing.plan import plan_programs
    from jaxflash.sizing.tpu import topology_devices

    preset, name, n_learner, tensor, case_slots, batch, case_micro = case
    micro, slots = micro or case_micro, slots or case_slots
    topo = parse_topology(name)
    devices = topology_devices(topo)
    model = get_preset(preset, compute_dtype="bfloat16", remat=True, max_seq_len=length)
    prompt = length // 4
    engine = EngineConfig(
        max_concurrent_decodes=slots,
        max_prefill_length=prompt,
        max_target_length=length,
        decode_block=8,
    )
    lmesh = make_mesh(devices[:n_learner], {"fsdp": n_learner})
    gmesh = make_mesh(devices[n_learner : n_learner + tensor], {"tensor": tensor})
    t0 = time.perf_counter()
    costs = plan_programs(
        model, LearnerConfig(lr=1e-6, micro_batch_size=micro), engine,
        learner_mesh=lmesh, learner_rules=LEARNER_RULES,
        generation_mesh=gmesh, generation_rules=GENERATOR_RULES,
        batch_size=batch, seq_len=length, prefill_buckets=[prompt],
    )  # fmt: skip
    cap = topo.chip.usable_hbm_bytes // max(1, len(devices) // topo.chips)
    return {
        "preset": preset,
        "topology": name,
        "length": length,
        "learner": f"fsdp={n_learner}",
        "generation": f"tensor={tensor}",
        "batch": batch,
        "micro_batch": micro,
        "slots": slots,
        "capacity_gib": cap / 2**30,
        "compile_s": round(time.perf_counter() - t0, 1),
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
                "fits_10pct": (not c.refused) and c.resident_bytes <= 0.9 * cap,
            }
            for c in costs
        ],
    }


def markdown(results: list[dict]) -> str:
    """One row per case: per-chip peak (program + what is held meanwhile) of each program."""
    names = []
    for r in results:
        for p in r["programs"]:
            kind = p["name"].split("_")[0] if p["name"].startswith("prefill") else p["name"]
            if kind not in names:
                names.append(kind)
    head = "| preset | slice | T | learner | generation | batch / micro | slots | "
    head += " | ".join(names) + " |"
    rows = [head, "|" + "---|" * (7 + len(names))]
    for r in results:
        cells = {}
        for p in r["programs"]:
            kind = p["name"].split("_")[0] if p["name"].startswith("prefill") else p["name"]
            mark = "refused" if p["refused"] else ("ok" if p["fits_10pct"] else "over 90 %")
            cells[kind] = f"{p['peak_gib']:.2f} ({mark})"
        rows.append(
            f"| {r['preset']} | {r['topology']} ({r['capacity_gib']:.2f} GiB) | {r['length']} | "
            f"{r['learner']} | {r['generation']} | {r['batch']} / {r['micro_batch']} | "
            f"{r['slots']} | " + " | ".join(cells.get(n, "-") for n in names) + " |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="one preset")
    ap.add_argument("--lengths", default="2048,8192", help="sequence lengths T")
    ap.add_argument("--micro_batch_size", type=int, default=0, help="override every case's")
    ap.add_argument("--slots", type=int, default=0, help="override every case's decode slots")
    ap.add_argument("--table", default="", help="print the markdown table of a results file")
    args = ap.parse_args()
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            print(markdown(json.load(f)))
        return
    for case in CASES:
        parse_topology(case[1])  # a typo fails before any compile
    results = []
    for case in CASES:
        if args.only and case[0] != args.only:
            continue
        for length in (int(x) for x in args.lengths.split(",")):
            r = run_case(case, length, micro=args.micro_batch_size, slots=args.slots)
            results.append(r)
            cells = " | ".join(
                f"{p['name']} {'refused' if p['refused'] else p['peak_gib']}" for p in r["programs"]
            )
            print(f"{r['preset']} {r['topology']} T={length} ({r['compile_s']} s): {cells}",
                  flush=True)  # fmt: skip
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
