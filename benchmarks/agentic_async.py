"""Environment-level async and redundant environments vs a synchronous batch rollout.

    python benchmarks/agentic_async.py            # ~1 min on 2 CPU cores
    python benchmarks/agentic_async.py --quick    # seconds
    python benchmarks/agentic_async.py --real     # wall time, threads, ~3-4 min
    python benchmarks/agentic_async.py --env scienceworld   # real simulator steps, wall time

The real ``RolloutScheduler`` and environment manager (``runtime.rollout.episode_dispatch``)
play real FrozenLake maps (4x4, up to ``--turns`` turns), each step wrapped in
``envs.latency.LatencyEnv``: a latency drawn from N(μ, σ) truncated at 0. Time is
virtual (``runtime.simulate.episodes``): the environment's latency and a simulated
generation server (``--slots`` slots, ``--decode-ms`` per token, a scripted policy
answering ``<answer>Move</answer>``: ~10 tokens a turn) cost virtual seconds, so
the numbers are exact and repeatable; the scheduler, the episodes, the tokens and
the environments are the real ones. μ = ``--mu`` s is comparable to a turn's
generation time (``--decode-ms`` x ~10 tokens).

Modes (same maps, same seeds, same number of trained episodes, α = 0):
(a) sync: a batch barrier -- every turn waits for the whole batch's generation,
then for the whole batch's environment steps (the baseline of ROLL Flash, arXiv
2510.11345); (b) env-async: every episode is its own loop; (c) env-async +
redundancy: ``group_size + r`` episodes per group, the first ``group_size`` kept.
At α = 0 a step still waits for its slowest kept episode; the last two columns
repeat (b) and (c) with α = 1 (the next step's groups start while this step's
stragglers finish; staleness <= 1), as ROLL Flash combines them. The learner is
instant (``run_steps(train_s=0)``): these are rollout rates, over the steps after
``--warmup`` (α = 1 starts with 2B groups in flight). The server's slots are not
the bottleneck at these sizes: α = 1 gains by running up to twice the episodes at
once, which a real deployment pays for in environment instances.
Latencies are keyed by (group, episode index), so (a), (b) and the first
``group_size`` episodes of (c) see identical latencies. Rows: σ/μ ∈ {0.1, 0.5, 1},
then the straggler case (one environment in eight is 10x slower, σ/μ = 0.1).

``--real`` runs (a)-(c) in wall time instead: a thread per environment call
sleeping its latency for real (μ = 0.1 s), the scheduler's pump thread, and the
simulated server on its own thread (10 ms a token), 4 groups x 4 episodes (+1);
its last two columns are the same workload's ratios in virtual time (what the
threads, the GIL and the shared cores cost is the difference).

``--env scienceworld`` (wall time, always ``--real``'s threads): the environment is
the real ScienceWorld simulator (``envs.scienceworld``, the default task subset's
train variations), so its latency is the simulator's own (a JVM call, no drawn
latency; the μ and σ of a step are measured and printed); the policy is scripted
(one of a few valid and invalid-in-context actions, a pure function of the request,
the same in every mode). The JVMs (one per episode in flight) are started before
the first mode and reused by every mode (``envs.scienceworld_sim``), so no mode
pays JVM start-up. Modes (a)-(c) as above, in one run, 2 groups x 4 episodes (+1)
a step.

Printed: trained episodes per (virtual) second for each mode, the ratios to (a),
episodes aborted by redundancy, and the load average (only this script's own run
time depends on the machine). ROLL Flash reports 2.46x from environment-level
async at σ = 10 s (892 s -> 362 s per step) and 243 s -> 45 s with redundancy in a
straggler case.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxflash.envs.chat import TurnRenderer  # noqa: E402
from jaxflash.envs.frozenlake import ACTION_NAMES  # noqa: E402
from jaxflash.envs.latency import LatencyConfig, LatencyEnv  # noqa: E402
from jaxflash.envs.registry import env_config, make_env  # noqa: E402
from jaxflash.envs.scienceworld_sim import default_pool  # noqa: E402
from jaxflash.models.formats.weights_gguf import smollm2_gguf_path  # noqa: E402
from jaxflash.models.text.tokenizer import Tokenizer  # noqa: E402
from jaxflash.runtime.clock import RealClock, VirtualClock  # noqa: E402
from jaxflash.runtime.rollout.env_calls import thread_runner  # noqa: E402
from jaxflash.runtime.rollout.episode_groups import EpisodeSettings  # noqa: E402
from jaxflash.runtime.rollout.inbox import Inbox  # noqa: E402
from jaxflash.runtime.rollout.server_pool import ServersChanged  # noqa: E402
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.runtime.simulate.episodes import (  # noqa: E402
    VirtualEnvTime,
    VirtualTurnServer,
    episode_scheduler,
    run_steps,
)
from jaxflash.types import SamplingParams  # noqa: E402


class ThreadedTurnServer(VirtualTurnServer):
    """``VirtualTurnServer`` in real time: a thread delivers what is due every ms."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> list[tuple[int, int]]:
        self._stop.set()
        with self._lock:
            return super().stop(timeout_s)

    def submit(self, request) -> None:
        with self._lock:
            super().submit(request)

    def abort_prompt(self, prompt_id: int) -> int:
        with self._lock:
            return super().abort_prompt(prompt_id)

    def _loop(self) -> None:
        while not self._stop.wait(0.001):
            with self._lock:
                self.deliver_due()


