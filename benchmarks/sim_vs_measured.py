"""The simulator against a measured run on the same settings, side by side in one run.

    python benchmarks/sim_vs_measured.py                  # sync, α = 1, 2; ~15 min on 2 cores

Order, alternating: calibrate (``calibrate_sim.calibrate``: our engine and
learner, this machine, now; contention factors measured once here) -> measured
sync run (``benchmarks/async_vs_sync.py``'s workload through ``rlvr.run``) ->
calibrate -> measured α = 1 -> calibrate -> ... Each mode is then simulated with
the calibrations just before and just after it (``jaxflash.runtime.simulate``:
the real scheduler, the same B, G, K, servers, learner devices, steps and
warm-up, geometric lengths with the same p and cap, the dataset's prompt lengths
by prompt id) and the trained
samples/s printed next to the measured ones, with the relative difference and
the load average around each piece (the machine is shared: loads move the
absolute numbers within minutes, so each run is bracketed by its own two
calibrations).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import async_vs_sync as avs  # noqa: E402  (sets XLA_FLAGS for 8 fake devices)
import calibrate_sim  # noqa: E402


def sim_config(args: argparse.Namespace, alpha: int | None):
    from jaxflash.runtime.simulate import SimConfig

    common = dict(
        batch_prompts=args.prompts,
        group_size=args.group,
        steps=args.steps,
        warmup_steps=args.warmup,
        learner_devices=6,
        seed=args.seed,
    )
    if alpha is None:
        return SimConfig(placement="colocated", servers=1, slots_per_server=args.slots, **common)
    return SimConfig(
        placement="disjoint",
        async_ratio=alpha,
        servers=2,
        slots_per_server=args.slots // 2,
        **common,
    )


def workload(args: argparse.Namespace, costs: dict):
    from jaxflash.runtime.simulate import Geometric, SimWorkload

    return SimWorkload(
        lengths=Geometric(args.eos_prob),
        max_tokens=args.max_new_tokens,
        prompt_tokens=tuple(costs["meta"]["prompt_tokens"]),
        seed=args.seed,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--alphas", default="1,2")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--eos_prob", type=float, default=1 / 16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--learner_reps", type=int, default=2)
    ap.add_argument("--reward_items", type=int, default=32)
    ap.add_argument("--contention_steps", type=int, default=3)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--costs_out", default="", help="also save the first calibration here")
    args = ap.parse_args()
    alphas = [int(a) for a in args.alphas.split(",") if a.strip()]
    workdir = args.workdir or tempfile.mkdtemp(prefix="sim_vs_measured_")

    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from jaxflash.runtime import loop as rlvr
    from jaxflash.runtime.config.experiment import ExperimentConfig
    from jaxflash.runtime.simulate import CostModel, simulate

    model_dir = os.path.join(workdir, "model")
    avs.build_length_model(
        model_dir, eos_prob=args.eos_prob, max_len=64 + args.max_new_tokens, seed=args.seed
    )
    avs.precompile_train_buckets(
        ExperimentConfig.from_config_dict(avs.make_config(args, model_dir, None))
    )
    log = []

    def note(what: str) -> None:
        log.append((what, os.getloadavg()[0]))
        print(f"[{time.strftime('%H:%M:%S')}] {what}; load {os.getloadavg()[0]:.1f}", flush=True)

    note("calibration 0 (full, with contention)")
    cal, setup = calibrate_sim.calibrate(args, model_dir)
    print(calibrate_sim.json_summary(cal), flush=True)
    if args.costs_out:
        CostModel.from_dict(cal).save(args.costs_out)
    cals, measured = [cal], {}
    for name, alpha in [("sync", None)] + [(f"a={a}", a) for a in alphas]:
        note(f"measured {name}")
        exp = ExperimentConfig.from_config_dict(avs.make_config(args, model_dir, alpha))
        run_dir = os.path.join(workdir, name.replace("=", ""))
        load0 = os.getloadavg()[0]
        rlvr.run(exp, workdir=run_dir)
        res = avs.summarize(run_dir, warmup=args.warmup)
        res.update(alpha=alpha, load=(load0, os.getloadavg()[0]))
        measured[name] = res
        note(f"calibration after {name} (quick; contention reused)")
        cal, _ = calibrate_sim.calibrate(
            args, model_dir, setup, contention_table=cals[0]["contention"], quick=True
        )
        print(calibrate_sim.json_summary(cal), flush=True)
        cals.append(cal)
    note("done")

    rows = []
    for i, (name, res) in enumerate(measured.items()):
        sims = []
        for cal in (cals[i], cals[i + 1]):  # the calibrations just before and after it
            sims.append(
                simulate(
                    sim_config(args, res["alpha"]), CostModel.from_dict(cal), workload(args, cal)
                )
            )
        mean = sum(s.samples_per_s for s in sims) / 2
        rows.append((name, res, sims, mean))
    print(
        f"\nload average now: {os.getloadavg()}; pieces: "
        + ", ".join(f"{w} @ {ld:.1f}" for w, ld in log)
    )
    head = (
        f"{'mode':<8}{'measured/s':>11}{'sim bef':>9}{'sim aft':>9}{'sim mean':>9}{'diff':>8}  "
        f"{'meas x sync':>11}{'sim x sync':>11}  {'meas stale':>10}{'sim stale':>10}{'load':>11}"
    )
    print(head + "\n" + "-" * len(head))
    base_m, base_s = rows[0][1]["samples_per_s"], rows[0][3]
    out = {}
    for name, res, sims, mean in rows:
        diff = (mean - res["samples_per_s"]) / res["samples_per_s"]
        stale = (sims[0].staleness_mean + sims[1].staleness_mean) / 2
        print(
            f"{name:<8}{res['samples_per_s']:>11.3f}{sims[0].samples_per_s:>9.3f}"
            f"{sims[1].samples_per_s:>9.3f}{mean:>9.3f}{diff:>+8.1%}  "
            f"{res['samples_per_s'] / base_m:>11.2f}{mean / base_s:>11.2f}  "
            f"{res['staleness_mean']:>10.2f}{stale:>10.2f}"
            f"{res['load'][0]:>6.1f}->{res['load'][1]:<4.1f}"
        )
        out[name] = {
            "measured": res["samples_per_s"],
            "sim_a": sims[0].samples_per_s,
            "sim_b": sims[1].samples_per_s,
            "diff": diff,
        }
    print(
        "measured = trained samples/s of the real run (async_vs_sync.summarize); sim bef / aft = "
        "the simulator with the calibration taken just before / just after that run; diff = "
        "(sim mean - measured) / measured."
    )
    with open(os.path.join(workdir, "sim_vs_measured.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"args": vars(args), "results": out, "calibrations": cals, "measured": measured},
            f,
            indent=1,
        )
    print(f"summary: {os.path.join(workdir, 'sim_vs_measured.json')}")


if __name__ == "__main__":
    main()
