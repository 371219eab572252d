"""Replay (ReFlow) vs sync vs async at the same generation budget: time to a target accuracy.

    python benchmarks/replay.py --sim-only                 # simulator part only, ~1 min
    python benchmarks/replay.py --seeds 1 --budget 64      # + real runs, smoke model (minutes)
    python benchmarks/replay.py --config configs/rlvr_smollm2_arith.py --seeds 3 --budget 4096

A SKELETON: it runs end to end, but no result from it is reported yet (no run at a
size where accuracy moves has been made; the smoke model is random and rewarded by
a toy reward, so its "accuracy" checks plumbing, not learning).

Part 1, real runs (``runtime.rlvr.run`` in this process, one workdir each). Four
configurations with the same generation budget (``--budget`` generated samples)
and the same seed(s):

* ``sync``: colocated, alpha = 0;
* ``async``: disjoint slices, alpha = 2;
* ``replay``: async + a replay cycle at fixed rho (``--rho``): fresh groups per step
  round((1 - rho) B), so the budget buys 1 / (1 - rho) times as many updates;
* ``adaptive``: as ``replay`` with ``controller.kind=adaptive`` (rho moves with the
  measured rates; its alpha / role-split decisions are only logged: elastic role
  changes are not wired into the live loop yet, so "+ elastic" is not measured).

Evaluation runs every ``--eval-samples`` generated samples in every configuration
(so every configuration evaluates at the same points of the budget). Time is
``trained_at_s`` minus the evaluation time spent before it (the evaluations are
the same in every configuration but are not training). The target is the sync
run's final held-out accuracy (mean over seeds) times ``--target-frac``; time to
target is the first evaluated step whose accuracy reaches it (inf if never).
Printed: per configuration, time to target (mean +- std over seeds), its ratio to
sync and to async ("n/a" when never reached), accuracy at the end of the budget,
and the load average. The budget counts fresh samples trained; async servers
generate up to alpha steps ahead, and ``samples_generated`` (printed per run)
includes that extra work.

Part 2, the simulator (``jaxflash.runtime.simulate``: the real scheduler under a
virtual clock) at 64-1,024 generation slots, the same four configurations at the
same device budget, cost model ``--costs``. The simulator has no accuracy: it
predicts the time to spend a generation budget and how many learner updates (and
trained samples, replayed included) that budget buys; whether replayed updates are
worth as much as fresh ones is what Part 1 measures. Its replay rows train
round((1 - rho) B) fresh groups + rho / (1 - rho) replayed samples per fresh one,
as the runtime does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from jaxflash.replay.dual_cycle import fresh_groups_needed  # noqa: E402
from jaxflash.runtime.simulate import (  # noqa: E402
    CostModel,
    LogNormal,
    SimConfig,
    Workload,
    simulate,
)

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("sync", "async", "replay", "adaptive")


# ----------------------------------------------------------------------------- real runs


def _config(path: str, mode: str, *, seed: int, budget: int, rho: float, eval_samples: int):
    """The experiment of one mode: same budget, same evaluation points in samples."""
    import importlib.util

    from jaxflash.runtime.experiment import ExperimentConfig

    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.seed = seed
    c.mesh.num_cpu_devices = 8
    B, G = c.rollout.prompts_per_step, c.rollout.group_size
    fresh_groups = B
    if mode != "sync":
        c.mesh.colocated = False
        c.mesh.num_generation_slices = 2
        c.mesh.learner = {"fsdp": 3, "tensor": 2}
        c.rollout.async_ratio = 2
    if mode in ("replay", "adaptive"):
        c.replay.ratio = rho
        c.replay.drop_uniform_groups = False
        fresh_groups = fresh_groups_needed(B, rho)
    if mode == "adaptive":
        c.controller.kind = "adaptive"
        c.controller.max_replay_ratio = max(rho, c.controller.max_replay_ratio)
    per_step = fresh_groups * G
    c.total_steps = max(1, budget // per_step)
    c.eval.every = max(1, eval_samples // per_step)
    c.checkpoint.every = c.total_steps
    return ExperimentConfig.from_config_dict(c)


def _curve(workdir: str) -> list[tuple[float, int, float]]:
    """(seconds without evaluation, samples generated, eval accuracy) per evaluated step."""
    out, eval_s = [], 0.0
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            m = json.loads(line)
            if "eval_accuracy" in m and m["step"] > 0:
                t = m["trained_at_s"] - eval_s
                out.append((t, int(m.get("samples_generated", 0)), float(m["eval_accuracy"])))
            eval_s += float(m.get("eval_time_s", 0.0))
    return out


def time_to_target(curve: list[tuple[float, int, float]], target: float) -> float:
    """First time whose accuracy reaches ``target`` (inf if none)."""
    return next((t for t, _, acc in curve if acc >= target), math.inf)


def _mean_std(xs: list[float]) -> str:
    finite = [x for x in xs if math.isfinite(x)]
    if len(finite) < len(xs):
        return f"inf ({len(xs) - len(finite)}/{len(xs)} never)"
    mean = sum(xs) / len(xs)
    std = (sum((x - mean) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5
    return f"{mean:.1f} +- {std:.1f} s"


def part1(args: argparse.Namespace) -> None:
    from jaxflash.runtime import rlvr

    curves: dict[str, list] = {m: [] for m in MODES}
    for seed in range(args.seeds):
        for mode in MODES:
            exp = _config(
                args.config,
                mode,
                seed=seed,
                budget=args.budget,
                rho=args.rho,
                eval_samples=args.eval_samples,
            )
            with tempfile.TemporaryDirectory() as workdir:
                rlvr.run(exp, workdir=workdir)
                curves[mode].append(_curve(workdir))
            print(f"  {mode} seed {seed}: {curves[mode][-1][-1:]}  load {os.getloadavg()}")
    finals = [c[-1][2] for c in curves["sync"] if c]
    target = args.target_frac * sum(finals) / max(len(finals), 1)
    print(f"\ntarget accuracy {target:.3f} (sync final mean x {args.target_frac})")
    ttt = {m: [time_to_target(c, target) for c in curves[m]] for m in MODES}
    mean = {m: sum(v) / len(v) for m, v in ttt.items()}
    print(f"{'mode':<10}{'time to target':>26}{'x sync':>8}{'x async':>9}{'final acc':>11}")
    for m in MODES:
        final = sum(c[-1][2] for c in curves[m]) / len(curves[m])
        vs_sync, vs_async = (
            f"{mean[base] / mean[m]:.2f}" if math.isfinite(mean[m]) else "n/a"
            for base in ("sync", "async")
        )
        print(f"{m:<10}{_mean_std(ttt[m]):>26}{vs_sync:>8}{vs_async:>9}{final:>11.3f}")
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")


# ----------------------------------------------------------------------------- simulator


def _workload(seed: int = 0) -> Workload:
    return Workload(
        lengths=LogNormal(median=1500, sigma=1.0),
        max_tokens=16384,
        prompt_tokens=(200, 350, 500),
        prompt_sigma=0.5,
        pass_alpha=0.6,
        pass_beta=0.6,
        seed=seed,
    )


def sim_config(mode: str, *, slots: int, slots_per_server: int, rho: float) -> SimConfig:
    """One mode at ``slots`` generation slots (sync: all devices generate, then train;
    async: a quarter of the devices train, the rest generate)."""
    devices = max(2, slots // slots_per_server)
    B, G = max(1, slots // 16), 16  # N = B * G = the sync slots
    common = dict(slots_per_server=slots_per_server, group_size=G)
    if mode == "sync":
        return SimConfig(
            placement="colocated",
            servers=devices,
            learner_devices=devices,
            batch_prompts=B,
            warmup_steps=1,
            steps=3,
            **common,
        )
    train = max(1, devices // 4)
    fresh = fresh_groups_needed(B, rho) if mode != "async" else B
    return SimConfig(
        placement="disjoint",
        async_ratio=2,
        servers=devices - train,
        learner_devices=train,
        batch_prompts=fresh,
        replay_ratio=0.0 if mode == "async" else rho / (1 - rho),
        warmup_steps=3,
        steps=6,
        **common,
    )


def part2(args: argparse.Namespace) -> None:
    costs = CostModel.load(args.costs)
    print(f"\nsimulator: {os.path.basename(args.costs)}; rho = {args.rho}; adaptive = fixed")
    print("rho here (the simulator has no controller: its predictions equal 'replay')")
    head = f"{'slots':>6}{'mode':>10}{'fresh/s':>10}{'updates/s':>11}{'x sync':>8}{'x async':>9}"
    print(head + f"{'stale':>7}{'L idle':>8}{'G idle':>8}")
    for slots in args.sim_slots:
        base: dict[str, float] = {}
        for mode in MODES:
            cfg = sim_config(
                mode if mode != "adaptive" else "replay",
                slots=slots,
                slots_per_server=args.slots_per_server,
                rho=args.rho,
            )
            res = simulate(cfg, costs, _workload())
            # Same generation budget: time to spend it ~ 1 / fresh samples per second;
            # updates per second of that time = 1 / step_s.
            fresh_per_s = res.samples_per_s
            updates_per_s = 1.0 / max(res.step_s, 1e-12)
            base.setdefault(mode, updates_per_s)
            print(
                f"{slots:>6}{mode:>10}{fresh_per_s:>10.2f}{updates_per_s:>11.4f}"
                f"{updates_per_s / base['sync']:>8.2f}"
                f"{updates_per_s / base.get('async', updates_per_s):>9.2f}"
                f"{res.staleness_mean:>7.2f}{res.learner_idle:>8.2f}{res.gen_idle:>8.2f}"
            )
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(REPO_ROOT, "configs", "smoke.py"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--budget", type=int, default=64, help="generated samples per run")
    p.add_argument("--eval-samples", type=int, default=16, help="generated samples per eval")
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--target-frac", type=float, default=1.0)
    p.add_argument("--sim-only", action="store_true")
    p.add_argument("--sim-slots", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--slots-per-server", type=int, default=32)
    p.add_argument("--costs", default=os.path.join(HERE, "sim_costs", "h800_qwen3_8b.json"))
    args = p.parse_args()
    print(f"load average at start (1, 5, 15 min): {os.getloadavg()}")
    if not args.sim_only:
        part1(args)
    part2(args)


if __name__ == "__main__":
    main()
