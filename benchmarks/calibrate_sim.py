"""Measures our engine and learner on this machine and writes the simulator's cost model.

    python benchmarks/calibrate_sim.py --out benchmarks/sim_costs/cpu_tiny_smollm2.json

What it measures, on exactly the engines, meshes and learner of
``benchmarks/async_vs_sync.py`` (tiny random-init SmolLM2-architecture model
with geometric response lengths; its ``make_config`` builds them), with whatever
generation engine is installed -- re-run it after the engine changes:

* decode: the real ``SlotBatcher`` on the sync mode's server (K = 16 slots, device
  0) and on one async server (K = 8, device 6), fed prompts of the run's dataset
  G at a time; every ``step()`` is timed with its live slots n and the prompts
  and samples it filled. Least squares (dropping steps beyond 3 MADs: other
  jobs share the cores) fits
      t = base + a·n + c·K + p·prompts_prefilled + s·samples_inserted.
* learner: ``learner_batch`` + the jitted ``train_step`` + fetching its metrics,
  as ``rlvr.run`` does, at the padded lengths the run meets (B·G rows x T),
  interleaved; the median at each length is a measured point the simulator
  interpolates between (padding "bucket", on the learner's devices; the time is
  not linear in T here), with a fitted line stored beside it.
* weight sync: ``sync.Publisher.publish`` to the one colocated generation mesh
  (``colocated_s``) and to the two async ones (``per_server_s`` = half of it).
* reward: the reward pool's seconds per item with the run's one worker.
* contention (the 2 CPU cores are shared by every thread): decode steps of one or
  two servers stepping in threads, with and without a learner step running, and
  learner steps with 0, 1, 2 servers busy; the factors are ratios to each alone.

Everything but the fits' inputs is excluded from timing: compiles happen in a
warm-up pass first. The load average before and after is printed and stored.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import async_vs_sync as avs  # noqa: E402  (sets XLA_FLAGS for 8 fake devices)

REPO_ROOT = avs.REPO_ROOT


def _lstsq(
    rows: list[list[float]], y: list[float], *, robust: bool = False
) -> tuple[list[float], float]:
    """Least squares; ``robust`` drops points whose residual exceeds 3 MADs and refits
    (twice): on a shared machine a few steps are slowed by other jobs.

    Returns:
      (coefficients, rms residual of the points kept).
    """
    import numpy as np

    X, Y = np.asarray(rows, float), np.asarray(y, float)
    keep = np.ones(len(Y), bool)
    for _ in range(3 if robust else 1):
        coef, *_ = np.linalg.lstsq(X[keep], Y[keep], rcond=None)
        r = Y - X @ coef
        mad = float(np.median(np.abs(r[keep] - np.median(r[keep]))))
        keep = np.abs(r) <= max(3 * 1.4826 * mad, 1e-4)
    return [float(c) for c in coef], float(np.sqrt(np.mean(r[keep] ** 2)))


def _engine_sections(exp) -> dict:
    """What ``model_setup.make_engine`` reads of an experiment."""
    return {"rollout": exp.rollout, "env": exp.env, "lora": exp.learner.lora}


class Setup:
    """The run's model, tokenizer, prompts, learner and engines, built once."""

    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        import jax

        from jaxflash.data.prompts import PromptSource
        from jaxflash.learner.state import create_train_state, state_shardings
        from jaxflash.learner.step import make_train_step
        from jaxflash.runtime.config.experiment import ExperimentConfig
        from jaxflash.runtime.fleet.placement import carve
        from jaxflash.runtime.model_setup import load_model, load_tokenizer, make_engine
        from jaxflash.runtime.workloads.task_setup import build_task
        from jaxflash.sharding.rules import LEARNER_RULES
        from jaxflash.types import Prompt

        self.sync_exp = ExperimentConfig.from_config_dict(avs.make_config(args, model_dir, None))
        self.async_exp = ExperimentConfig.from_config_dict(avs.make_config(args, model_dir, 1))
        self.tokenizer = load_tokenizer(self.sync_exp.model)
        self.model_config, self.params = load_model(
            self.sync_exp.model, self.sync_exp.rollout, self.tokenizer
        )
        rows = build_task(self.sync_exp.data, seed=self.sync_exp.seed).train
        source = PromptSource(
            rows, self.tokenizer, max_prompt_tokens=self.sync_exp.data.max_prompt_tokens
        )
        self.prompts = [p for p in source.take(400) if isinstance(p, Prompt)]
        self.sync_place, self.async_place = carve(self.sync_exp.mesh), carve(self.async_exp.mesh)
        self.sync_engine = make_engine(
            self.model_config, self.sync_place.generation[0], self.tokenizer,
            **_engine_sections(self.sync_exp),
        )  # fmt: skip
        self.async_engines = [
            make_engine(self.model_config, m, self.tokenizer, **_engine_sections(self.async_exp))
            for m in self.async_place.generation
        ]
        mesh = self.sync_place.learner
        self.state = create_train_state(
            self.model_config, self.sync_exp.learner, mesh, LEARNER_RULES, seed=args.seed
        )
        self.train_step = make_train_step(
            self.model_config, self.sync_exp.learner, mesh, LEARNER_RULES
        )
        self.step_sharding = state_shardings(
            self.model_config, self.sync_exp.learner, mesh, LEARNER_RULES
        ).step
        self.jax = jax
        self.G, self.B = args.group, args.prompts

    # -- decode ---------------------------------------------------------------------

    def batcher(self, engine):
        from jaxflash.generation.slot_loop import SlotBatcher

        return SlotBatcher(engine, self.params, policy_version=0, stop_ids=self.tokenizer.stop_ids)

    def requests(self, first: int, n_prompts: int):
        from jaxflash.types import GenerationRequest

        sampling = self.sync_exp.rollout.sampling
        out = []
        for k in range(n_prompts):
            p = self.prompts[(first + k) % len(self.prompts)]
            for i in range(self.G):
                out.append(
                    GenerationRequest(
                        prompt_id=first + k,
                        sample_index=i,
                        prompt_tokens=p.prompt_tokens,
                        sampling=sampling,
                        seed=7,
                    )
                )
        return out

    def decode_points(
        self, engine, slots: int, rounds: int, first: int
    ) -> list[tuple[int, int, int, int, float]]:
        """(live slots, prompts prefilled, samples inserted, K, seconds) per timed step."""
        points = []
        for r in range(rounds):
            b = self.batcher(engine)
            # Alternate a full queue (2K samples) and a short one, so n spans 1..K.
            n_prompts = max(1, (2 * slots if r % 2 == 0 else slots // 2) // self.G)
            for req in self.requests(first + r * 100, n_prompts):
                b.add(req)
            while not b.idle:
                prefills, fills, live = (
                    b.stats.prefills,
                    b.stats.fills,
                    b.stats.live_slot_steps,
                )
                t0 = time.perf_counter()
                b.step()
                dt = time.perf_counter() - t0
                live = b.stats.live_slot_steps - live  # slots live in this step's decode
                points.append((live, b.stats.prefills - prefills, b.stats.fills - fills, slots, dt))
        return points

    # -- learner --------------------------------------------------------------------

    def groups(self, length: int, first: int):
        import numpy as np

        from jaxflash.replay.groups import Group
        from jaxflash.types import FinishReason, Sample

        out = []
        for k in range(self.B):
            p = self.prompts[(first + k) % len(self.prompts)]
            resp = max(1, length - len(p.prompt_tokens))
            samples = tuple(
                Sample(
                    prompt_id=first + k,
                    sample_index=i,
                    prompt_tokens=np.asarray(p.prompt_tokens, np.int32),
                    response_tokens=np.full(resp, 5, np.int32),
                    behaviour_logprobs=np.full(resp, -1.0, np.float32),
                    token_versions=np.zeros(resp, np.int32),
                    start_version=0,
                    finish_reason=FinishReason.EOS,
                    reward=float(i % 2),
                )
                for i in range(self.G)
            )
            out.append(Group(prompt_id=first + k, start_version=0, samples=samples))
        return out

    def learner_step(self, length: int) -> tuple[float, int]:
        """(seconds, rows x T) of one step as ``rlvr.run`` runs it."""
        from jaxflash.algorithms.advantages import get_advantage_estimator
        from jaxflash.runtime.rollout.scoring import TruncationPolicy
        from jaxflash.runtime.workloads.learner_batch import learner_batch

        groups = self.groups(length, first=length)
        t0 = time.perf_counter()
        lb = learner_batch(
            groups,
            get_advantage_estimator(self.sync_exp.advantage),
            TruncationPolicy(),
            pad_id=self.tokenizer.pad_id,
            max_len=self.model_config.max_seq_len,
            num_sequences=self.B * self.G,
        )
        self.state, metrics = self.train_step(self.state, lb.batch)
        self.jax.device_get(metrics)
        dt = time.perf_counter() - t0
        return dt, int(lb.batch.input_ids_bt.shape[0] * lb.batch.input_ids_bt.shape[1])

    def sync_seconds(self, engines) -> float:
        from jaxflash.sync.publish import Publisher

        t0 = time.perf_counter()
        out = [Publisher().publish(self.state.params, sh, 1).params for _, sh in engines]
        self.jax.block_until_ready(out)
        return time.perf_counter() - t0


def _stepper(setup: Setup, engine, stop: threading.Event, out: list, busy: threading.Event) -> None:
    """Keeps one batcher full and times each step, tagging whether the learner ran."""
    b = setup.batcher(engine)
    first = 10_000 + 1000 * len(out)
    while not stop.is_set():
        if b.num_queued < engine.max_concurrent_decodes:
            for req in setup.requests(first, 2):
                b.add(req)
            first += 2
        t0 = time.perf_counter()
        learner_before = busy.is_set()
        b.step()
        out.append((time.perf_counter() - t0, learner_before and busy.is_set()))


def contention(setup: Setup, steps: int, seconds: float) -> dict:
    """Time factors of decode steps and learner steps when they share the cores."""
    import statistics

    engines = [e for e, _ in setup.async_engines]
    length = 128

    def run(n_gen: int, learner_steps: int) -> tuple[list[float], list[float], list[float]]:
        stop, busy = threading.Event(), threading.Event()
        logs: list[list] = [[] for _ in range(n_gen)]
        threads = [
            threading.Thread(target=_stepper, args=(setup, engines[i], stop, logs[i], busy))
            for i in range(n_gen)
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the steppers settle
        learner = []
        if learner_steps:
            for _ in range(learner_steps):
                busy.set()
                learner.append(setup.learner_step(length)[0])
                busy.clear()
        else:
            time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        alone = [d for log in logs for d, b in log[2:] if not b]
        during = [d for log in logs for d, b in log[2:] if b]
        return alone, during, learner

    med = statistics.median
    one, _, _ = run(1, 0)
    two, _, _ = run(2, 0)
    _, one_l, learn1 = run(1, steps)
    _, two_l, learn2 = run(2, steps)
    learn0 = [setup.learner_step(length)[0] for _ in range(steps)]
    base = med(one)
    table = {
        "gen": [
            [2, 0, max(1.0, med(two) / base)],
            [1, 1, max(1.0, med(one_l) / base)],
            [2, 1, max(1.0, med(two_l) / base)],
        ],
        "train": [
            [1, max(1.0, med(learn1) / med(learn0))],
            [2, max(1.0, med(learn2) / med(learn0))],
        ],
    }
    raw = {
        "decode_alone_s": base,
        "decode_two_s": med(two),
        "decode_one_with_learner_s": med(one_l),
        "decode_two_with_learner_s": med(two_l),
        "learner_alone_s": med(learn0),
        "learner_with_one_s": med(learn1),
        "learner_with_two_s": med(learn2),
    }
    return {"table": table, "raw": raw}


def calibrate(
    args: argparse.Namespace,
    model_dir: str,
    setup: Setup | None = None,
    *,
    contention_table: dict | None = None,
    quick: bool = False,
) -> tuple[dict, Setup]:
    """Measures everything; returns (cost model dict, the setup for reuse).

    Args:
      contention_table: reuse these contention factors instead of measuring them.
      quick: fewer decode rounds, the two padded lengths the run meets (96, 128).
    """
    import numpy as np

    from jaxflash.runtime.model_setup import make_reward
    from jaxflash.runtime.rollout.reward_pool import RewardPool

    load0 = os.getloadavg()
    fresh = setup is None
    setup = setup or Setup(args, model_dir)
    t_start = time.monotonic()
    lengths = [96, 128] if quick else [64, 96, 128]
    if fresh:  # compile every decode / prefill / train shape first
        setup.decode_points(setup.sync_engine[0], 16, 1, first=0)
        setup.decode_points(setup.async_engines[0][0], 8, 1, first=0)
        for T in (64, 96, 128):
            setup.learner_step(T)
        setup.sync_seconds([setup.sync_engine])
        setup.sync_seconds(setup.async_engines)

    rounds = max(2, args.rounds // 2) if quick else args.rounds
    points = setup.decode_points(setup.sync_engine[0], 16, rounds, first=1000)
    points += setup.decode_points(setup.async_engines[0][0], 8, rounds, first=2000)
    X = [[1.0, n, k, p, s] for n, p, s, k, _ in points]
    (base, per_live, per_slot, per_prompt, per_sample), rms = _lstsq(
        X, [t for *_, t in points], robust=True
    )

    # Learner: lengths interleaved; the median of each is a measured point.
    learner = [(T, *setup.learner_step(T)) for _ in range(args.learner_reps) for T in lengths]
    med = {T: float(np.median([dt for t, dt, _ in learner if t == T])) for T in lengths}
    toks = {T: tok for T, _, tok in learner}
    (step_s, per_token), _ = _lstsq([[1.0, toks[T]] for T in lengths], [med[T] for T in lengths])
    reps = 3 if quick else 5
    sync1 = float(np.median([setup.sync_seconds([setup.sync_engine]) for _ in range(reps)]))
    sync2 = float(np.median([setup.sync_seconds(setup.async_engines) for _ in range(reps)]))

    with RewardPool(make_reward(setup.sync_exp.reward), num_workers=1, timeout_s=30.0) as pool:
        pool.submit(("x", "1", "warm")).result()
        t0 = time.perf_counter()
        futures = [
            pool.submit((f"answer {i}", "1", f"prompt 0 sample {i}"))
            for i in range(args.reward_items)
        ]
        for f in futures:
            f.result()
        reward_s = (time.perf_counter() - t0) / args.reward_items

    cont = (
        {"table": contention_table, "raw": "reused"}
        if contention_table
        else contention(setup, args.contention_steps, seconds=4.0)
    )
    load1 = os.getloadavg()
    commit = subprocess.run(
        ["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    costs = {
        "name": "tiny SmolLM2-architecture model (benchmarks/async_vs_sync.py), this CPU",
        "server_devices": 1,
        "decode": {
            "base_s": max(base, 1e-6),
            "per_active_slot_s": max(per_live, 0.0),
            "per_slot_s": max(per_slot, 0.0),
        },
        "prefill": {
            "per_prompt_s": max(per_prompt, 0.0),
            "per_prompt_token_s": 0.0,
            "per_sample_s": max(per_sample, 0.0),
        },
        "learner": {
            "step_s": max(step_s, 0.0),
            "per_token_s": max(per_token, 0.0),
            "padding": "bucket",
            "bucket": 32,
            "reference_devices": 6,
            "points": [[toks[T], med[T]] for T in lengths],
        },
        "sync": {
            "weight_sync_s": 0.0,
            "per_server_s": sync2 / 2,
            "colocated_s": sync1,
            "stalls_generation": False,
        },
        "reward": {"latency_s": reward_s, "workers": 1},
        "contention": cont["table"],
        "meta": {
            "measured": datetime.datetime.now().isoformat(timespec="seconds"),
            "engine": f"jaxflash {commit} (generation engine as installed)",
            "load_before": load0,
            "load_after": load1,
            "seconds": time.monotonic() - t_start,
            "decode_points": len(points),
            "decode_fit_rms_s": rms,
            "learner_points": [[T, dt, tok] for T, dt, tok in learner],
            "learner_median_s": {str(T): med[T] for T in lengths},
            "sync_colocated_s": sync1,
            "sync_disjoint_two_s": sync2,
            "contention_raw": cont["raw"],
            "prompt_tokens": [len(p.prompt_tokens) for p in setup.prompts[:200]],
        },
    }
    return costs, setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "sim_costs", "cpu_tiny_smollm2.json"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--eos_prob", type=float, default=1 / 16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4, help="decode rounds per engine")
    ap.add_argument("--learner_reps", type=int, default=3)
    ap.add_argument("--reward_items", type=int, default=32)
    ap.add_argument("--contention_steps", type=int, default=3)
    args = ap.parse_args()

    import tempfile

    from jaxflash.runtime.simulate import CostModel

    workdir = tempfile.mkdtemp(prefix="calibrate_sim_")
    model_dir = os.path.join(workdir, "model")
    avs.build_length_model(
        model_dir, eos_prob=args.eos_prob, max_len=64 + args.max_new_tokens, seed=args.seed
    )
    print(f"load average before: {os.getloadavg()}", flush=True)
    costs, _ = calibrate(args, model_dir)
    CostModel.from_dict(costs).save(args.out)
    print(json_summary(costs))
    print(f"load average after: {os.getloadavg()}; wrote {args.out}")


def json_summary(costs: dict) -> str:
    d, p, lr, s, r = (
        costs["decode"],
        costs["prefill"],
        costs["learner"],
        costs["sync"],
        costs["reward"],
    )
    ms = 1e3
    rms = costs["meta"]["decode_fit_rms_s"] * ms
    return (
        f"decode step = {d['base_s'] * ms:.2f} ms + {d['per_active_slot_s'] * ms:.3f} ms/live "
        f"slot + {d['per_slot_s'] * ms:.3f} ms/slot (rms {rms:.2f} ms); fill = "
        f"{p['per_prompt_s'] * ms:.2f} ms/prompt + {p['per_sample_s'] * ms:.2f} ms/sample\n"
        f"learner step (rows x bucket tokens: s) = {lr['points']}; weight sync "
        f"{s['per_server_s'] * ms:.1f} ms/server (colocated {s['colocated_s'] * ms:.1f} ms); "
        f"reward {r['latency_s'] * ms:.1f} ms/sample\n"
        f"contention: gen {costs['contention']['gen']} train {costs['contention']['train']}"
    )


if __name__ == "__main__":
    main()
