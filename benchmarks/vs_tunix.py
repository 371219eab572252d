"""jaxflash vs google-tunix per chip: generation and learner throughput, side by side.

    python benchmarks/vs_tunix.py                       # default cases, ~10-14 min on 2 cores
    python benchmarks/vs_tunix.py --cases gen8,gen32 --rounds 3
    python benchmarks/vs_tunix.py --cases all           # + real weights, 512 new tokens

Workload (issue 8): a SmolLM2-135M-shaped Llama (30 layers, d 576, 9 query / 3 KV
heads, head 64, MLP 1536, vocab 49,152, tied embeddings), random fp32 weights, one
CPU device. Generation: B prompts of 40 random tokens, 64 new tokens each,
temperature 1 (no top-k/top-p on either side), KV cache of 40 + 64 = 104 rows on
both sides, an EOS that is never sampled (every row decodes all 64 steps), tokens
and their logprobs returned; tok/s = B * 64 / wall time of the whole call (prefill,
decode, host work). Learner: one update on 16 sequences x 128 tokens (40 prompt +
88 response), AdamW after global-norm clipping at 1.0, PPO/GRPO clipped loss, no
KL, one micro-batch, no remat on either side; tok/s = 16 * 128 / step time.

tunix (google-tunix, default 0.1.7) runs in its own venv, created by this script
under ``~/.cache/jaxflash/bench/`` with jax/jaxlib/flax/optax pinned to the versions
of the running interpreter. Every measurement is its own process (one compile,
then ``--reps`` timed calls); the two systems alternate within each round and the
order flips between rounds, so machine noise hits both alike. The fp32 matmul peak
is measured in the same run (before and after), and the load average is printed
next to every figure: compare ratios, not absolute numbers, on a shared machine.

Cases: gen8, gen32 (generation B=8/32), learn (learner; tunix runs its GRPO
learner's loss), learn_lean (the same, tunix with a bare PPO-clip loss), learn_grpo
(the learn batch as 4 prompts x 4 samples sharing each prompt: jaxflash trains it with
``learner.prefix_sharing``, one copy of each prompt; equal samples, fewer FLOPs for
jaxflash, so no MFU line), long8 (B=8,
512 new tokens, cache 552 rows), real32 (ours only: SmolLM2-135M-Instruct's real GGUF
weights, 32 chat-templated arithmetic prompts of up to 64 tokens, 64 new tokens,
stopping at EOS, so tok/s counts the tokens really generated — tunix has no GGUF
loader, so there is no tunix figure for it).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import subprocess
import sys
import time

OURS = os.path.abspath(__file__)
HERE = os.path.dirname(OURS)
ROOT = os.path.dirname(HERE)
SHAPE = dict(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, vocab=49152)
CASES = {
    "gen8": dict(kind="generation", batch=8, prompt_len=40, new_tokens=64, reps=2),
    "gen32": dict(kind="generation", batch=32, prompt_len=40, new_tokens=64, reps=2),
    "learn": dict(kind="learner", batch=16, prompt_len=40, seq_len=128, reps=2),
    # tunix's model with a bare PPO-clip loss instead of its GRPO learner's loss
    # (no diagnostics, no entropy): the leanest tunix update we could write.
    "learn_lean": dict(
        kind="learner", batch=16, prompt_len=40, seq_len=128, reps=2, variant="lean"
    ),
    # The learn batch as GRPO makes it: 4 prompts x G = 4 samples, each group's rows
    # sharing their 40 prompt tokens. Equal work (the same 16 samples trained); jaxflash
    # lays each prompt out once (learner.prefix_sharing), tunix trains all 16 rows.
    "learn_grpo": dict(kind="learner", batch=16, prompt_len=40, seq_len=128, reps=2, group=4),
    "long8": dict(kind="generation", batch=8, prompt_len=40, new_tokens=512, reps=1),
    "real32": dict(kind="generation", batch=32, prompt_len=40, new_tokens=64, reps=2, real=True),
    # Accelerator-sized cases (benchmarks/gpu_check.sh); too slow for 2 CPU cores.
    "gen128": dict(kind="generation", batch=128, prompt_len=40, new_tokens=64, reps=2),
    "learn_big": dict(kind="learner", batch=64, prompt_len=40, seq_len=512, reps=3),
}
DEFAULT_CASES = "gen8,gen32,learn,learn_grpo"
ALL_CASES = "gen8,gen32,learn,learn_grpo,long8,real32"
# Settings that differ between the two sides and cannot be matched, printed with the table.
NOT_MATCHED = [
    "tunix left-pads prompts and attends over all cache rows every step; jaxflash keeps "
    "per-row positions (all prompts here have 40 tokens, so neither pads)",
    "sampling keys: tunix folds one seed with the step, jaxflash keys every token by "
    "(seed, prompt, sample, token index): same distribution, different draws",
    "learner loss: tunix's grpo_loss_fn over full-vocabulary logits; jaxflash's PPO clip "
    "(DAPO bounds 0.2/0.28) over chunked log-softmax of the same distribution",
    "real32 has no tunix figure (tunix cannot load the GGUF weights)",
]


# ------------------------------------------------------------------ workers (ours)


def _peak_worker(w: dict) -> dict:
    """Best GFLOP/s of an n^3 matmul in the compute dtype (jax, one device): 2048^3
    fp32 on CPU, 8192^3 in the compute dtype on an accelerator."""
    import jax
    import jax.numpy as jnp

    platform = w.get("platform", "cpu")
    n = 2048 if platform == "cpu" else 8192
    dtype = jnp.float32 if platform == "cpu" else jnp.dtype(w["compute_dtype"])
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    mm = jax.jit(jnp.dot)
    mm(a, b).block_until_ready()
    best = best_cpu = 0.0
    for _ in range(8):
        t0, c0 = time.perf_counter(), time.process_time()
        mm(a, b).block_until_ready()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
        best_cpu = max(best_cpu, 2 * n**3 / (time.process_time() - c0) / 1e9)
    return {"runs": [best], "cpu_runs": [best_cpu]}


def _our_model(w: dict):
    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import init_params

    config = get_preset(
        "smollm2_135m",
        max_seq_len=2048,
        remat=bool(w.get("remat")),
        compute_dtype=w.get("compute_dtype", "float32"),
    )
    return config, init_params(config, seed=0)


def _our_generation(w: dict) -> dict:
    import numpy as np

    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.generation.slot_loop import run_requests
    from jaxflash.types import GenerationRequest, SamplingParams

    stop_ids: set[int] = set()  # random weights: every sample runs to new_tokens
    if w.get("real"):
        from jaxflash.data.arithmetic import ArithmeticTask
        from jaxflash.data.prompts import PromptFailure, PromptSource
        from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
        from jaxflash.models.text.tokenizer import Tokenizer

        path = smollm2_gguf_path()
        config, params = load_gguf(path)
        config = config.replace(compute_dtype=w.get("compute_dtype", "float32"))
        tokenizer = Tokenizer.from_gguf(path)
        # Chat-templated arithmetic prompts are 30-45 tokens: allow up to 64.
        rows = ArithmeticTask(0, split="eval").rows(0, 2 * w["batch"])
        prompts = [
            p.prompt_tokens
            for p in PromptSource(rows, tokenizer, max_prompt_tokens=64)
            if not isinstance(p, PromptFailure)
        ][: w["batch"]]
        if len(prompts) < w["batch"]:
            raise RuntimeError(f"real weights: only {len(prompts)} usable prompts")
        w = {**w, "prompt_len": max(len(p) for p in prompts)}
        stop_ids = set(tokenizer.stop_ids)  # eos and end-of-turn, as the RL loop stops
    else:
        config, params = _our_model(w)
        rng = np.random.default_rng(w["seed"])
        prompts = list(rng.integers(1, config.vocab_size, (w["batch"], w["prompt_len"])))
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=w["batch"],
            max_prefill_length=w["prompt_len"],
            max_target_length=w["prompt_len"] + w["new_tokens"],
        ),
    )
    params = engine.place_params(params)

    def call(seed: int) -> int:
        reqs = [
            GenerationRequest(
                prompt_id=i,
                sample_index=0,
                prompt_tokens=np.asarray(p, np.int32),
                sampling=SamplingParams(max_new_tokens=w["new_tokens"]),
                seed=seed,
            )
            for i, p in enumerate(prompts)
        ]
        samples = run_requests(engine, params, reqs, policy_version=0, stop_ids=stop_ids)
        return sum(len(s.response_tokens) for s in samples)

    t0 = time.perf_counter()
    call(0)
    compile_s = time.perf_counter() - t0
    runs, cpu_runs, tokens = [], [], 0
    for rep in range(w["reps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = call(rep + 1)
        runs.append(tokens / (time.perf_counter() - t0))
        cpu_runs.append(tokens / (time.process_time() - c0))
    return {
        "compile_s": compile_s,
        "runs": runs,
        "cpu_runs": cpu_runs,
        "tokens": tokens,
        "cache_rows": engine.max_target_length,
    }


def _our_learner(w: dict) -> dict:
    import jax
    import numpy as np

    from jaxflash.learner.config import LearnerConfig
    from jaxflash.learner.state import create_train_state
    from jaxflash.learner.step import make_train_step
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import LEARNER_RULES
    from jaxflash.types import TrainBatch

    config, _ = _our_model(w)
    b, T, p = w["batch"], w["seq_len"], w["prompt_len"]
    g = w.get("group", 0)  # > 0: rows in groups of g sharing their prompt
    shared = dict(packing=True, prefix_sharing=True, pack_length=0, length_multiple=8)
    lc = LearnerConfig(
        lr=1e-6,
        micro_batch_size=b // g if g else b,  # packed rows: one per group
        loss="ppo",
        loss_kwargs={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        logprob_chunk=config.logits_chunk,
        **(shared if g else {}),
    )
    mesh = make_mesh(jax.devices()[:1], {})
    state = create_train_state(config, lc, mesh, LEARNER_RULES, seed=0)
    step = make_train_step(config, lc, mesh, LEARNER_RULES)
    rng = np.random.default_rng(w["seed"])
    ids = rng.integers(1, config.vocab_size, (b, T + 1)).astype(np.int32)
    if g:  # the G samples of a prompt: the same first p tokens
        ids[:, :p] = np.repeat(ids[::g, :p], g, axis=0)
    mask = np.zeros((b, T), np.float32)
    mask[:, p - 1 :] = 1.0
    batch = TrainBatch(
        input_ids_bt=ids[:, :T],
        positions_bt=np.broadcast_to(np.arange(T, dtype=np.int32), (b, T)).copy(),
        target_ids_bt=ids[:, 1:],
        loss_mask_bt=mask,
        advantages_bt=np.repeat(rng.standard_normal((b, 1)), T, 1).astype(np.float32) * mask,
        behaviour_logp_bt=np.full((b, T), -10.8, np.float32) * mask,
        token_versions_bt=np.where(mask > 0, 0, -1).astype(np.int32),
    )

    def call():
        nonlocal state
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)

    t0 = time.perf_counter()
    call()
    compile_s = time.perf_counter() - t0
    runs, cpu_runs = [], []
    for _ in range(w["reps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        call()
        runs.append(b * T / (time.perf_counter() - t0))
        cpu_runs.append(b * T / (time.process_time() - c0))
    return {"compile_s": compile_s, "runs": runs, "cpu_runs": cpu_runs, "tokens": b * T}


def _worker(work: dict) -> None:
    sys.path.insert(0, ROOT)
    fn = {"peak": _peak_worker, "generation": _our_generation, "learner": _our_learner}
    print("RESULT " + json.dumps(fn[work["kind"]](work)), flush=True)


# ------------------------------------------------------------------------ driver


def ensure_tunix(venv: str, version: str) -> str:
    """Path of the tunix venv's python, creating the venv on first use."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python):
        return python
    pins = [f"{p}=={md.version(p)}" for p in ("jax", "jaxlib", "flax", "optax")]
    print(f"creating tunix venv at {venv} (google-tunix=={version}, {' '.join(pins)}) ...")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run(
        [python, "-m", "pip", "install", "-q", f"google-tunix=={version}", *pins], check=True
    )
    print(f"  done in {time.perf_counter() - t0:.0f} s")
    return python


