"""Sync vs async (α = 1, 2, 4) RLVR throughput on a long-tailed workload, side by side.

    python benchmarks/async_vs_sync.py                      # ~8-10 min on 2 CPU cores
    python benchmarks/async_vs_sync.py --steps 10 --alphas 1,2,4,8 --eos_prob 0.05

What runs. One invocation runs every mode in turn, in this process, through the
runtime's one loop (``runtime.loop.run``) from configs built here with
``ExperimentConfig.from_config_dict``; every number below is read back from each
run's metrics.jsonl / rollouts.jsonl. Same seed, prompts, model, decode slots and
number of learner steps (B prompts x G samples each) in every mode.

Model and length distribution (set through sampling, no sleeps). A random-init
model of the real architecture (SmolLM2 "tiny" preset: 2 layers, d_model 64,
SmolLM2's 49152-token vocabulary, tied embeddings), written as an HF directory
and loaded with ``model.source=hf``. Its weights are edited so that the
next-token distribution is the same at every position: the final RMSNorm weight
is zero except dimension 0, and every token's embedding has the constant C in
dimension 0, so every logit is h0 * C (h0 = final-normed hidden dim 0, ~sqrt(D))
and all non-EOS tokens tie; the EOS row gets C + δ with δ = ln(p (V-1)/(1-p)) / h0.
At temperature 1 each generated token is EOS with probability p, independently,
so the response length (tokens, EOS included) is geometric, truncated at M =
max_new_tokens:  P(len = k) = (1-p)^(k-1) p for k < M, P(len = M) = (1-p)^(M-1);
E[len] = (1 - (1-p)^M) / p.  Default p = 1/16, M = 64 (mean 15.7; the longest
of 16 samples is ~50-64, a long-tail ratio L/μ of ~3-4). The calibration checks
p at every position of a forward pass and prints min/max. learner.lr = 0, so the
policy never changes: every mode samples the same length distribution (the
learner still runs its full forward/backward/optimizer step).

Devices (8 fake CPU devices; each mode prints the ones it used). Every mode has
the same learner mesh, fsdp 3 x tensor 2 on devices 0-5 (the identical train
program, compiled once). Sync is the colocated placement: one generation server
with all K slots on device 0, one of the learner's own devices, idle while the
learner trains; devices 6 and 7 stay idle. Async: two generation slices of one
device each (6 and 7) with K/2 slots each. One device per generation mesh because
XLA's CPU client does not overlap multi-device programs.

Measured, identically in every mode:
* wall time from the run's first generation request to the end of the last
  step's learner update (metrics ``trained_at_s``), excluding warm-up by
  discarding whole steps: the measured window runs from the end of step
  --warmup to the end of the last step (from the first request if --warmup 0);
* trained samples: rollouts.jsonl rows of those steps with outcome "trained"
  that carried loss (checked against the steps' ``num_samples``);
* samples/s = trained samples / wall, its ratio to sync, mean/max staleness,
  learner idle (waiting for a batch) and generation idle fractions, decode-slot
  occupancy, seconds per trained sample, and the ROLL Flash bound (arXiv
  2510.11345; DESIGN.md "Measuring")
      mean per-sample time <= μ_gen/K + L_gen/Q,  Q = N (sync), (α+1)·N (async),
  with K = total decode slots, N = B·G, μ_gen / L_gen = mean / longest per-sample
  generation time = response tokens x seconds per decode step, the latter
  measured on the sync run (generation alone, nothing competing). The bound covers
  generation only; the learner's seconds per sample are printed next to it, and
  "ideal" = bound + train (sync: one after the other) or max(bound, train) (async:
  complete overlap).

Compilation is kept out of the numbers: the learner step is compiled for every
32-token length bucket before the first mode (the persistent compilation cache,
in <workdir>/xla_cache, makes the runs' own compiles hits), and the warm-up steps
(engine compiles, pipeline fill) are discarded in every mode alike.

What 2 shared CPU cores can show. The fake devices are threads of one XLA CPU
client on the same 2 cores. XLA's CPU client never runs two multi-device
programs at once, so only the single-device generation slices can run while the
6-device learner step runs, and then all three compete for the same 2 cores:
overlap here cannot add compute, it can only fill time in which a core would
otherwise wait (host-side Python between decode steps, reward scoring, weight
hand-over, the learner waiting for the longest sample) and raise decode-slot
occupancy (a jitted decode step costs the same with empty slots). On this tiny
model the 49152-word vocabulary makes the learner step (fwd + bwd over prompt and
response) several times the cost of generation, so the run is learner-bound and
the speed-up is capped near 1 + gen/train; on accelerators with disjoint slices
(and memory-bound decoding) the ratio would be set by the ROLL Flash bound
instead. On a machine shared with other jobs the load average (printed per
mode) moves the absolute numbers; compare modes within one invocation. And when
the cores are oversubscribed, a process with more runnable threads (async: the
learner plus two servers) gets a larger share of them from the OS scheduler: the
"cores" column (CPU seconds / wall seconds of the mode) shows how much each got,
so part of an async speed-up there is taken from the other jobs, not from overlap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

EMBED_DIM0 = 10.0  # C: dominates the residual stream so h0 ~ sqrt(D) at every position


def build_length_model(directory: str, *, eos_prob: float, max_len: int, seed: int) -> dict:
    """Writes the length-controlled tiny model to ``directory``; returns its calibration.

    Args:
      directory: HF output directory (model.safetensors, config.json, tokenizer).
      eos_prob: p, the per-token EOS probability at temperature 1, in (0, 1).
      max_len: positions the model must serve (max prefill + max_new_tokens).
      seed: init seed of the non-edited weights.

    Returns:
      {"p_target", "p_min", "p_max", "delta", "h0_mean"} measured on a forward pass.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import forward, init_params
    from jaxflash.models.formats.weights_gguf import smollm2_gguf_path
    from jaxflash.models.formats.weights_hf import save_hf
    from jaxflash.models.text.tokenizer import Tokenizer

    if not 0.0 < eos_prob < 1.0:
        raise ValueError(f"--eos_prob must be in (0, 1), got {eos_prob}")
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
    config = get_preset("tiny", vocab_size=tokenizer.vocab_size, max_seq_len=max_len)
    params = jax.tree.map(np.array, jax.device_get(init_params(config, seed)))
    V, eos = config.vocab_size, tokenizer.eos_id
    gap = math.log(eos_prob * (V - 1) / (1.0 - eos_prob))  # EOS logit minus the others
    params["final_norm_d"][:] = 0.0
    params["final_norm_d"][0] = 1.0
    params["embed_vd"][:, 0] = EMBED_DIM0
    rng = np.random.default_rng(seed)
    ids_bt = jnp.asarray(rng.integers(0, V, size=(2, max_len)), jnp.int32)
    pos_bt = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), ids_bt.shape)
    delta = gap / math.sqrt(config.d_model)
    for _ in range(2):  # h0 barely depends on δ; two rounds settle it
        params["embed_vd"][eos, 0] = EMBED_DIM0 + delta
        h0 = np.asarray(forward(params, config, ids_bt, pos_bt)[0][..., 0])
        delta = gap / float(h0.mean())
    params["embed_vd"][eos, 0] = EMBED_DIM0 + delta
    h_btd = np.asarray(forward(params, config, ids_bt, pos_bt)[0], np.float64)
    h0 = h_btd[..., 0]
    # The real next-token distribution at every position (tied: logits = h @ embed.T).
    logits_btv = h_btd @ params["embed_vd"].astype(np.float64).T
    logits_btv -= logits_btv.max(axis=-1, keepdims=True)
    p_eos = np.exp(logits_btv[..., eos]) / np.exp(logits_btv).sum(axis=-1)
    save_hf(directory, config, params, tokenizer)
    return {
        "p_target": eos_prob,
        "p_min": float(p_eos.min()),
        "p_max": float(p_eos.max()),
        "delta": delta,
        "h0_mean": float(h0.mean()),
    }


