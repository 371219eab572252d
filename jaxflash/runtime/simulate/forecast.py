"""What to rent: the compiled programs' roofline costs, run through the pod-scale simulator.

The dry run compiles every program of a run (``sizing.plan``); ``simulate.plan_costs``
turns their costs into a ``runtime.simulate.CostModel``, and here the real scheduler
runs the config's workload on it under virtual time (``runtime.simulate.simulate``):
the synchronous baseline (colocated on the whole slice, α = 0), and sync and async
(α) training on each learner/generation split of the slice. Every figure is a model
figure -- roofline times through a simulator -- not a measurement.

Splits: the generation slice keeps its compiled size (``mesh.generation``); the
learner takes the rest in whole slices. A learner size is kept where the batch
divides over it at the config's sequences per chip and its per-chip peak, scaled
from the compiled one (state / chips + the same temporaries), leaves 10 % of HBM.
"""

from __future__ import annotations

import dataclasses

from jaxflash.runtime.simulate.costs import CostModel
from jaxflash.runtime.simulate.driver import SimConfig, simulate
from jaxflash.runtime.simulate.metrics import SimResult
from jaxflash.runtime.simulate.plan_costs import (
    ProgramTimes,
    RunShape,
    assumed_workload,
    cost_model,
    mean_live_context,
    program_times,
)
from jaxflash.runtime.simulate.workload import SimWorkload
from jaxflash.sizing.chips import ChipSpec
from jaxflash.sizing.plan import Plan

GIB = 1 << 30
MODEL_NOTE = (
    "MODEL FIGURES, NOT MEASUREMENTS: roofline costs of the compiled programs (lower "
    "bounds: no ICI collectives, latency or host overhead) run through the simulator "
    "(jaxflash.runtime.simulate)"
)


# -- splits and runs ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """Learner chips + generation servers of one slice; ``peak_bytes``: the learner's
    per-chip peak scaled from the compiled step (``fits``: under 90 % of HBM)."""

    learner_chips: int
    servers: int
    peak_bytes: float
    fits: bool
    why: str = ""


def splits(plan: Plan, shape: RunShape) -> list[Split]:
    """Learner sizes in whole generation slices, most learner chips first.

    A learner of n chips keeps the compiled sequences per chip (micro-batch
    ``micro x n / n0``, which must divide the batch) and holds the TrainState split
    n ways: peak(n) = state x n0 / n + (compiled peak - state).
    """
    train = plan.by_name()["train_step"]
    n0, per_chip = shape.learner_chips, shape.micro_batch_size / shape.learner_chips
    out = []
    for servers in range(1, shape.slice_chips // shape.gen_chips):
        n = shape.slice_chips - servers * shape.gen_chips
        state = plan.learner_state_bytes * n0 / n
        peak = state + train.resident_bytes - plan.learner_state_bytes
        micro = per_chip * n
        why = ""
        if micro != int(micro) or micro < 1 or shape.batch % int(micro):
            why = f"micro-batch {micro:g} does not divide the batch of {shape.batch}"
        elif peak > 0.9 * shape.hbm_bytes:
            why = f"learner peak {peak / GIB:.1f} GiB > 90 % of {shape.hbm_bytes / GIB:.2f}"
        out.append(Split(learner_chips=n, servers=servers, peak_bytes=peak, fits=not why, why=why))
    return out


@dataclasses.dataclass(frozen=True)
class Run:
    """One simulated mode: what it ran on and the simulator's result."""

    mode: str
    learner_chips: int
    servers: int
    result: SimResult
    warmup: int