# The scripted ScienceWorld policy: moves, looks and one action it does not know.
SW_ACTIONS = (
    "look around",
    "teleport to kitchen",
    "go to outside",
    "open door to greenhouse",
    "inventory",
    "look at door",
    "dance wildly",
)


class TimedEnv:
    """Records how long each ``step`` of the wrapped environment takes (seconds)."""

    def __init__(self, env, times: list) -> None:
        self.env, self._times = env, times

    @property
    def config(self):
        return self.env.config

    def reset(self, seed: int) -> str:
        return self.env.reset(seed)

    def step(self, action_text: str):
        t0 = time.monotonic()
        try:
            return self.env.step(action_text)
        finally:
            self._times.append(time.monotonic() - t0)

    def close(self) -> None:
        self.env.close()


class ThreadBarrier:
    """A runner: each environment call on its own thread; the outcomes are held until
    no call is running, then delivered together (lockstep environment steps)."""

    def __init__(self) -> None:
        self._lock, self._running, self._held = threading.Lock(), 0, []

    def __call__(self, call, deliver) -> None:
        with self._lock:
            self._running += 1

        def work() -> None:
            outcome = call()
            with self._lock:
                self._running -= 1
                self._held.append((deliver, outcome))
                out, self._held = (self._held, []) if self._running == 0 else ([], self._held)
            for d, o in out:
                d(o)

        threading.Thread(target=work, daemon=True).start()


