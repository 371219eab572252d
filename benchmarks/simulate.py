"""Pod-scale simulation of the runtime: every mode at 8 to 1,024 slots, and ROLL Flash's ratios.

    python benchmarks/simulate.py                       # ~3-4 min on 2 CPU cores
    python benchmarks/simulate.py --quick               # two small scales, seconds
    python benchmarks/simulate.py --costs benchmarks/sim_costs/cpu_tiny_smollm2.json

The real ``RolloutScheduler`` (admission, dispatch, group buffer, staleness gate,
ledger) runs under a virtual clock against simulated servers and a simulated
learner (``jaxflash.runtime.simulate``); nothing here is a formula standing in
for the scheduler.

Every run leaves out its first α + 1 steps (the pipeline filling; 1 for sync) and
measures at least α + 1 more, so the window is steady state in every mode.

Part 1, modes x scales. Cost model ``--costs`` (default: Qwen3-8B on H800, roofline
estimates, ``benchmarks/sim_costs/h800_qwen3_8b.json``). A fixed device budget D
per scale: sync is colocated (all D devices generate, then all D train, α = 0);
async (α = 1, 2, 4, 8) gives a quarter of D (at least one device) to the learner
and the rest to generation servers, each of S slots. Each mode runs with and
without queue scheduling (without: batch-level barrier rounds, ROLL Flash's sync
baseline) and with and without prompt replication (without: a prompt's G samples
on one server). Workload: long-tailed reasoning lengths, lognormal (median 1,500
tokens, σ 1.0, per-prompt σ_p 0.5, cap 16,384), pass rates Beta(0.6, 0.6) and
DAPO's zero-variance filter (a filtered prompt is replaced at once, up to B a step),
N = B·G samples per step equal to the sync slots. Columns: trained samples/s, its
ratio to sync (same scale, same variant), decode-slot occupancy, staleness of
trained samples (mean/max), learner and generation idle fractions, measured
seconds per trained sample, and ROLL Flash's bound μ_gen/K + L_gen/Q (Q = (α+1)·N,
K the run's generation slots, μ/L the mean/longest in-slot seconds of its trained
samples) -- a bound on the generation part only.

Part 2, ROLL Flash's published ratios (arXiv 2510.11345) at their setting as far
as it is published: Qwen3-8B on H800s, GRPO with 16 responses per prompt,
long reasoning responses (Think model, up to 32k tokens). The rest is assumed and
printed: 32 GPUs (a quarter of their 128, same batch per GPU: ratios depend on
N/K and the length distribution, not the absolute size), B = 64 prompts x 16,
48 sequences per GPU, lengths lognormal (median 4,000, σ 1.0, σ_p 0.5, cap 32,768).
(a) α sweep: sync (32 GPUs colocated) vs async at the best of three budget splits;
reported: up to 2.24x. (b) queue scheduling: sync with the zero-variance filter,
with vs without queue scheduling; reported: 125 s -> 37 s per step (3.38x).
Prints the load average (the simulator is deterministic; only its own run time
depends on the machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxflash.replay.groups import GroupFilter  # noqa: E402
from jaxflash.runtime.simulate import (  # noqa: E402
    CostModel,
    LogNormal,
    SimConfig,
    SimWorkload,
    reasoning_workload,
    simulate,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ALPHAS = (1, 2, 4, 8)
REPORTED_ASYNC = 2.24  # ROLL Flash, RLVR, same GPU budget
REPORTED_QUEUE = (125.0, 37.0)  # s per step without / with queue scheduling
ZERO_VAR = GroupFilter(zero_variance=True)


@dataclasses.dataclass(frozen=True)
class Scale:
    devices: int  # D, the budget
    slots_per_server: int  # S
    prompts: int  # B
    group: int  # G

    def sync(self, **kw) -> SimConfig:
        kw = _steady(0, kw)
        return SimConfig(
            placement="colocated",
            servers=self.devices,
            slots_per_server=self.slots_per_server,
            learner_devices=self.devices,
            batch_prompts=self.prompts,
            group_size=self.group,
            **kw,
        )

    def async_(self, alpha: int, train_devices: int | None = None, **kw) -> SimConfig:
        train = train_devices or max(1, self.devices // 4)
        kw = _steady(alpha, kw)
        return SimConfig(
            placement="disjoint",
            async_ratio=alpha,
            servers=self.devices - train,
            slots_per_server=self.slots_per_server,
            learner_devices=train,
            batch_prompts=self.prompts,
            group_size=self.group,
            **kw,
        )


def _steady(alpha: int, kw: dict) -> dict:
    """Steady state: the first α + 1 steps (the pipeline filling) are left out and at
    least α + 1 are measured (a barrier round spans up to α + 1 batches)."""
    kw = dict(kw)
    measured = max(kw.pop("measured"), alpha + 1)
    return dict(kw, warmup_steps=alpha + 1, steps=alpha + 1 + measured)


SCALES = [
    Scale(2, 4, 1, 8),
    Scale(2, 16, 2, 16),
    Scale(4, 32, 8, 16),
    Scale(16, 32, 32, 16),
    Scale(32, 32, 64, 16),
]


def paper_workload(seed: int = 0) -> SimWorkload:
    """The reasoning workload with ROLL Flash's longer responses and prompts."""
    return dataclasses.replace(
        reasoning_workload(seed),
        lengths=LogNormal(median=4000, sigma=1.0),
        max_tokens=32768,
        prompt_tokens=(300, 500, 700),
    )