def precompile_train_buckets(exp) -> list[int]:
    """Compiles the learner step for every batch length bucket, into the persistent cache.

    ``pack_batch`` rounds the batch length up to a multiple of 32 tokens, so a run
    meets a new train-step shape (a compile of ~10 s here) whenever a step's longest
    sample crosses a bucket — at random, inside the measured steps. Every mode
    builds the same program (same model config, learner config and learner mesh),
    so compiling each bucket once here makes those compiles persistent-cache hits.

    Returns:
      The bucket lengths compiled.
    """
    import jax
    import numpy as np

    from jaxflash.data.prompts import PromptSource
    from jaxflash.learner.batching import bucket_length, pack_batch
    from jaxflash.learner.state import create_train_state
    from jaxflash.learner.step import make_train_step
    from jaxflash.runtime.fleet.placement import carve
    from jaxflash.runtime.model_setup import load_model, load_tokenizer
    from jaxflash.runtime.workloads.task_setup import build_task
    from jaxflash.sharding.rules import LEARNER_RULES
    from jaxflash.types import FinishReason, Prompt, Sample

    tokenizer = load_tokenizer(exp.model)
    model_config, _ = load_model(exp.model, exp.rollout, tokenizer)
    mesh = carve(exp.mesh).learner
    state = create_train_state(model_config, exp.learner, mesh, LEARNER_RULES, seed=exp.seed)
    train_step = make_train_step(model_config, exp.learner, mesh, LEARNER_RULES)
    n = exp.rollout.prompts_per_step * exp.rollout.group_size
    # The shortest possible batch: the shortest of the first 200 prompts + 1 token.
    train_rows = build_task(exp.data, seed=exp.seed).train
    source = PromptSource(train_rows, tokenizer, max_prompt_tokens=exp.data.max_prompt_tokens)
    shortest = min(len(p.prompt_tokens) for p in source.take(200) if isinstance(p, Prompt))
    buckets = list(range(bucket_length(shortest + 1), model_config.max_seq_len + 1, 32))
    for T in buckets:
        sample = Sample(
            prompt_id=0,
            sample_index=0,
            prompt_tokens=np.ones(T - 1, np.int32),
            response_tokens=np.ones(1, np.int32),
            behaviour_logprobs=np.zeros(1, np.float32),
            token_versions=np.zeros(1, np.int32),
            start_version=0,
            finish_reason=FinishReason.EOS,
        )
        batch = pack_batch(
            [sample] * n,
            np.ones(n, np.float32),
            pad_id=tokenizer.pad_id,
            max_len=model_config.max_seq_len,
            num_sequences=n,
        )
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)
    return buckets