def run_mode(args, tok, *, std_ratio, barrier, redundancy, straggler_prob=0.0, alpha=0, real=False):
    """One mode: (trained episodes, seconds, counters) over the steady-state window
    (steps ``warmup + 1 .. steps``: α = 1 starts with 2B groups in flight); virtual
    seconds, or wall seconds with ``real`` (threads, real sleeps). With ``--env
    scienceworld`` the counters also hold ``step_times`` (seconds of every step)."""
    clock = RealClock() if real else VirtualClock()
    inbox = Inbox()
    env_time = None if real else VirtualEnvTime(clock, barrier=barrier)
    sw = args.env == "scienceworld"
    if sw:
        opts = dict(max_turns=args.turns, max_tokens_per_turn=24, step_timeout_s=120.0)
    else:
        opts = dict(size=4, max_turns=args.turns, max_tokens_per_turn=24, step_timeout_s=1e9)
    per_group = args.group_size + redundancy
    made, step_times = [0], []

    def factory():
        if sw:
            return TimedEnv(make_env("scienceworld", **opts), step_times)
        k, made[0] = made[0], made[0] + 1
        group, episode = divmod(k, per_group)  # groups start their episodes in order
        latency = LatencyConfig(
            mean_s=args.mu,
            std_s=std_ratio * args.mu,
            straggler_prob=straggler_prob,
            straggler_factor=10.0,
            seed=group * 1000 + episode,
        )
        sleep = time.sleep if real else env_time.sleep
        return LatencyEnv(make_env("frozenlake", **opts), latency, sleep=sleep)

    def reply(request):  # a fixed, valid but aimless policy: the same in every mode
        n = request.prompt_id * 31 + request.sample_index * 7 + len(request.prompt_tokens)
        if sw:
            return tok.encode(SW_ACTIONS[n % len(SW_ACTIONS)])
        return tok.encode(f"<answer>{ACTION_NAMES[n % 4]}</answer>")

    server = (ThreadedTurnServer if real else VirtualTurnServer)(
        inbox.generated,
        clock,
        reply=reply,
        stop_id=tok.eos_id,
        slots=args.slots,
        decode_s=args.decode_ms / 1000,
        barrier=barrier,
    )
    settings = EpisodeSettings(
        make_env=factory,
        renderer=TurnRenderer(tok),
        limits=env_config(args.env, **opts),
        max_context_tokens=4096,
        redundancy=redundancy,
        runner=(ThreadBarrier() if barrier else thread_runner) if real else env_time,
    )
    sched = episode_scheduler(
        [server],
        inbox,
        settings,
        clock,
        batch_groups=args.groups,
        group_size=args.group_size,
        sampling=SamplingParams(max_new_tokens=24),
        async_ratio=alpha,
    )
    if real:  # the scheduler's pump thread, the server's thread, a thread per env call
        ready, window = [], []
        sched.start()
        try:
            for v in range(args.steps):
                batch = sched.next_batch(v, timeout_s=600)
                ready.append(clock.now())
                window.append(batch)
                ThreadFree(sched).mark_trained(batch.groups)
                sched.servers_changed(ServersChanged(version=v + 1, weights=[None]))
        finally:
            sched.close()
        window = window[args.warmup :]
    else:
        runs = run_steps(sched, clock, [server], env_time, steps=args.steps)
        ready, window = [r.ready_at for r in runs], [r.batch for r in runs[args.warmup :]]
    # Steady state: the steps after the warm-up ones, from the batch before them.
    episodes = sum(len(g.samples) for b in window for g in b.groups)
    counters = dict(sched.watch.counters, step_times=step_times)
    return episodes, ready[-1] - ready[args.warmup - 1], counters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 steps of 4 groups")
    p.add_argument(
        "--env",
        default="frozenlake",
        choices=("frozenlake", "scienceworld"),
        help="scienceworld: the real simulator's latency, wall time (module docstring)",
    )
    p.add_argument("--groups", type=int, default=8, help="B: groups (maps) per step")
    p.add_argument("--group-size", type=int, default=8, help="G: episodes kept per group")
    p.add_argument("--redundancy", type=int, default=2, help="r: extra episodes per group")
    p.add_argument("--turns", type=int, default=10, help="max turns per episode")
    p.add_argument("--steps", type=int, default=6, help="learner steps")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the rates (>= 1)")
    p.add_argument("--mu", type=float, default=1.0, help="mean environment latency, s")
    p.add_argument("--slots", type=int, default=256, help="decode slots of the server")
    p.add_argument("--decode-ms", type=float, default=100.0, help="decode time per token")
    p.add_argument(
        "--real",
        action="store_true",
        help="wall time with threads and real sleeps (defaults then: 4 groups x 4, 4 steps, "
        "μ = 0.1 s, 10 ms a token)",
    )
    args = p.parse_args()
    if args.real:
        args.groups, args.group_size, args.redundancy, args.steps, args.warmup = 4, 4, 1, 4, 1
        args.mu, args.decode_ms = 0.1, 10.0
    if args.quick:
        args.groups, args.steps, args.warmup = 4, 3, 1
    t0 = time.monotonic()
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    if args.env == "scienceworld":
        scienceworld_main(args, tok, t0)
        return
    print(
        f"FrozenLake 4x4, {args.groups} groups x {args.group_size} episodes a step, "
        f"<= {args.turns} turns, {args.steps} steps (rates over the last "
        f"{args.steps - args.warmup}); latency N(μ={args.mu:g} s, σ) "
        f"truncated at 0; simulated generation: {args.slots} slots, {args.decode_ms:g} ms "
        + (
            "a token; wall time (threads and real sleeps on this machine's CPUs)"
            if args.real
            else "a token; virtual time (devices: none, the numbers do not depend on the machine)"
        )
    )
    cases = [(f"σ/μ={s:g}", s, 0.0) for s in (0.1, 0.5, 1.0)]
    cases.append(("stragglers 1/8 x10, σ/μ=0.1", 0.1, 1 / 8))
    # The real run prints, next to its wall-time ratios, the same workload in virtual time.
    extra = (
        ("virt async/sync", "virt +red/sync") if args.real else ("α=1 async/sync", "α=1 +red/sync")
    )
    head = (
        f"{'case':<28} {'sync ep/s':>9} {'async ep/s':>10} {'+redund ep/s':>12} "
        f"{'async/sync':>10} {'+red/sync':>9} {'aborted':>7} {'turns/ep':>8} "
        f"{extra[0]:>15} {extra[1]:>14}"
    )
    print(head)
    print("-" * len(head))
    for name, s, straggle in cases:
        rates, aborted, turns = [], 0, 0.0
        modes = [(True, 0, 0, args.real), (False, 0, 0, args.real)]
        modes += [(False, args.redundancy, 0, args.real)]
        if args.real:  # the same three in virtual time
            modes += [(True, 0, 0, False), (False, 0, 0, False), (False, args.redundancy, 0, False)]
        else:  # α = 1: the next step's groups start while this step's stragglers finish
            modes += [(False, 0, 1, False), (False, args.redundancy, 1, False)]
        for barrier, r, alpha, real in modes:
            n, secs, c = run_mode(
                args,
                tok,
                std_ratio=s,
                barrier=barrier,
                redundancy=r,
                straggler_prob=straggle,
                alpha=alpha,
                real=real,
            )
            rates.append(n / secs)
            if len(rates) == 3:
                aborted = c.get("episodes_aborted_redundant", 0)
            elif len(rates) == 2:
                turns = c.get("turns_generated", 0) / max(c.get("episodes_finished", 1), 1)
        if args.real:
            more = (rates[4] / rates[3], rates[5] / rates[3])
        else:
            more = (rates[3] / rates[0], rates[4] / rates[0])
        print(
            f"{name:<28} {rates[0]:>9.2f} {rates[1]:>10.2f} {rates[2]:>12.2f} "
            f"{rates[1] / rates[0]:>9.2f}x {rates[2] / rates[0]:>8.2f}x {aborted:>7} {turns:>8.1f} "
            f"{more[0]:>14.2f}x {more[1]:>13.2f}x"
        )
    print(f"ran in {time.monotonic() - t0:.1f} s; load average (1, 5, 15 min): {os.getloadavg()}")