HEAD = (
    f"{'mode':<8}{'queue':>6}{'repl':>5}{'samples/s':>11}{'x sync':>8}{'occup':>7}{'stale':>10}"
    f"{'L idle':>8}{'G idle':>8}{'s/sample':>10}{'bound':>9}"
)


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def row(name: str, cfg: SimConfig, res, base) -> str:
    ratio = res.samples_per_s / base.samples_per_s if base and base.samples_per_s else float("nan")
    return (
        f"{name:<8}{_on(cfg.queue_scheduling):>6}{_on(cfg.prompt_replication):>5}"
        f"{res.samples_per_s:>11.3f}{ratio:>8.2f}{res.occupancy:>7.2f}"
        f"{res.staleness_mean:>6.2f}/{res.staleness_max:<3d}{res.learner_idle:>8.2f}{res.gen_idle:>8.2f}"
        f"{res.s_per_sample:>10.3f}{res.bound_s_per_sample:>9.3f}"
    )


def part1(costs: CostModel, scales: list[Scale], common: dict) -> None:
    print(f"\n=== Part 1: modes x scales; costs: {costs.name}")
    for sc in scales:
        t0 = time.monotonic()
        train = max(1, sc.devices // 4)
        k_async = (sc.devices - train) * sc.slots_per_server
        print(
            f"\n-- D = {sc.devices} devices: sync K = {sc.devices * sc.slots_per_server} slots "
            f"(colocated); async K = {k_async} slots + {train} learner device(s); "
            f"N = {sc.prompts} x {sc.group} samples per step"
        )
        print(HEAD + "\n" + "-" * len(HEAD))
        for qs in (True, False):
            for rep in (True, False):
                kw = dict(common, queue_scheduling=qs, prompt_replication=rep)
                base = simulate(sc.sync(**kw), costs, reasoning_workload())
                print(row("sync", sc.sync(**kw), base, base))
                for a in ALPHAS:
                    cfg = sc.async_(a, **kw)
                    print(row(f"a={a}", cfg, simulate(cfg, costs, reasoning_workload()), base))
        print(f"({time.monotonic() - t0:.0f} s; load {os.getloadavg()[0]:.1f})", flush=True)


def part2(costs: CostModel, common: dict) -> None:
    print(f"\n=== Part 2: ROLL Flash's ratios; costs: {costs.name}")
    sc = Scale(32, 48, 64, 16)
    print(
        "published (arXiv 2510.11345): Qwen3-8B (Base / Think), H800 GPUs, GRPO with 16 responses "
        "per prompt, long reasoning responses; 2.24x RLVR speed-up at the same GPU budget; queue "
        "scheduling 125 s -> 37 s per step.\n"
        f"assumed: {sc.devices} GPUs ({128 // sc.devices}x fewer than their 128; same batch "
        f"per GPU), {sc.slots_per_server} sequences per GPU, B = {sc.prompts} x G = {sc.group}, "
        "lengths lognormal(median 4000, σ 1.0, per-prompt σ_p 0.5) capped at 32768, pass rates "
        "Beta(0.6, 0.6) with the zero-variance filter (DAPO dynamic sampling), the H800 costs above"
    )
    work = paper_workload()
    kw = dict(common, group_filter=ZERO_VAR)
    sync = simulate(sc.sync(**kw), costs, work)
    print(HEAD + "\n" + "-" * len(HEAD))
    print(row("sync", sc.sync(**kw), sync, sync))
    splits = {}
    for train in (4, 8, 12):
        splits[train] = simulate(sc.async_(2, train, **kw), costs, work)
    best = max(splits, key=lambda t: splits[t].samples_per_s)
    print(
        "budget split at α = 2 (learner GPUs: samples/s): "
        + ", ".join(f"{t}: {r.samples_per_s:.3f}" for t, r in splits.items())
        + f" -> {best} learner GPUs"
    )
    ratios = {}
    for a in ALPHAS:
        cfg = sc.async_(a, best, **kw)
        res = splits[best] if a == 2 else simulate(cfg, costs, work)
        ratios[a] = res.samples_per_s / sync.samples_per_s
        print(row(f"a={a}", cfg, res, sync))
    top = max(ratios.values())
    print(
        "(a) async / sync: "
        + ", ".join(f"α={a} {r:.2f}x" for a, r in ratios.items())
        + f"; best {top:.2f}x vs reported {REPORTED_ASYNC:.2f}x ({(top / REPORTED_ASYNC - 1):+.0%})"
    )
    on = sync
    off = simulate(sc.sync(**dict(kw, queue_scheduling=False)), costs, work)
    r = REPORTED_QUEUE[0] / REPORTED_QUEUE[1]
    for label, a_on, a_off in [("pass rates Beta(0.6, 0.6)", on, off)] + _harder(sc, costs, kw):
        q = a_off.step_s / a_on.step_s
        print(
            f"(b) sync step with / without queue scheduling, {label} "
            f"({_filtered(a_on):.0%} of groups filtered): {a_on.step_s:.0f} s / "
            f"{a_off.step_s:.0f} s = {q:.2f}x vs reported {REPORTED_QUEUE[0]:.0f} s / "
            f"{REPORTED_QUEUE[1]:.0f} s = {r:.2f}x ({(q / r - 1):+.0%})"
        )


def _filtered(res) -> float:
    f = sum(res.outcomes["filtered"].values())
    return f / max(1, f + sum(res.outcomes["trained"].values()))


def _harder(sc: Scale, costs: CostModel, kw: dict) -> list:
    """The same at a higher filtered fraction (more all-right / all-wrong prompts)."""
    work = dataclasses.replace(paper_workload(), pass_alpha=0.2, pass_beta=0.2)
    on = simulate(sc.sync(**kw), costs, work)
    off = simulate(sc.sync(**dict(kw, queue_scheduling=False)), costs, work)
    return [("pass rates Beta(0.2, 0.2)", on, off)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costs", default=os.path.join(HERE, "sim_costs", "h800_qwen3_8b.json"))
    ap.add_argument("--measured", type=int, default=3, help="measured steps (at least α + 1)")
    ap.add_argument("--token_block", type=int, default=32, help="decode steps per simulated step")
    ap.add_argument("--quick", action="store_true", help="the two smallest scales, no part 2")
    args = ap.parse_args()
    t0 = time.monotonic()
    print(f"load average at start: {os.getloadavg()}")
    costs = CostModel.load(args.costs)
    common = dict(measured=args.measured, token_block=args.token_block, group_filter=ZERO_VAR)
    part1(costs, SCALES[:2] if args.quick else SCALES, common)
    if not args.quick:
        part2(costs, dict(common, group_filter=None))
    print(
        "\nqueue off = batch-level barrier rounds; repl off = a prompt's G samples on one server; "
        "x sync = samples/s over sync's (same scale and variant); occup = live slot-seconds / "
        "(K x window); stale = staleness of trained samples mean/max; L/G idle = learner / "
        "generation idle fraction; s/sample = window / trained samples; bound = μ_gen/K + "
        "L_gen/Q (ROLL Flash, generation only)."
    )
    print(f"total {time.monotonic() - t0:.0f} s; load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
