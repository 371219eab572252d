"""Replay (ReFlow) vs sync vs async at the same generation budget: time to a target accuracy.

    # the real model (SmolLM2-135M-Instruct GGUF) on the default arithmetic task:
    python benchmarks/replay.py --model real --seeds 1
    python benchmarks/replay.py --model real --seeds 3 --budget_minutes 90
    # the tiny random model (plumbing only: its "accuracy" is a toy reward's), minutes:
    python benchmarks/replay.py --model tiny --seeds 1 --no_sim
    python benchmarks/replay.py --sim_only          # the simulator part alone, ~1 min

Real runs (``runtime.loop.run`` in this process, one workdir each), four
configurations, each spending the same generation budget (``--budget`` samples
generated, the scheduler's ``samples_generated``; default 640 = the 20 steps of
8 prompts x 4 samples of the README's real-model result) with the same seed(s):

* ``sync``: colocated, alpha = 0 (the config's own colocated mesh);
* ``async``: disjoint generation slices, alpha = 2;
* ``replay``: async + a replay cycle at fixed rho (``--rho``, correction
  ``--correction``): round((1 - rho) B) fresh groups a step, so the budget buys
  about 1 / (1 - rho) times as many updates;
* ``adaptive``: as ``replay`` with ``controller.kind=adaptive`` (rho, alpha <= 2 and
  the requests in flight follow the measured rates) and ``controller.elastic`` (its
  role split moves generation slices into and out of the learner live,
  ``runtime.control.elastic``) where the learner mesh can grow by one slice (data x tensor
  of ``mesh.learner`` divides the slice size: the real config's fsdp-only learner
  can; the tiny config's tensor = 2 learner cannot, so there it is "+ adaptive" only).

A run stops (``rlvr.run(stop_after=...)``, evaluated and checkpointed) at the step
where its generated samples reach the budget, or after ``--budget_minutes`` of
wall time (then it is marked "cut" and spent less than the budget). Async servers
generate ahead, so they stop after fewer learner steps than sync: the generation
spent, not the steps, is what is equal. Evaluation every ``--eval_samples``
generated samples' worth of steps (at the start rho). Time is ``trained_at_s``
(from the first generation request) minus the evaluation time spent before it;
servers keep generating during an asynchronous run's evaluations, which this
leaves in (a small advantage to the async modes). Target accuracy: the sync
runs' final held-out accuracy (mean over seeds) x ``--target_frac`` (several
values: one summary each; ``--summarize FILE`` re-summarizes a kept ``--out`` JSON
without running anything); time to target is the first evaluated step reaching it
(never: inf). Printed: each run's
curve (accuracy vs seconds and vs generated samples), then per configuration the
time to target (mean +- std over seeds), its ratio to sync and to async (per seed,
mean +- std), the generated samples to target, the final accuracy, and the load
average. ``--out`` keeps everything as JSON.

Cost (real model, 2 shared CPU cores, estimated from earlier real-model runs: 1.5-3
min a learner step of 32 rows, 1.5-2 min an evaluation of 100 prompts; not run at this
size yet): with the defaults 40-100 min per configuration (sync 20 steps, async about
18, replay and adaptive about 40 smaller-generation steps), 3-5 h for one seed, 9-15 h
for three; ``--budget_minutes`` caps each run. The tiny model (``--model tiny``, budget
64) takes about 5 min with the simulator part.

Part 2 (``benchmarks/replay_sim.py``): the same four configurations through the
simulator at 64-1,024 generation slots.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, HERE)

from replay_sim import run_simulator  # noqa: E402

from jaxflash.replay.dual_cycle import fresh_groups_needed  # noqa: E402

MODES = ("sync", "async", "replay", "adaptive")
CONFIGS = {
    "real": os.path.join(REPO_ROOT, "configs", "rlvr_smollm2_arith.py"),
    "tiny": os.path.join(REPO_ROOT, "configs", "smoke.py"),
}
DEFAULT_BUDGET = {"real": 640, "tiny": 64}


# ----------------------------------------------------------------------------- configs


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def make_config(
    path: str,
    mode: str,
    *,
    seed: int,
    budget: int,
    rho: float,
    eval_samples: int,
    correction: str | None = None,
    eval_prompts: int | None = None,
    overrides: list[str] | None = None,
) -> Any:
    """The ExperimentConfig of one configuration.

    ``total_steps`` is an upper bound (the budget at the fewest fresh samples a step
    can take); the run stops at the budget through ``stop_after``. ``eval.every``
    puts an evaluation every ``eval_samples`` fresh samples at the start rho.
    """
    from jaxflash.runtime.config.experiment import ExperimentConfig

    c = _load(path)
    for item in overrides or ():
        apply_override(c, item)
    c.seed = seed
    c.mesh.colocated = mode == "sync"  # the config's device counts follow it
    c.rollout.async_ratio = 0 if mode == "sync" else 2
    if eval_prompts is not None:
        c.data.eval_size = eval_prompts
    B, G = c.rollout.prompts_per_step, c.rollout.group_size
    fresh, fewest = B, B
    if mode in ("replay", "adaptive"):
        c.replay.ratio = rho
        c.replay.max_age = 4  # > alpha: samples arriving 2 versions old can be replayed
        if correction:
            c.replay.correction = correction
        fresh = fewest = fresh_groups_needed(B, rho)
    if mode == "adaptive":
        c.controller.kind = "adaptive"
        # + elastic where every learner size one slice apart forms a mesh (elastic_spec).
        row = int(c.mesh.learner.get("data", 1)) * int(c.mesh.learner.get("tensor", 1))
        c.controller.elastic = math.prod(c.mesh.generation.values()) % row == 0
        c.controller.max_replay_ratio = max(rho, c.controller.max_replay_ratio)
        fewest = fresh_groups_needed(B, c.controller.max_replay_ratio)
    c.total_steps = max(1, math.ceil(budget / (fewest * G)))
    c.eval.every = max(1, round(eval_samples / (fresh * G)))
    c.checkpoint.every = c.total_steps
    return ExperimentConfig.from_config_dict(c)


def apply_override(c: Any, item: str) -> None:
    """Set one ``KEY=VALUE`` (dotted key, Python-literal value, else a string) on the
    ConfigDict ``c``, for every configuration alike (e.g. ``learner.lr=2e-5``).

    Raises:
      ValueError: no ``=``, or a key the config does not define.
    """
    import ast

    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. learner.lr=2e-5")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    *parents, leaf = key.split(".")
    node = c
    for name in parents:
        if name not in node:
            raise ValueError(f"--set {item!r}: the config has no field {key!r}")
        node = node[name]
    if leaf not in node:
        raise ValueError(f"--set {item!r}: the config has no field {key!r}")
    if isinstance(node[leaf], float) and isinstance(value, int):
        value = float(value)
    node[leaf] = value


def budget_stop(budget: int, minutes: float | None, clock=time.monotonic):
    """``stop_after`` for ``rlvr.run``: True once ``samples_generated`` reaches
    ``budget`` or ``minutes`` of wall time passed since this call (None: no cap)."""
    t0 = clock()

    def stop(metrics: dict[str, Any]) -> bool:
        if int(metrics.get("samples_generated", 0)) >= budget:
            return True
        return minutes is not None and clock() - t0 >= 60.0 * minutes

    return stop


# ----------------------------------------------------------------------------- curves


def read_curve(workdir: str) -> list[dict[str, float]]:
    """Evaluated steps of a run: step, seconds (without evaluation), samples generated,
    fresh samples trained, replayed samples trained, accuracy and its stderr.

    Step 0 (before any generation) is included at 0 s; its evaluation happens
    before the first generation request, so it is not subtracted from later times.
    """
    out, eval_s, fresh, replayed = [], 0.0, 0, 0
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            m = json.loads(line)
            fresh += int(m.get("num_samples", 0))
            replayed += int(m.get("cycle_replay_samples", 0))
            if "eval_accuracy" in m:
                step = int(m["step"])
                out.append(
                    {
                        "step": step,
                        "seconds": m["trained_at_s"] - eval_s if step else 0.0,
                        "generated": int(m.get("samples_generated", 0)),
                        "trained": fresh,
                        "replayed": replayed,
                        "accuracy": float(m["eval_accuracy"]),
                        "stderr": float(m.get("eval_accuracy_stderr", float("nan"))),
                    }
                )
            if int(m["step"]):
                eval_s += float(m.get("eval_time_s", 0.0))
    return out


def first_reaching(curve: list[dict[str, float]], target: float, key: str) -> float:
    """``key`` ("seconds" or "generated") at the first evaluated step (after step 0)
    whose accuracy reaches ``target`` (inf if none)."""
    return next((p[key] for p in curve if p["step"] and p["accuracy"] >= target), math.inf)


def mean_std(xs: list[float], unit: str = "", missing: str = "never") -> str:
    """'mean +- std unit' (sample std) over the finite values; the others are named
    ``missing`` ('never' for a time never reached, 'n/a' for an undefined ratio)."""
    finite = [x for x in xs if math.isfinite(x)]
    if not finite:
        return f"{missing} ({len(xs)}/{len(xs)})"
    mean = sum(finite) / len(finite)
    std = (sum((x - mean) ** 2 for x in finite) / max(len(finite) - 1, 1)) ** 0.5
    text = f"{mean:.2f} +- {std:.2f}{unit}"
    if len(finite) < len(xs):
        text += f" ({len(xs) - len(finite)}/{len(xs)} {missing})"
    return text


# ----------------------------------------------------------------------------- real runs


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every (seed, mode) run; their curves and run facts."""
    from jaxflash.runtime import loop as rlvr

    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    root = args.workdir or tempfile.mkdtemp(prefix="replay_bench_")
    for seed in range(args.seeds):
        for mode in args.modes:
            exp = make_config(
                args.config, mode, seed=seed, budget=args.budget, rho=args.rho,
                eval_samples=args.eval_samples, correction=args.correction,
                eval_prompts=args.eval_prompts, overrides=args.set,
            )  # fmt: skip
            workdir = os.path.join(root, f"{mode}_seed{seed}")
            t0 = time.monotonic()
            last = rlvr.run(
                exp, workdir=workdir, stop_after=budget_stop(args.budget, args.budget_minutes)
            )
            curve = read_curve(workdir)
            generated = int(last.get("samples_generated", 0))
            runs[mode].append(
                {
                    "seed": seed,
                    "workdir": workdir,
                    "wall_s": time.monotonic() - t0,
                    "steps": int(last.get("policy_version", 0)),
                    "generated": generated,
                    "cut": generated < args.budget,
                    "curve": curve,
                    "load": os.getloadavg(),
                }
            )
            r = runs[mode][-1]
            cut = " (cut by --budget_minutes)" if r["cut"] else ""
            print(
                f"{mode} seed {seed}: {r['steps']} steps, {generated} samples generated{cut}, "
                f"{r['wall_s'] / 60:.1f} min; load {tuple(round(x, 1) for x in r['load'])}"
            )
            for p in curve:
                print(
                    f"    step {p['step']:>3}  {p['seconds']:>8.1f} s  {p['generated']:>6} gen  "
                    f"{p['trained']:>6} fresh + {p['replayed']:>5} replayed trained  "
                    f"acc {p['accuracy']:.3f} +- {p['stderr']:.3f}"
                )
            sys.stdout.flush()
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]], target_frac: float) -> dict[str, Any]:
    """Target from the sync runs, then each mode's time / samples to it and ratios."""
    finals = [r["curve"][-1]["accuracy"] for r in runs.get("sync", []) if r["curve"]]
    if not finals:
        raise ValueError("the target accuracy is set from the sync runs: include mode sync")
    target = target_frac * sum(finals) / len(finals)
    out: dict[str, Any] = {"target": target, "target_frac": target_frac, "modes": {}}
    for mode, rs in runs.items():
        t = [first_reaching(r["curve"], target, "seconds") for r in rs]
        g = [first_reaching(r["curve"], target, "generated") for r in rs]
        out["modes"][mode] = {
            "time_to_target_s": t,
            "samples_to_target": g,
            "final_accuracy": [r["curve"][-1]["accuracy"] for r in rs],
            "cut": [r["cut"] for r in rs],
        }
    for m in out["modes"].values():  # per-seed ratios: baseline time / this time
        for base in ("sync", "async"):
            if base in out["modes"]:
                base_t = out["modes"][base]["time_to_target_s"]
                pairs = zip(base_t, m["time_to_target_s"], strict=True)
                m[f"speedup_vs_{base}"] = [_ratio(b, x) for b, x in pairs]
    return out


