"""What a simulated run measured, defined as ``benchmarks/async_vs_sync.py`` measures
a real one, plus ROLL Flash's bound beside it.

Window: from the end of step ``warmup_steps``' training (the first request when
0) to the end of the last step's training; whole warm-up steps are left out in
every mode alike. Trained samples are the fresh samples of the window's steps.

ROLL Flash (arXiv 2510.11345, §3; DESIGN.md "Measuring"): with queue scheduling
over Q samples on K slots, the mean time per sample is at most
μ_gen/K + L_gen/Q, Q = N (sync) or (α+1)·N (async), μ_gen / L_gen the mean /
longest generation time of one sample (here: its seconds in a slot). It is the
list-scheduling bound (Graham 1969: makespan <= Σp/K + max p) divided by Q.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Measurements of one simulated run (seconds; fractions in [0, 1]).

    Attributes:
      trained_samples, window_s, samples_per_s: fresh samples trained in the
        window and their rate.
      step_s: window / measured steps.
      occupancy: live slot-seconds / (K x window).
      staleness_mean, staleness_max: of the trained samples (versions).
      learner_idle, gen_idle: fraction of the window the learner waited for a
        batch / the average server had no live slot.
      admission_idle: slot-seconds with nothing to run or queued while admission was
        refused (capacity or ``stale_policy="pace"``) / (K x window): how much the
        staleness bound stalls generation.
      train_s_per_sample: learner train seconds per trained sample.
      len_mean, len_max: response tokens of the trained samples.
      mu_gen_s, l_gen_s: mean / longest in-slot seconds of the trained samples.
      bound_s_per_sample: μ_gen/K + L_gen/Q.
      outcomes: the ledger's prompt outcomes; counters: the scheduler's.
      lengths_trained, rewards_trained: response tokens and reward of every sample
        trained (all steps, warm-up included); lengths_started, rewards_started: of
        every sample of every prompt admitted (what the policy was asked for,
        trained or not): the reference a staleness policy's bias is read against.
      trace: per step (taken_at, train_end, sync_end, prompt ids): for determinism.
    """

    trained_samples: int
    window_s: float
    samples_per_s: float
    step_s: float
    occupancy: float
    staleness_mean: float
    staleness_max: int
    learner_idle: float
    gen_idle: float
    train_s_per_sample: float
    len_mean: float
    len_max: int
    mu_gen_s: float
    l_gen_s: float
    bound_s_per_sample: float
    replayed_samples: int
    admission_idle: float
    outcomes: dict[str, dict[str, int]]
    counters: dict[str, int]
    trace: tuple[tuple[float, float, float, tuple[int, ...]], ...]
    lengths_trained: tuple[int, ...] = ()
    rewards_trained: tuple[float, ...] = ()
    lengths_started: tuple[int, ...] = ()
    rewards_started: tuple[float, ...] = ()

    @property
    def s_per_sample(self) -> float:
        return self.window_s / max(self.trained_samples, 1)


def roll_flash_bound(
    mu_gen_s: float, l_gen_s: float, *, slots: int, samples: int, async_ratio: int
) -> float:
    """μ_gen/K + L_gen/Q with Q = (α+1)·N: seconds per sample (arXiv 2510.11345).

    Raises:
      ValueError: slots or samples < 1, or α < 0.
    """
    if slots < 1 or samples < 1 or async_ratio < 0:
        raise ValueError(
            f"roll_flash_bound: need slots, samples >= 1 and α >= 0; got {slots}, {samples}, "
            f"{async_ratio}"
        )
    return mu_gen_s / slots + l_gen_s / ((async_ratio + 1) * samples)


def _overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def summarize(
    config: Any,
    records: list,
    snapshots: dict,
    learner: Any,
    servers: list,
    sched: Any,
    ledger: Any,
    *,
    started: tuple[tuple[int, ...], tuple[float, ...]] = ((), ()),
) -> SimResult:
    """Builds the SimResult of a finished ``driver.simulate`` run.

    ``snapshots``: version -> (clock, server stats, starved slot-seconds so far);
    ``started``: (lengths, rewards) of every sample of every prompt admitted.
    """
    w = config.warmup_steps
    measured = records[w:]
    start = records[w - 1].train_end if w else (sched.watch.first_request_at or 0.0)
    end = records[-1].train_end
    window = max(end - start, 1e-12)
    t0, s0, starved0 = snapshots[w]
    t1, s1, starved1 = snapshots[config.steps]
    live = sum(b["live_slot_s"] - a["live_slot_s"] for a, b in zip(s0, s1, strict=True))
    busy = sum(b["busy_s"] - a["busy_s"] for a, b in zip(s0, s1, strict=True))
    trained = sum(r.trained for r in measured)
    stale = np.concatenate([np.asarray(r.staleness, float) for r in measured] or [np.zeros(0)])
    lens = np.concatenate([np.asarray(r.lengths, float) for r in measured] or [np.zeros(0)])
    gen = np.concatenate([np.asarray(r.gen_s, float) for r in measured] or [np.zeros(0)])
    mu, longest = (float(gen.mean()), float(gen.max())) if gen.size else (0.0, 0.0)
    N = config.batch_prompts * config.group_size
    learner_busy = _overlap(learner.busy_intervals, start, end)
    train_s = sum(r.train_end - r.taken_at for r in measured)
    return SimResult(
        trained_samples=int(trained),
        window_s=float(window),
        samples_per_s=trained / window,
        step_s=window / max(len(measured), 1),
        occupancy=live / (config.slots * window),
        staleness_mean=float(stale.mean()) if stale.size else 0.0,
        staleness_max=int(stale.max()) if stale.size else 0,
        learner_idle=max(0.0, 1.0 - learner_busy / window),
        gen_idle=max(0.0, 1.0 - busy / (config.servers * window)),
        train_s_per_sample=train_s / max(trained, 1),
        len_mean=float(lens.mean()) if lens.size else 0.0,
        len_max=int(lens.max()) if lens.size else 0,
        mu_gen_s=mu,
        l_gen_s=longest,
        bound_s_per_sample=roll_flash_bound(
            mu, longest, slots=config.slots, samples=N, async_ratio=config.async_ratio
        ),
        replayed_samples=sum(r.replayed for r in measured),
        admission_idle=(starved1 - starved0) / (config.slots * window),
        outcomes={k: dict(v) for k, v in ledger.outcomes.items()},
        counters={k: int(v) for k, v in sorted(sched.watch.counters.items())},
        trace=tuple((r.taken_at, r.train_end, r.sync_end, tuple(r.groups)) for r in records),
        lengths_trained=tuple(n for r in records for n in r.lengths),
        rewards_trained=tuple(x for r in records for x in r.rewards),
        lengths_started=started[0],
        rewards_started=started[1],
    )