def simulate_mode(
    costs: CostModel, work: SimWorkload, shape: RunShape, *, alpha: int, learner_chips: int,
    servers: int, colocated: bool = False,
) -> Run:  # fmt: skip
    """Simulate one placement: α + 1 warm-up steps left out, then max(3, α + 1) measured."""
    warmup = alpha + 1
    config = SimConfig(
        placement="colocated" if colocated else "disjoint", async_ratio=alpha,
        servers=servers, slots_per_server=shape.slots, learner_devices=learner_chips,
        batch_prompts=shape.prompts_per_step, group_size=shape.group_size,
        steps=warmup + max(3, alpha + 1), warmup_steps=warmup,
        token_block=max(1, shape.max_new_tokens // 512),
    )  # fmt: skip
    mode = "sync colocated" if colocated else f"{'async' if alpha else 'sync'} a={alpha}"
    return Run(mode, learner_chips, servers, simulate(config, costs, work), warmup)


def time_split(run: Run) -> dict[str, float]:
    """Fractions of the measured window the learner trains, publishes and idles."""
    trace = run.result.trace
    lo, hi = trace[run.warmup - 1][1], trace[-1][1]
    window = max(hi - lo, 1e-12)

    def inside(a: float, b: float) -> float:
        return max(0.0, min(b, hi) - max(a, lo))

    train = sum(inside(t0, t1) for t0, t1, _, _ in trace) / window
    publish = sum(inside(t1, t2) for _, t1, t2, _ in trace) / window
    return {"train": train, "publish": publish, "idle": max(0.0, 1.0 - train - publish)}


# -- the report ----------------------------------------------------------------------


def _row(run: Run, shape: RunShape, shared: bool = False) -> str:
    r, t = run.result, time_split(run)
    gen = f"{run.servers} x {shape.gen_chips}" + (" shared" if shared else "")
    return (
        f"  {run.mode:15s} {run.learner_chips:7d} {gen:>14s} {r.samples_per_s:10.3f} "
        f"{r.step_s:8.1f} {t['train']:6.2f} {t['publish']:7.2f} {t['idle']:5.2f} "
        f"{r.occupancy:9.2f} {r.gen_idle:6.2f} {r.staleness_mean:6.2f}"
    )


def _costs_line(times: ProgramTimes, shape: RunShape, chip: ChipSpec) -> str:
    tok = times.train_step_s / times.train_tokens
    if times.path in ("reference", "dense"):
        decode = (
            f"decode step {1e3 * times.decode_base_s:.2f} ms at any number of live slots "
            f"({times.path} path: it reads every slot's reservation)"
        )
    else:
        decode = (
            f"decode step {1e3 * times.decode_base_s:.2f} ms + {1e6 * times.decode_live_s:.1f} us "
            f"per live slot ({times.path}: each slot's KV at the mean live context, on paper)"
        )
    copy = (
        f" + ICI copy {1e3 * times.transfer_s:.2f} ms (one chip's weights at half of "
        f"{chip.ici_bandwidth / 1e9:.0f} GB/s)"
        if times.transfer_s
        else " (the copy between slices is not modelled: no ICI figure for this chip)"
    )
    return (
        f"  costs (roofline on {chip.kind}): train_step {times.train_step_s:.3f} s for "
        f"{shape.batch} x {shape.seq_len} tokens on {shape.learner_chips} chips "
        f"({1e3 * times.train_step_s / shape.batch:.1f} ms per sample of {shape.seq_len}, "
        f"{1e6 * tok:.2f} us per token; linear in tokens and 1/chips; rows "
        f"{'packed' if shape.packing else 'padded to the longest'}); prefill "
        f"{1e3 * times.prefill_base_s:.2f} ms + {1e6 * times.prefill_token_s:.2f} us per "
        f"prompt token; {decode}, a server of {shape.gen_chips} chip(s) x {shape.slots} slots; "
        f"publish {1e3 * times.publish_s:.2f} ms + install {1e3 * times.install_s:.2f} ms"
        f"{copy}; generation waits for it; rewards instant"
    )


@dataclasses.dataclass(frozen=True)
class Forecast:
    """What ``make_forecast`` simulated (seconds, samples/s: model figures).

    Attributes:
      shape: the run.
      work_line: the assumed workload, in words.
      context_tokens: mean live context of a slot.
      times: the program times the cost model was built from.
      tried: every split considered (fitting or not, and why).
      runs: sync and async per fitting split.
      colocated: the synchronous baseline on the whole slice.
      colocated_bytes: its per-chip estimate (learner + engine on each chip).
      best: the async run with the most trained samples/s.
      what_if: (times, best async run over the fitting splits) with the decode step
        priced as the TPU kernel over a page-split pool; None on the kernel path.
    """

    shape: RunShape
    work_line: str
    context_tokens: float
    times: ProgramTimes
    tried: list[Split]
    runs: list[Run]
    colocated: Run
    colocated_bytes: float
    best: Run
    what_if: tuple[ProgramTimes, Run] | None

    @property
    def sync_same_split(self) -> Run:
        """The α = 0 run on the best async run's split."""
        return next(
            r
            for r in self.runs
            if r.learner_chips == self.best.learner_chips and r.mode != self.best.mode
        )


def make_forecast(
    plan: Plan,
    chip: ChipSpec,
    shape: RunShape,
    *,
    share: int = 1,
    workload: SimWorkload | None = None,
) -> Forecast:
    """Simulate the run on the plan's costs (see the module doc).

    Args:
      plan: the compiled programs (``sizing.plan.plan_programs`` or ``Plan.from_dict``).
      chip: the chip's figures; ``share``: devices per chip (2 on v4).
      shape: the run's placement and workload sizes.
      workload: response lengths to simulate (e.g. ``Replay.from_rollouts`` of a run);
        default ``assumed_workload(shape)``.

    Runs the simulator 2 x (fitting splits) + 2 times: sync (α = 0) and async (α =
    ``shape.async_ratio``) per split, the colocated synchronous baseline on the whole
    slice, and, where the engine reads every slot's reservation (reference path or a
    dense cache), async per split again with the decode step priced as the TPU kernel
    over a page-split pool.

    Raises:
      ValueError: a program is missing or refused (``program_times``), or no split fits.
    """
    if workload is None:
        work, work_line = assumed_workload(shape)
    else:
        kind = type(workload.lengths).__name__
        work, work_line = (
            workload,
            (
                f"workload (given): {shape.prompts_per_step} prompts x {shape.group_size} "
                f"samples a step, {kind} lengths capped at {workload.max_tokens}"
            ),
        )
    context = mean_live_context(work, shape)
    times = program_times(plan, chip, shape, context_tokens=context, share=share)
    costs = cost_model(times, shape, chip)
    tried = splits(plan, shape)
    ok = [s for s in tried if s.fits]
    if not ok:
        raise ValueError(
            "forecast: no learner/generation split fits: "
            + "; ".join(f"{s.learner_chips}+{s.servers}x{shape.gen_chips}: {s.why}" for s in tried)
        )
    a = shape.async_ratio
    runs = [
        simulate_mode(costs, work, shape, alpha=alpha, learner_chips=s.learner_chips,
                      servers=s.servers)
        for s in ok
        for alpha in (0, a)
    ]  # fmt: skip
    best = max(
        (r for r in runs if r.mode.startswith("async")), key=lambda r: r.result.samples_per_s
    )
    coloc = simulate_mode(costs, work, shape, alpha=0, learner_chips=shape.slice_chips,
                          servers=shape.slice_chips // shape.gen_chips, colocated=True)  # fmt: skip
    by = plan.by_name()
    decode = next(c for c in plan.costs if c.name.startswith("decode_block"))
    learner_state = plan.learner_state_bytes
    coloc_bytes = (
        learner_state * shape.learner_chips / shape.slice_chips
        + by["train_step"].resident_bytes - learner_state + decode.resident_bytes
    )  # fmt: skip
    what_if = None
    if times.path in ("reference", "dense"):
        t = program_times(plan, chip, shape, context_tokens=context, kernel_what_if=True,
                          share=share)  # fmt: skip
        kernel = cost_model(t, shape, chip)
        run = max(
            (simulate_mode(kernel, work, shape, alpha=a, learner_chips=s.learner_chips,
                           servers=s.servers) for s in ok),
            key=lambda r: r.result.samples_per_s,
        )  # fmt: skip
        what_if = (t, run)
    return Forecast(
        shape=shape, work_line=work_line, context_tokens=context, times=times, tried=tried,
        runs=runs, colocated=coloc, colocated_bytes=coloc_bytes, best=best, what_if=what_if,
    )  # fmt: skip


def format_forecast(f: Forecast, chip: ChipSpec, *, topology: str = "") -> str:
    """The forecast printed under the dry run's table."""
    shape, best, coloc = f.shape, f.best, f.colocated
    a = shape.async_ratio
    name = topology or f"{shape.slice_chips} {chip.kind} chips"
    lines = [
        f"forecast for {name} ({MODEL_NOTE})",
        "  " + f.work_line + f"; mean live context {f.context_tokens:,.0f} tokens",
        _costs_line(f.times, shape, chip),
        f"  {'mode':15s} {'learner':>7s} {'generation':>14s} {'samples/s':>10s} "
        f"{'step s':>8s} {'train':>6s} {'publish':>7s} {'idle':>5s} {'gen occup':>9s} "
        f"{'g idle':>6s} {'stale':>6s}",
        _row(coloc, shape, shared=True),
        *(_row(r, shape) for r in f.runs),
        "  (train / publish / idle: shares of the learner's time; gen occup: live share of "
        "the slots; g idle: share of time a server has no live slot; stale: mean versions)",
    ]
    rate = best.result.samples_per_s
    lines.append(
        f"  best split for async a={a}: learner {best.learner_chips} chips + generation "
        f"{best.servers} x {shape.gen_chips} chips: {rate:.3f} trained samples/s, "
        f"{rate / coloc.result.samples_per_s:.2f}x sync colocated, "
        f"{rate / f.sync_same_split.result.samples_per_s:.2f}x sync a=0 on the same split"
    )
    r, idle = best.result, time_split(best)["idle"]
    neck = "generation" if idle > 0.5 else "learner"
    lines.append(
        f"  where the time goes at the best split: the {neck} sets the pace (learner idle "
        f"{idle:.2f}, slots {r.occupancy:.2f} occupied); a sample spends {r.mu_gen_s:.1f} s in "
        f"a slot on average, the longest {r.l_gen_s:.1f} s; ROLL Flash's generation bound "
        f"mu/K + L/((a+1)N) = {r.bound_s_per_sample:.3f} s per sample, simulated "
        f"{r.s_per_sample:.3f}"
    )
    verdict = "fits" if f.colocated_bytes <= 0.9 * shape.hbm_bytes else "would NOT fit"
    lines.append(
        f"  sync colocated holds the learner and an engine on every chip: about "
        f"{f.colocated_bytes / GIB:.2f} GiB of {shape.hbm_bytes / GIB:.2f} ({verdict}; the "
        f"baseline the speed-ups are measured against)"
    )
    lines.append(
        "  splits (whole generation slices; learner peak scaled from the compiled step): "
        + "; ".join(
            f"{s.learner_chips}+{s.servers}x{shape.gen_chips} "
            + (f"{s.peak_bytes / GIB:.1f} GiB ok" if s.fits else f"skipped: {s.why}")
            for s in f.tried
        )
    )
    if f.what_if is not None:
        t, run = f.what_if
        lines.append(
            f"  what-if, decode by the paged TPU kernel (it reads the pages in use only) "
            f"over a pool split over all {shape.gen_chips} chips (this engine decodes by the "
            f"{f.times.path} path; the kernel needs rollout.kv_cache=paged on a TPU mesh whose "
            f"chips hold heads it tiles, head_dim a multiple of 128): step "
            f"{1e3 * t.decode_base_s:.2f} ms + {1e6 * t.decode_live_s:.1f} us per live slot; "
            f"best async a={a}: learner {run.learner_chips} chips + generation {run.servers} x "
            f"{shape.gen_chips}: {run.result.samples_per_s:.3f} samples/s "
            f"({run.result.samples_per_s / rate:.2f}x; learner idle "
            f"{time_split(run)['idle']:.2f}, gen occupancy {run.result.occupancy:.2f})"
        )
    return "\n".join(lines)


def forecast_report(
    plan: Plan, chip: ChipSpec, shape: RunShape, *, topology: str = "", share: int = 1
) -> str:
    """``make_forecast`` then ``format_forecast`` (the dry run's forecast lines)."""
    return format_forecast(make_forecast(plan, chip, shape, share=share), chip, topology=topology)