def scienceworld_main(args, tok, t0: float) -> None:
    """Modes (a)-(c) on the real ScienceWorld simulator, wall time (module docstring)."""
    args.real = True
    args.groups, args.group_size, args.redundancy = 2, 4, 1
    args.steps, args.warmup, args.decode_ms = 4, 1, 10.0
    # Start the JVMs every mode will reuse: one per episode in flight (+ redundancy).
    pool = default_pool()
    sims = [pool.acquire() for _ in range(args.groups * (args.group_size + args.redundancy))]
    for sim in sims:
        pool.release(sim)
    print(
        f"ScienceWorld (default tasks, train variations), {args.groups} groups x "
        f"{args.group_size} episodes a step (+{args.redundancy} redundant), <= {args.turns} "
        f"turns, {args.steps} steps (rates over the last {args.steps - args.warmup}); scripted "
        f"policy, simulated generation {args.decode_ms:g} ms a token; {len(sims)} JVMs started "
        f"in {time.monotonic() - t0:.1f} s"
    )
    head = (
        f"{'mode':<34} {'episodes/s':>10} {'vs sync':>8} {'step μ s':>8} {'step σ s':>8} "
        f"{'steps':>6} {'aborted':>7}"
    )
    print(head)
    print("-" * len(head))
    base = None
    modes = [("(a) sync: batch barrier", True, 0), ("(b) env-async", False, 0)]
    modes.append((f"(c) env-async + redundancy r={args.redundancy}", False, args.redundancy))
    for name, barrier, r in modes:
        n, secs, c = run_mode(args, tok, std_ratio=0.0, barrier=barrier, redundancy=r, real=True)
        rate = n / secs
        base = base or rate
        times = c["step_times"]
        mean = sum(times) / len(times)
        std = (sum((x - mean) ** 2 for x in times) / max(len(times) - 1, 1)) ** 0.5
        print(
            f"{name:<34} {rate:>10.3f} {rate / base:>7.2f}x {mean:>8.3f} {std:>8.3f} "
            f"{len(times):>6} {c.get('episodes_aborted_redundant', 0):>7}"
        )
    print(f"pool: {dict(pool.counters)}")
    print(f"ran in {time.monotonic() - t0:.1f} s; load average (1, 5, 15 min): {os.getloadavg()}")
    pool.close()


if __name__ == "__main__":
    main()
