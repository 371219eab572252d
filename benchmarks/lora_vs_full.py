"""LoRA against full fine-tuning at the same number of generated samples: accuracy curves.

    # the real model (SmolLM2-135M-Instruct GGUF), the default arithmetic task, sync:
    python benchmarks/lora_vs_full.py --budget 320 --out runs/lora_vs_full.json
    # choose the arms: NAME:LR[:RANK[:BASE_DTYPE]] (rank 0 is full fine-tuning)
    python benchmarks/lora_vs_full.py --arms full:2e-5 lora16:2e-4:16 qlora16:2e-4:16:int8

Each arm is one ``runtime.loop.run`` of ``configs/rlvr_smollm2_arith.py`` (or
``--config``) in this process, colocated and synchronous (alpha = 0, so the only
difference between arms is what is trained), with the same seed, stopped at the step
whose generated samples reach ``--budget`` (``benchmarks/replay.py``'s ``budget_stop``).
Held-out accuracy (mean@2 over ``data.eval_size`` prompts, the config's evaluation) every
``--eval_samples`` generated samples. Printed per arm: the curve (accuracy +- stderr vs
generated samples), the mean ``publish_bytes`` and ``weight_sync_s`` per learner step,
and wall time. ``--out`` keeps it all.

The learning rates are the comparison's main knob: LoRA's usual rate is about 10x full
fine-tuning's (arXiv 2106.09685 trains GPT-3 adapters at 2e-4). Accuracy moves within
320 samples on this task at full fine-tuning lr 2e-5 (docs/RESULTS.md, the replay
benchmark's sync arm), hence the default arms. Cost on 2 shared CPU cores: about 10-15
min an arm at the default budget.
"""

from __future__ import annotations

import argparse
import json
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

from replay import apply_override, budget_stop, make_config, read_curve  # noqa: E402

DEFAULT_ARMS = ("full:2e-5", "lora16:2e-4:16")


def parse_arm(text: str) -> dict[str, Any]:
    """``NAME:LR[:RANK[:BASE_DTYPE]]`` -> {name, lr, rank, base_dtype}.

    Raises:
      ValueError: fewer than two fields, a non-numeric lr or rank, or rank < 0.
    """
    parts = text.split(":")
    if len(parts) < 2 or not parts[0]:
        raise ValueError(f"--arms {text!r}: expected NAME:LR[:RANK[:BASE_DTYPE]]")
    try:
        lr = float(parts[1])
        rank = int(parts[2]) if len(parts) > 2 else 0
    except ValueError as e:
        raise ValueError(f"--arms {text!r}: lr and rank must be numbers ({e})") from None
    if rank < 0:
        raise ValueError(f"--arms {text!r}: rank must be >= 0, got {rank}")
    base = parts[3] if len(parts) > 3 else "float32"
    return {"name": parts[0], "lr": lr, "rank": rank, "base_dtype": base}


def publish_stats(workdir: str) -> dict[str, float]:
    """Mean publish bytes and weight-sync seconds per learner step.

    The publish before step 1 (the whole model, or a LoRA run's base and adapters) is
    not a step's and is not in ``metrics.jsonl``: these are the per-update figures.
    """
    rows = []
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            m = json.loads(line)
            if "publish_bytes" in m:
                rows.append((float(m["publish_bytes"]), float(m.get("weight_sync_s", 0.0))))
    n = max(len(rows), 1)
    return {
        "publish_bytes": sum(b for b, _ in rows) / n,
        "weight_sync_s": sum(s for _, s in rows) / n,
        "steps": len(rows),
    }


def run_arm(arm: dict[str, Any], args: argparse.Namespace, root: str) -> dict[str, Any]:
    """One arm's run, its curve and publish figures."""
    from jaxflash.runtime import loop

    overrides = [f"learner.lr={arm['lr']}", *args.set]
    if arm["rank"]:
        overrides += [
            f"learner.lora.rank={arm['rank']}",
            f"learner.lora.base_dtype={arm['base_dtype']}",
        ]
    exp = make_config(
        args.config, "sync", seed=args.seed, budget=args.budget, rho=0.0,
        eval_samples=args.eval_samples, eval_prompts=args.eval_prompts, overrides=overrides,
    )  # fmt: skip
    workdir = os.path.join(root, arm["name"])
    t0 = time.monotonic()
    last = loop.run(exp, workdir=workdir, stop_after=budget_stop(args.budget, None))
    return {
        **arm,
        "workdir": workdir,
        "wall_s": time.monotonic() - t0,
        "generated": int(last.get("samples_generated", 0)),
        "curve": read_curve(workdir),
        "publish": publish_stats(workdir),
        "load": os.getloadavg(),
    }


def print_arm(r: dict[str, Any]) -> None:
    p = r["publish"]
    kind = f"LoRA r={r['rank']} base {r['base_dtype']}" if r["rank"] else "full fine-tuning"
    print(
        f"{r['name']} ({kind}, lr {r['lr']:g}): {r['generated']} samples generated, "
        f"{r['wall_s'] / 60:.1f} min, load {tuple(round(x, 1) for x in r['load'])}"
    )
    print(
        f"    publish per step {p['publish_bytes'] / 1e6:.1f} MB in {p['weight_sync_s']:.2f} s "
        f"(mean of {p['steps']} steps)"
    )
    for c in r["curve"]:
        print(
            f"    step {c['step']:>3}  {c['generated']:>5} gen  acc {c['accuracy']:.3f} "
            f"+- {c['stderr']:.3f}"
        )
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(REPO_ROOT, "configs", "rlvr_smollm2_arith.py"))
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS))
    p.add_argument("--budget", type=int, default=320, help="samples generated per arm")
    p.add_argument("--eval_samples", type=int, default=96, help="generated samples between evals")
    p.add_argument("--eval_prompts", type=int, default=None, help="held-out prompts per eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE for every arm")
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    p.add_argument("--out", default="", help="write the arms' results as JSON here")
    args = p.parse_args()
    arms = [parse_arm(a) for a in args.arms]
    if len({a["name"] for a in arms}) != len(arms):
        p.error("--arms: names must differ (each arm gets a workdir by name)")
    for item in args.set:  # fail before any run starts
        apply_override(make_probe(args.config), item)
    root = args.workdir or tempfile.mkdtemp(prefix="lora_vs_full_")
    results = []
    for arm in arms:
        results.append(run_arm(arm, args, root))
        print_arm(results[-1])
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"args": vars(args), "arms": results}, f, indent=1)


def make_probe(path: str) -> Any:
    """The config file's ConfigDict, to check ``--set`` keys before running."""
    from replay import _load

    return _load(path)


if __name__ == "__main__":
    main()
