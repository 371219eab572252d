"""benchmarks/replay.py's simulator part: the four configurations at pod scale.

The simulator (``jaxflash.runtime.simulate``: the real scheduler under a virtual
clock) at 64-1,024 generation slots, the same four configurations at the same
device budget, cost model ``--costs``. The simulator has no accuracy: it predicts
the time to spend a generation budget and how many learner updates (and trained
samples, replayed included) that budget buys; whether replayed updates are worth
as much as fresh ones is what the real runs measure. Its replay rows train
round((1 - rho) B) fresh groups + rho / (1 - rho) replayed samples per fresh one,
as the runtime does. It has no controller: "adaptive" is predicted as "replay".
"""

from __future__ import annotations

import argparse
import os

from jaxflash.replay.dual_cycle import fresh_groups_needed
from jaxflash.runtime.simulate import CostModel, SimConfig, reasoning_workload, simulate

MODES = ("sync", "async", "replay", "adaptive")


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


def run_simulator(args: argparse.Namespace) -> None:
    """Print the simulator's table (``args``: rho, costs, sim_slots, slots_per_server)."""
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
            res = simulate(cfg, costs, reasoning_workload())
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
