"""What to rent: the compiled programs' roofline times, run through the pod-scale simulator.

The dry run compiles every program of a run (``sizing.plan``); here their costs
become a ``runtime.simulate.CostModel`` and the real scheduler runs the config's
workload on it under virtual time (``runtime.simulate.simulate``), for the
synchronous baseline and asynchronous training, over the learner/generation splits
of the slice. Every figure is a model figure: roofline times (max(FLOPs / peak,
bytes / HBM bandwidth) per program, a lower bound that ignores ICI collectives,
latency and host overhead) through a simulator -- not a measurement.

How each cost is built (``program_times``):

- train step: the ``train_step`` roofline over its [B, T] tokens, per token, on the
  config's learner chips; other learner sizes scale it linearly (the simulator's
  ``LearnerCost``), and a step trains the batch's rows padded to its longest
  sequence (or its real tokens with ``learner.packing``).
- prefill: a least-squares line through the ``prefill_<bucket>`` rooflines (seconds
  vs bucket tokens), per prompt and per prompt token.
- decode step as a function of live slots: ``base + per_live_slot x live``. On the
  reference path (pure-JAX gather) and with a dense cache a step reads every slot's
  reservation, so it costs the compiled step at any live count (``base``). On the
  kernel path XLA's count misses the kernel's KV reads (``sizing.kv_pool``): each
  live slot adds its K/V at the mean live context (on paper).
- publish: the ``publish`` and ``install`` rooflines plus the copy of one generation
  chip's weights over ICI (at half the chip's published bidirectional bandwidth; not
  modelled for a chip without that figure). Generation pauses meanwhile.
- reward: instant (rule-based verifiers on host workers).

Splits: the generation slice keeps its compiled size (``mesh.generation``); the
learner takes the rest in whole slices. A learner size is kept where the batch
divides over it at the config's sequences per chip and its per-chip peak, scaled
from the compiled one (state / chips + the same temporaries), leaves 10 % of HBM.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflash.runtime.simulate import (
    CostModel,
    DecodeCost,
    LearnerCost,
    LogNormal,
    PrefillCost,
    RewardCost,
    SimConfig,
    SimResult,
    SyncCost,
    Workload,
    simulate,
)
from jaxflash.sizing.chips import ChipSpec, roofline_seconds
from jaxflash.sizing.plan import Plan

GIB = 1 << 30
MODEL_NOTE = (
    "MODEL FIGURES, NOT MEASUREMENTS: roofline costs of the compiled programs (lower "
    "bounds: no ICI collectives, latency or host overhead) run through the simulator "
    "(jaxflash.runtime.simulate)"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunShape:
    """The run's placement and workload as its config gives them.

    Attributes:
      slice_chips: chips of the slice (the topology).
      learner_chips: the config's learner chips (where ``train_step`` was compiled).
      gen_chips: chips of one generation slice (server).
      slots: decode slots per server.
      prompts_per_step, group_size: B prompts x G samples per learner step.
      prompt_tokens: the prompt limit (``rollout.max_prefill_length``).
      max_new_tokens: the response budget.
      async_ratio: α of the async figure (the config's, or 2 where it says 0).
      packing: ``learner.packing`` (the learner trains real tokens, not padded rows).
      micro_batch_size: ``learner.micro_batch_size``.
      seq_len: T of the compiled train step (prompt limit + budget).
      hbm_bytes: usable HBM per chip.
    """

    slice_chips: int
    learner_chips: int
    gen_chips: int
    slots: int
    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    max_new_tokens: int
    async_ratio: int
    packing: bool
    micro_batch_size: int
    seq_len: int
    hbm_bytes: int

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size


def assumed_workload(shape: RunShape, seed: int = 0) -> tuple[Workload, str]:
    """The response lengths the forecast assumes (a config fixes only the budget).

    Lognormal, median an eighth of the budget (σ 1.0; a per-prompt scale
    σ_p 0.5: hard prompts are long for every sample), capped at ``max_new_tokens``;
    prompts of half the prompt limit. Returns (workload, one line saying so).
    """
    median = max(1.0, shape.max_new_tokens / 8)
    prompt = max(1, shape.prompt_tokens // 2)
    work = Workload(
        lengths=LogNormal(median=median, sigma=1.0),
        max_tokens=shape.max_new_tokens,
        prompt_tokens=(prompt,),
        prompt_sigma=0.5,
        seed=seed,
    )
    lens = _sample_lengths(work, shape)
    capped = float(np.mean(lens >= shape.max_new_tokens))
    line = (
        f"workload (assumed; the config fixes B, G and the budget, not the lengths): "
        f"{shape.prompts_per_step} prompts x {shape.group_size} samples a step, prompts of "
        f"{prompt} tokens, responses lognormal median {median:.0f} tokens, sigma 1.0, "
        f"per-prompt sigma 0.5, capped at {shape.max_new_tokens} (mean {lens.mean():.0f}, "
        f"{100 * capped:.1f} % capped)"
    )
    return work, line


def _sample_lengths(work: Workload, shape: RunShape, prompts: int = 256) -> np.ndarray:
    return np.asarray(
        [work.response_len(p, i) for p in range(prompts) for i in range(shape.group_size)], float
    )


def mean_live_context(work: Workload, shape: RunShape) -> float:
    """Tokens of context a live slot holds, averaged over decode steps: a sample of r
    tokens is live r steps at contexts P+1..P+r, so Σ r(P + (r+1)/2) / Σ r."""
    r = _sample_lengths(work, shape)
    p = work.prompt_len(0)
    return float(np.sum(r * (p + (r + 1) / 2)) / np.sum(r))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramTimes:
    """Seconds per program from the roofline (what the CostModel is built from).

    Attributes:
      train_step_s: the compiled step over ``train_tokens`` on the learner chips.
      train_tokens: B x T of the compiled step.
      prefill_base_s, prefill_token_s: a prefill call: base + per bucket token.
      decode_base_s: a decode step's cost at any live count.
      decode_live_s: added per live slot (kernel path: its KV at the mean context).
      publish_s, install_s, transfer_s: the weight hand-over's parts.
      path: how the decode step was priced.
    """

    train_step_s: float
    train_tokens: int
    prefill_base_s: float
    prefill_token_s: float
    decode_base_s: float
    decode_live_s: float
    publish_s: float
    install_s: float
    transfer_s: float
    path: str

    @property
    def sync_s(self) -> float:
        return self.publish_s + self.install_s + self.transfer_s


def program_times(
    plan: Plan,
    chip: ChipSpec,
    shape: RunShape,
    *,
    context_tokens: float,
    kernel_what_if: bool = False,
    share: int = 1,
) -> ProgramTimes:
    """Roofline seconds of each program of ``plan`` on ``chip`` (see the module doc).

    Args:
      plan: from ``sizing.plan.plan_programs``.
      chip: the chip's figures.
      shape: the run (the compiled train step is [B, T] = shape.batch x shape.seq_len).
      context_tokens: mean live context of a slot (``mean_live_context``).
      kernel_what_if: price the decode step as the TPU kernel over a pool split over
        every chip of the generation slice would run it (page-split pool): weights on
        paper, plus each live slot's KV, instead of the compiled path.
      share: devices per chip (2 on v4, where each TensorCore is a device).

    Raises:
      ValueError: a program the forecast needs is missing or was refused.
    """
    by = plan.by_name()
    decode = [c for c in plan.costs if c.name.startswith("decode_block")]
    missing = [n for n in ("train_step", "publish", "install") if n not in by]
    missing += [] if len(decode) == 1 else ["decode_block"]
    refused = [c.name for c in plan.costs if c.refused]
    if missing or refused:
        raise ValueError(
            f"forecast: needs every program compiled; missing {missing}, refused {refused}"
        )

    def roof(c) -> float:
        return roofline_seconds(c.flops, c.bytes_accessed + c.unseen_bytes, chip, share=share)

    prefill = sorted(
        (int(c.name.split("_")[1]), roof(c)) for c in plan.costs if c.name.startswith("prefill_")
    )
    base = slope = 0.0
    if len(prefill) > 1:
        slope, base = np.polyfit([b for b, _ in prefill], [t for _, t in prefill], 1)
    elif prefill:
        slope = prefill[0][1] / prefill[0][0]
    block, steps, kv = decode[0], plan.decode_steps, plan.kv
    bandwidth = chip.hbm_bandwidth / share
    if kernel_what_if:
        step = roofline_seconds(block.flops / steps, plan.engine_weight_bytes, chip, share=share)
        live = context_tokens * kv.token_bytes / block.devices / bandwidth
        path = "kernel what-if"
    elif kv.attention == "tpu_kernel":
        step = roofline_seconds(
            block.flops / steps, block.bytes_accessed / steps, chip, share=share
        )
        live = context_tokens * kv.token_chip_bytes / bandwidth
        path = kv.attention
    else:
        step, live, path = roof(block) / steps, 0.0, kv.attention
    ici = chip.ici_bandwidth / 2 / share
    return ProgramTimes(
        train_step_s=roof(by["train_step"]), train_tokens=shape.batch * shape.seq_len,
        prefill_base_s=max(0.0, float(base)), prefill_token_s=max(0.0, float(slope)),
        decode_base_s=step, decode_live_s=live,
        publish_s=roof(by["publish"]), install_s=roof(by["install"]),
        transfer_s=plan.engine_weight_bytes / ici if ici else 0.0, path=path,
    )  # fmt: skip


def cost_model(times: ProgramTimes, shape: RunShape, chip: ChipSpec) -> CostModel:
    """The simulator's CostModel from the program times (see the module doc)."""
    return CostModel(
        name=f"roofline of the compiled programs on {chip.kind} (model figures)",
        decode=DecodeCost(base_s=times.decode_base_s, per_active_slot_s=times.decode_live_s),
        prefill=PrefillCost(per_prompt_s=times.prefill_base_s,
                            per_prompt_token_s=times.prefill_token_s),
        learner=LearnerCost(
            step_s=0.0, per_token_s=times.train_step_s / times.train_tokens,
            padding="packed" if shape.packing else "bucket",
            reference_devices=shape.learner_chips,
        ),
        sync=SyncCost(weight_sync_s=times.sync_s, colocated_s=times.publish_s + times.install_s,
                      stalls_generation=True),
        reward=RewardCost(latency_s=0.0, workers=1),
        server_devices=shape.gen_chips,
        meta={"source": "jaxflash.sizing.forecast: roofline of the compiled programs"},
    )  # fmt: skip


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
    costs: CostModel, work: Workload, shape: RunShape, *, alpha: int, learner_chips: int,
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
        f"prompt token; {decode}, server of {shape.gen_chips} chips x {shape.slots} slots; "
        f"publish {1e3 * times.publish_s:.2f} ms + install {1e3 * times.install_s:.2f} ms"
        f"{copy}; generation waits for it; rewards instant"
    )