def make_config(args: argparse.Namespace, model_dir: str, alpha: int | None):
    """The experiment ConfigDict of one mode (alpha None = sync: colocated, α = 0)."""
    import ml_collections

    from configs import rlvr_smollm2_arith

    c = rlvr_smollm2_arith.get_config()
    c.seed = args.seed
    c.total_steps = args.steps
    c.model.source, c.model.path = "hf", model_dir
    c.model.remat = False
    c.data.eval_size = 0  # no evaluation: async servers would keep generating through it
    c.eval.every = args.steps
    c.checkpoint.every = args.steps  # one save, after the last measured step
    c.rollout.prompts_per_step = args.prompts
    c.rollout.group_size = args.group
    c.rollout.max_new_tokens = args.max_new_tokens
    c.data.max_prompt_tokens = c.rollout.max_prefill_length = 64  # arithmetic prompts: ~40
    c.rollout.temperature = 1.0  # the calibrated p holds at temperature 1 only
    c.learner.lr = 0.0  # the policy (hence the length distribution) never changes
    c.learner.micro_batch_size = args.prompts * args.group // 2
    # Any cheap registered reward: with lr = 0 its value changes nothing but the logs.
    c.reward.fn = "format_any"
    c.reward.num_workers = 1
    c.mesh.num_cpu_devices = 8
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 3, "tensor": 2})
    c.mesh.generation = ml_collections.ConfigDict({"tensor": 1})
    if alpha is None:
        c.mesh.colocated = True
        c.rollout.num_slots = args.slots
        c.rollout.async_ratio = 0
    else:
        c.mesh.colocated = False
        c.mesh.num_generation_slices = 2
        c.rollout.num_slots = args.slots // 2
        c.rollout.async_ratio = alpha
    return c


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its reaped children (reward workers)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(workdir: str, *, warmup: int) -> dict:
    """Throughput and overlap figures of one finished run, from its jsonl files.

    The same for every mode: whole steps 1..warmup are discarded; wall time runs
    from the end of step ``warmup`` (the first request when 0) to the end of the
    last step's update; trained samples are counted from rollouts.jsonl outcomes.

    Raises:
      RuntimeError: no step after warm-up, or the rows disagree with the metrics.
    """
    import numpy as np

    steps = [m for m in _read_jsonl(os.path.join(workdir, "metrics.jsonl")) if m["step"] > 0]
    measured = [m for m in steps if m["step"] > warmup]
    if not measured:
        raise RuntimeError(f"{workdir}: no steps after warm-up {warmup}; raise --steps")
    if any("skipped" in m for m in measured):
        raise RuntimeError(f"{workdir}: a measured step trained nothing; see its metrics")
    start = 0.0 if warmup == 0 else next(m for m in steps if m["step"] == warmup)["trained_at_s"]
    wall = measured[-1]["trained_at_s"] - start
    last = measured[-1]["step"]
    rows = _read_jsonl(os.path.join(workdir, "rollouts.jsonl"))
    trained = [
        r
        for r in rows
        if warmup < r["learner_step"] <= last and r["outcome"] == "trained" and not r["loss_masked"]
    ]
    n = len(trained)
    if n != sum(m["num_samples"] for m in measured):
        raise RuntimeError(
            f"{workdir}: {n} trained rows but the steps report "
            f"{sum(m['num_samples'] for m in measured)} samples with loss"
        )
    lens = np.array([r["response_len"] for r in trained], float)
    train = sum(m["train_time_s"] for m in measured)
    # A decode step per busy second: with alpha = 0 every sample of a step starts
    # together (N <= K), so the step's decode steps ~ its longest response.
    busy = [m["gen_tokens"] / m["gen_tokens_per_s"] for m in measured if m["gen_tokens_per_s"]]
    s_step = [b / m["response_len_max"] for b, m in zip(busy, measured, strict=False)]
    return {
        "trained_samples": n,
        "wall_s": wall,
        "samples_per_s": n / wall,
        "s_per_sample": wall / n,
        "train_s_per_sample": train / n,
        "len_mean": float(lens.mean()),
        "len_max": float(lens.max()),
        "occupancy": float(np.mean([m["gen_slot_occupancy"] for m in measured])),
        "staleness_mean": float(np.mean([m["staleness_mean"] for m in measured])),
        "staleness_max": int(max(m["staleness_max"] for m in measured)),
        "learner_idle": sum(m["learner_wait_s"] for m in measured) / wall,
        "gen_idle": float(np.mean([m["gen_idle_frac"] for m in measured])),
        "s_per_decode_step": float(np.median(s_step)) if s_step else float("nan"),
        "dropped_stale": int(sum(measured[-1]["prompt_outcomes"].get("stale", {}).values())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="learner steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out (compiles)")
    ap.add_argument("--alphas", default="1,2,4", help="async ratios to compare with sync")
    ap.add_argument("--prompts", type=int, default=4, help="B prompts per learner step")
    ap.add_argument("--group", type=int, default=4, help="G samples per prompt")
    ap.add_argument("--slots", type=int, default=16, help="K decode slots in total (even)")
    ap.add_argument("--max_new_tokens", type=int, default=64, help="M, the length cap")
    ap.add_argument("--eos_prob", type=float, default=1 / 16, help="p, EOS chance per token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="", help="empty = a fresh temporary directory")
    args = ap.parse_args()
    alphas = [int(a) for a in args.alphas.split(",") if a.strip()]
    if args.slots % 2 or args.slots < 2:
        raise SystemExit(f"--slots must be even (two generation slices), got {args.slots}")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="async_vs_sync_")
    if os.path.isdir(workdir) and os.listdir(workdir):
        raise SystemExit(f"--workdir {workdir} is not empty (a run there would resume)")

    import jax

    # Compiles shared by the modes (train-step buckets, the async engines of every α)
    # are stored once and hit afterwards.
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from jaxflash.runtime import loop as rlvr
    from jaxflash.runtime.config.experiment import ExperimentConfig
    from jaxflash.runtime.fleet.placement import carve

    N, K, M, p = args.prompts * args.group, args.slots, args.max_new_tokens, args.eos_prob
    model_dir = os.path.join(workdir, "model")
    cal = build_length_model(model_dir, eos_prob=p, max_len=64 + M, seed=args.seed)
    print(
        f"lengths: geometric(p={p:.4g}) truncated at M={M}: P(len=k)=(1-p)^(k-1) p, k<M; "
        f"E[len]={(1 - (1 - p) ** M) / p:.2f}; calibrated P(EOS) per position "
        f"{cal['p_min']:.4f}..{cal['p_max']:.4f}",
        flush=True,
    )
    t0 = time.monotonic()
    buckets = precompile_train_buckets(
        ExperimentConfig.from_config_dict(make_config(args, model_dir, None))
    )
    print(f"train step precompiled for lengths {buckets} in {time.monotonic() - t0:.0f}s")
    modes = [("sync", None)] + [(f"async a={a}", a) for a in alphas]
    results = {}
    for name, alpha in modes:
        exp = ExperimentConfig.from_config_dict(make_config(args, model_dir, alpha))
        run_dir = os.path.join(workdir, name.replace(" ", "_").replace("=", ""))
        load0, t0, cpu0 = os.getloadavg()[0], time.monotonic(), _cpu_s()
        devices = carve(exp.mesh).describe()
        print(f"=== {name}: {devices}; {run_dir}", flush=True)
        rlvr.run(exp, workdir=run_dir)
        res = summarize(run_dir, warmup=args.warmup)
        res.update(alpha=alpha, run_s=time.monotonic() - t0, load_before=load0, devices=devices)
        res["cpu_s"] = _cpu_s() - cpu0
        res["cores_used"] = res["cpu_s"] / res["run_s"]
        res["load_after"] = os.getloadavg()[0]
        results[name] = res

    base = results["sync"]
    s_step = base["s_per_decode_step"]
    print(
        f"\nN={N} samples/step, K={K} slots, {args.steps - args.warmup} measured steps "
        f"(after {args.warmup} warm-up), seed {args.seed}; sync decode step {s_step * 1e3:.1f} ms"
    )
    for name, r in results.items():
        print(
            f"{name:<11}{r['trained_samples']:>4d} trained samples in {r['wall_s']:.1f}s; "
            f"{r['devices']}"
        )
    head = (
        f"{'mode':<11}{'samples/s':>10}{'x sync':>8}{'stale':>11}{'L idle':>8}{'G idle':>8}"
        f"{'occup':>7}{'len μ/max':>11}{'s/sample':>10}{'bound':>8}{'train':>8}{'ideal':>8}"
        f"{'cores':>6}{'load':>11}"
    )
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        Q = N if r["alpha"] is None else (r["alpha"] + 1) * N
        mu_gen, l_gen = r["len_mean"] * s_step, r["len_max"] * s_step
        r["bound_s_per_sample"] = mu_gen / K + l_gen / Q
        r["ratio_to_sync"] = r["samples_per_s"] / base["samples_per_s"]
        # Sync runs generation then training; async at best overlaps them completely.
        gen_b, train_b = r["bound_s_per_sample"], r["train_s_per_sample"]
        r["ideal_s_per_sample"] = gen_b + train_b if r["alpha"] is None else max(gen_b, train_b)
        print(
            f"{name:<11}{r['samples_per_s']:>10.2f}{r['ratio_to_sync']:>8.2f}"
            f"{r['staleness_mean']:>7.2f}/{r['staleness_max']:<3d}"
            f"{r['learner_idle']:>8.2f}{r['gen_idle']:>8.2f}{r['occupancy']:>7.2f}"
            f"{r['len_mean']:>6.1f}/{r['len_max']:<4.0f}{r['s_per_sample']:>10.3f}"
            f"{r['bound_s_per_sample']:>8.3f}{r['train_s_per_sample']:>8.3f}"
            f"{r['ideal_s_per_sample']:>8.3f}"
            f"{r['cores_used']:>6.2f}{r['load_before']:>5.1f}->{r['load_after']:<4.1f}"
        )
    print(
        "stale = mean/max staleness of trained samples; L/G idle = learner / generation idle "
        "fraction; occup = decode-slot occupancy; s/sample = measured wall seconds per trained "
        "sample; bound = μ_gen/K + L_gen/Q (generation only); train = learner seconds per sample; "
        "ideal = bound + train (sync) or max(bound, train) (async: full overlap); "
        "cores = CPU seconds / wall seconds of the whole mode (this process + reward workers); "
        "load = 1-min load average before->after the mode (2 cores, shared machine)."
    )
    print(f"load average now (1, 5, 15 min): {os.getloadavg()}")
    with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "calibration": cal, "results": results}, f, indent=1)
    print(f"summary: {os.path.join(workdir, 'summary.json')}")


if __name__ == "__main__":
    main()