def _ratio(base: float, this: float) -> float:
    """base / this; NaN (undefined) when either run never reached the target."""
    if not (math.isfinite(base) and math.isfinite(this)):
        return math.nan
    return base / this


def print_summary(s: dict[str, Any], loads: dict[str, list] | None = None) -> None:
    """The summary table; ``loads``: each mode's load averages as its runs recorded
    them (None: this machine's load now, right after the runs)."""
    print(
        f"\ntarget accuracy {s['target']:.3f} (sync final mean x target_frac {s['target_frac']:g})"
    )
    head = f"{'mode':<10}{'time to target':>30}{'x sync':>24}{'x async':>24}"
    print(head + f"{'samples to target':>28}{'final acc':>11}{'cut':>5}")
    for mode, m in s["modes"].items():
        final = sum(m["final_accuracy"]) / len(m["final_accuracy"])
        ratios = [
            mean_std(m[f"speedup_vs_{b}"], missing="n/a") if f"speedup_vs_{b}" in m else "n/a"
            for b in ("sync", "async")
        ]
        print(
            f"{mode:<10}{mean_std(m['time_to_target_s'], ' s'):>30}{ratios[0]:>24}"
            f"{ratios[1]:>24}{mean_std(m['samples_to_target']):>28}{final:>11.3f}"
            f"{sum(m['cut']):>5}"
        )
    print(
        "(x sync / x async: per seed, the baseline's time to target / this one's, over the "
        "seeds where both reached it; n/a: one of the two never did)"
    )
    if loads is None:
        print(f"load average (1, 5, 15 min): {os.getloadavg()}")
    else:
        for mode, per_run in loads.items():
            shown = ", ".join(str(tuple(round(x, 1) for x in load)) for load in per_run)
            print(f"load average at the end of each {mode} run (1, 5, 15 min): {shown}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(CONFIGS), default="real")
    p.add_argument("--config", default="", help="a configs/*.py (default: --model's)")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--budget", type=int, default=0, help="samples generated per run (0: model's)")
    p.add_argument("--budget_minutes", type=float, default=None, help="wall-time cap per run")
    p.add_argument("--eval_samples", type=int, default=0, help="fresh samples between evals")
    p.add_argument("--eval_prompts", type=int, default=None, help="held-out prompts per eval")
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--correction", default=None, help="replay.correction (default: the loss)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config field for every configuration, e.g. learner.lr=2e-5 (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--target_frac", type=float, nargs="+", default=[1.0],
        help="target = sync final accuracy x this; several: one summary each",
    )  # fmt: skip
    p.add_argument(
        "--summarize", default="", metavar="JSON",
        help="no runs: summarize the runs kept in a --out JSON (e.g. at other --target_frac)",
    )  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    p.add_argument("--out", default="", help="write curves and summary as JSON here")
    p.add_argument("--sim_only", action="store_true")
    p.add_argument("--no_sim", action="store_true")
    p.add_argument("--sim_slots", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--slots_per_server", type=int, default=32)
    p.add_argument("--costs", default=os.path.join(HERE, "sim_costs", "h800_qwen3_8b.json"))
    args = p.parse_args()
    args.config = args.config or CONFIGS[args.model]
    args.budget = args.budget or DEFAULT_BUDGET[args.model]
    args.eval_samples = args.eval_samples or max(1, args.budget // 4)
    if any(not (math.isfinite(f) and f > 0) for f in args.target_frac):
        p.error(f"--target_frac must be > 0, got {args.target_frac}")
    if args.summarize:
        try:
            with open(args.summarize, encoding="utf-8") as f:
                runs = json.load(f)["runs"]
        except (OSError, ValueError, KeyError) as err:
            p.error(f"--summarize {args.summarize}: not a --out JSON of this benchmark ({err!r})")
        loads = {mode: [r.get("load", ()) for r in rs] for mode, rs in runs.items()}
        for frac in args.target_frac:
            print_summary(summarize(runs, frac), loads)
        return
    print(f"load average at start (1, 5, 15 min): {os.getloadavg()}")
    if not args.sim_only:
        runs = run_all(args)
        # The target comes from the sync runs: without them the curves are kept and
        # printed, and no time to target is summarized.
        has_sync = bool(runs.get("sync"))
        summaries = [summarize(runs, frac) for frac in args.target_frac] if has_sync else []
        for summary in summaries:
            print_summary(summary)
        if not has_sync:
            print("no sync runs (--modes): no target accuracy, so no time-to-target summary")
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                out = {"args": vars(args), "runs": runs, "summaries": summaries}
                json.dump(out, f, indent=1)
    if not args.no_sim:
        run_simulator(args)


if __name__ == "__main__":
    main()