def forecast_report(
    plan: Plan, chip: ChipSpec, shape: RunShape, *, topology: str = "", share: int = 1
) -> str:
    """The forecast printed under the dry run's table (see the module doc).

    Runs the simulator 2 x (fitting splits) + 2 times: sync (α = 0) and async (α =
    ``shape.async_ratio``) per split, the colocated synchronous baseline on the whole
    slice, and, where the engine gathers (reference path), the async run at the best
    split with the decode step priced as the TPU kernel over a page-split pool.

    Raises:
      ValueError: a program is missing or refused (``program_times``), or no split fits.
    """
    work, work_line = assumed_workload(shape)
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
    runs = []
    for s in ok:
        for alpha in (0, a):
            run = simulate_mode(
                costs, work, shape, alpha=alpha, learner_chips=s.learner_chips, servers=s.servers
            )
            runs.append(run)
    asyncs = [r for r in runs if r.mode.startswith("async")]
    best = max(asyncs, key=lambda r: r.result.samples_per_s)
    n_servers = shape.slice_chips // shape.gen_chips
    coloc = simulate_mode(costs, work, shape, alpha=0, learner_chips=shape.slice_chips,
                          servers=n_servers, colocated=True)  # fmt: skip
    name = topology or f"{shape.slice_chips} {chip.kind} chips"
    lines = [
        f"forecast for {name} ({MODEL_NOTE})",
        "  " + work_line + f"; mean live context {context:,.0f} tokens",
        _costs_line(times, shape, chip),
        f"  {'mode':15s} {'learner':>7s} {'generation':>14s} {'samples/s':>10s} "
        f"{'step s':>8s} {'train':>6s} {'publish':>7s} {'idle':>5s} {'gen occup':>9s} "
        f"{'g idle':>6s} {'stale':>6s}",
        _row(coloc, shape, shared=True),
        *(_row(r, shape) for r in runs),
    ]
    sync_same = next(r for r in runs if r.learner_chips == best.learner_chips and r is not best)
    lines.append(
        f"  best split for async a={a}: learner {best.learner_chips} chips + generation "
        f"{best.servers} x {shape.gen_chips} chips: {best.result.samples_per_s:.3f} trained "
        f"samples/s, {best.result.samples_per_s / coloc.result.samples_per_s:.2f}x sync "
        f"colocated, {best.result.samples_per_s / sync_same.result.samples_per_s:.2f}x sync "
        f"a=0 on the same split"
    )
    coloc_peak = (
        plan.learner_state_bytes * shape.learner_chips / shape.slice_chips
        + plan.by_name()["train_step"].resident_bytes
        - plan.learner_state_bytes
        + next(c for c in plan.costs if c.name.startswith("decode_block")).resident_bytes
    )
    verdict = "fits" if coloc_peak <= 0.9 * shape.hbm_bytes else "would NOT fit"
    lines.append(
        f"  sync colocated holds the learner and an engine on every chip: about "
        f"{coloc_peak / GIB:.2f} GiB of {shape.hbm_bytes / GIB:.2f} ({verdict}; the "
        f"baseline the speed-ups are measured against)"
    )
    lines.append(
        "  splits (whole generation slices; learner peak scaled from the compiled step): "
        + "; ".join(
            f"{s.learner_chips}+{s.servers}x{shape.gen_chips} "
            + (f"{s.peak_bytes / GIB:.1f} GiB ok" if s.fits else f"skipped: {s.why}")
            for s in tried
        )
    )
    if times.path in ("reference", "dense"):
        what_if = program_times(
            plan, chip, shape, context_tokens=context, kernel_what_if=True, share=share
        )
        run = simulate_mode(cost_model(what_if, shape, chip), work, shape, alpha=a,
                            learner_chips=best.learner_chips, servers=best.servers)  # fmt: skip
        lines.append(
            f"  what-if, decode by the TPU kernel over a pool split over all "
            f"{shape.gen_chips} chips (page-split pool: not on main): step "
            f"{1e3 * what_if.decode_base_s:.2f} ms + {1e6 * what_if.decode_live_s:.1f} us per "
            f"live slot; async a={a} on the best split: {run.result.samples_per_s:.3f} "
            f"samples/s ({run.result.samples_per_s / best.result.samples_per_s:.2f}x)"
        )
    return "\n".join(lines)