def run_worker(python: str, script: str, work: dict, timeout_s: float) -> dict:
    """Run one measurement in a fresh process; returns its RESULT dict (+ load, wall)."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    platform = "cpu" if work["platform"] == "cpu" else "cuda"
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [python, script, json.dumps(work)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        # One device: no fake CPU devices, and no inherited XLA flags.
        env={**os.environ, "PYTHONPATH": path, "XLA_FLAGS": "", "JAX_PLATFORMS": platform},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"worker {work} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    out = json.loads(lines[-1][len("RESULT ") :])
    out.update(load=load, wall_s=time.perf_counter() - t0)
    return out


def _learner_flop_per_token(seq_len: int) -> float:
    """Model FLOP per trained token, forward + backward (6 per weight, tied LM head
    included, plus the causal attention products)."""
    c = SHAPE
    qkvo = c["d_model"] * (2 * c["n_heads"] + 2 * c["n_kv_heads"]) * c["head_dim"]
    layer = qkvo + 3 * c["d_model"] * c["d_ff"]
    attn = 2 * seq_len * c["n_heads"] * c["head_dim"]  # QK^T + PV, causal average
    return 6 * c["n_layers"] * (layer + attn) + 6 * c["d_model"] * c["vocab"]


def _fmt_runs(runs: list[float]) -> str:
    return ", ".join(f"{r:.1f}" for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma list or 'all' ({ALL_CASES})")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per case")
    ap.add_argument("--tunix_version", default="0.1.7")
    ap.add_argument(
        "--tunix_venv", default=os.path.expanduser("~/.cache/jaxflash/bench/tunix-0.1.7")
    )
    ap.add_argument("--no_tunix", action="store_true", help="measure jaxflash only")
    ap.add_argument("--timeout_s", type=float, default=1200.0, help="per worker process")
    ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument(
        "--compute_dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="jaxflash matmul dtype (fp32 master weights); tunix always runs fp32",
    )
    args = ap.parse_args()
    if args.compute_dtype != "float32" and not args.no_tunix:
        ap.error("--compute_dtype bfloat16 compares nothing with tunix: add --no_tunix")
    common = {"platform": args.platform, "compute_dtype": args.compute_dtype}
    names = (ALL_CASES if args.cases == "all" else args.cases).split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    tunix_py = None if args.no_tunix else ensure_tunix(args.tunix_venv, args.tunix_version)
    tunix_script = os.path.join(HERE, "tunix_worker.py")
    start = time.perf_counter()
    print(f"load average at start: {os.getloadavg()}")
    peak_work = {"kind": "peak", **common}
    peaks = [run_worker(sys.executable, OURS, peak_work, args.timeout_s)]
    print(f"matmul peak: {peaks[0]['runs'][0]:.0f} GFLOP/s (load {peaks[0]['load']:.2f})")

    results: dict[str, dict[str, list[dict]]] = {n: {"jaxflash": [], "tunix": []} for n in names}
    for rnd in range(args.rounds):
        for name in names:
            work = {**SHAPE, **CASES[name], **common, "seed": 0}
            sides = ["jaxflash", "tunix"] if rnd % 2 == 0 else ["tunix", "jaxflash"]
            for side in sides:
                if side == "tunix" and (tunix_py is None or work.get("real")):
                    continue
                py, script = (
                    (sys.executable, OURS) if side == "jaxflash" else (tunix_py, tunix_script)
                )
                r = run_worker(py, script, work, args.timeout_s)
                results[name][side].append(r)
                print(
                    f"round {rnd} {name:6} {side:8}: tok/s [{_fmt_runs(r['runs'])}], tok/CPU-s "
                    f"[{_fmt_runs(r['cpu_runs'])}], compile {r['compile_s']:.1f} s, process "
                    f"{r['wall_s']:.0f} s, load {r['load']:.2f}",
                    flush=True,
                )
    peaks.append(run_worker(sys.executable, OURS, peak_work, args.timeout_s))

    peak = max(p["runs"][0] for p in peaks)
    peak_cpu = max(p["cpu_runs"][0] for p in peaks)
    peak_list = ", ".join(f"{p['runs'][0]:.0f}" for p in peaks)
    kind = "fp32" if args.platform == "cpu" else args.compute_dtype
    print(
        f"{kind} matmul peak (this run): {peak_list} GFLOP/s wall (before, after); "
        f"{peak_cpu:.0f} GFLOP per CPU-second; load average now {os.getloadavg()}"
    )
    print(
        "tok/s per wall second (best, all runs) and per CPU second of the process (best):\n"
        "the CPU-second figure is what a process gets done per core it actually held, so it\n"
        "is the steadier comparison when other jobs share the cores (load in the table)."
    )
    print(
        "| case | tunix tok/s | jaxflash tok/s | ratio | tunix tok/CPU-s | jaxflash tok/CPU-s "
        "| ratio (CPU) | loads (ours; tunix) | compile s (ours / tunix) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def best(rs: list[dict], key: str) -> float:
        return max(x for r in rs for x in r[key])

    for name in names:
        ours, theirs = results[name]["jaxflash"], results[name]["tunix"]
        o, oc = best(ours, "runs"), best(ours, "cpu_runs")
        cells = [name]
        if theirs:
            t, tc = best(theirs, "runs"), best(theirs, "cpu_runs")
            t_all = _fmt_runs([x for r in theirs for x in r["runs"]])
            cells.append(f"{t:.1f} ({t_all})")
        else:
            t = tc = None
            cells.append("n/a")
        o_all = _fmt_runs([x for r in ours for x in r["runs"]])
        cells.append(f"{o:.1f} ({o_all})")
        cells.append(f"{o / t:.2f}" if t else "n/a")
        cells.append(f"{tc:.1f}" if tc else "n/a")
        cells.append(f"{oc:.1f}")
        cells.append(f"{oc / tc:.2f}" if tc else "n/a")
        loads = " ".join(f"{r['load']:.1f}" for r in ours)
        loads += "; " + " ".join(f"{r['load']:.1f}" for r in theirs) if theirs else ""
        cells.append(loads)
        comp = f"{min(r['compile_s'] for r in ours):.0f}"
        comp += f" / {min(r['compile_s'] for r in theirs):.0f}" if theirs else ""
        cells.append(comp)
        print("| " + " | ".join(cells) + " |")
        if CASES[name]["kind"] == "learner" and not CASES[name].get("group"):
            flop = _learner_flop_per_token(CASES[name]["seq_len"])
            for side, rate, cpu_rate in [("jaxflash", o, oc)] + ([("tunix", t, tc)] if t else []):
                print(
                    f"  {name} {side}: {flop / 1e9:.2f} GFLOP/token -> {rate * flop / 1e9:.0f} "
                    f"GFLOP/s = {100 * rate * flop / 1e9 / peak:.0f} % of the wall peak; "
                    f"{cpu_rate * flop / 1e9:.0f} GFLOP/CPU-s = "
                    f"{100 * cpu_rate * flop / 1e9 / peak_cpu:.0f} % of the CPU-second peak"
                )
    print("Not matched between the sides:")
    for line in NOT_MATCHED:
        print(f"  - {line}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        _worker(json.loads(sys.argv[1]))
    else:
        main()
