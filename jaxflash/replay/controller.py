"""Adaptive scheduler for the dual replay cycle: a pure, clock-free controller.

ReFlow (arXiv 2610.21640) adapts its generation strategy and resource allocation
to measured throughput; its rules are not published, so these are ours, built
on ROLL Flash's analysis (arXiv 2510.11345: keep both sides busy; the async
ratio alpha buys overlap at the cost of staleness) and on the ESS view of replay
(FreshPER, arXiv 2604.16918: replayed data is worth less as ESS falls).

Each learner step the runtime measures and passes ``ControllerInputs``; the
controller returns a ``Decision``. Rates are smoothed (EMA, reset after a device
move, since they describe the old layout). With fresh demand
d = train_rate * (1 - rho) and supply ratio q = gen_rate / d:

- generation-bound: q < 1 - balance_margin and the queue holds at most one
  step of fresh samples;
- training-bound: q > 1 + balance_margin, or the queue holds more than
  ``queue_high`` steps of fresh samples;
- ess_low: the replay cycle's ESS < ess_min; stale_high: mean staleness >
  staleness_target (when set).

Rules (each step, one increment at most per knob):

- replay ratio rho (steps of ``replay_step``, within [0, max_replay_ratio]):
  up when gen-bound and not ess_low; down when train-bound or ess_low.
- async ratio alpha (steps of 1, within [0, max_async_ratio]): up when
  gen-bound, not ess_low and not stale_high; down when train-bound, ess_low or
  stale_high.
- generation devices (steps of ``device_quantum``, within the floors): up after
  ``move_patience`` consecutive gen-bound steps, down after as many train-bound.
- requests in flight = (alpha + 1) * fresh per step, fresh per step =
  G * max(1, round((1 - rho) * batch_samples / G)) (whole groups of G =
  ``group_size``, as ``replay.dual_cycle.fresh_groups_needed``): up with alpha,
  down with rho.

So, input by input: a higher generation rate (relative to training) lowers rho,
alpha and the generation share; a higher training rate or a shorter queue raises
them; a longer queue lowers them; higher staleness lowers alpha; lower ESS lowers
rho and alpha. Devices move at least ``move_patience`` steps apart, and only
after that many consecutive steps bound the same way (hysteresis). A
``FixedSchedule`` has the same interface for ablations.

Applied vs proposed: the runtime applies rho, alpha and the requests in flight at
the next step boundary (``runtime.control.replay_cycle``), and the role split too when the
elastic pool is on (``controller.elastic``, ``runtime.control.elastic``); it reports the
split actually in force through ``applied``. A proposed move that was not applied
(elastic off) leaves the controller on the old split without resetting its rate
averages (nothing moved), and the proposal is logged as ``ctl_proposed_*``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

from jaxflash.replay.dual_cycle import fresh_groups_needed


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerInputs:
    """What the runtime measured over the last learner step.

    Attributes:
      step: learner step (policy version) the decision is for.
      gen_rate: fresh samples delivered by generation per second (> = 0).
      train_rate: samples the learner trains per second of training (> 0).
      queue_depth: scored samples waiting for the learner.
      staleness_mean: mean staleness (versions) of the fresh samples trained.
      ess: normalised ESS of the replay cycle, in (0, 1]; None when nothing was replayed.
    """

    step: int
    gen_rate: float
    train_rate: float
    queue_depth: int
    staleness_mean: float
    ess: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gen_rate) and self.gen_rate >= 0):
            raise ValueError(
                f"ControllerInputs.gen_rate must be finite and >= 0, got {self.gen_rate}"
            )
        if not (math.isfinite(self.train_rate) and self.train_rate > 0):
            raise ValueError(
                f"ControllerInputs.train_rate must be finite and > 0, got {self.train_rate}"
            )
        if self.queue_depth < 0:
            raise ValueError(f"ControllerInputs.queue_depth must be >= 0, got {self.queue_depth}")
        if self.ess is not None and not 0 < self.ess <= 1 + 1e-9:
            raise ValueError(f"ControllerInputs.ess must be in (0, 1], got {self.ess}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """Settings for the next step.

    Attributes:
      replay_ratio: rho in [0, 1), the replayed share of the learner batch.
      async_ratio: alpha >= 0, the per-sample staleness bound.
      requests_in_flight: generation requests to keep outstanding.
      learner_devices, generation_devices: the role split of the device pool.
    """

    replay_ratio: float
    async_ratio: int
    requests_in_flight: int
    learner_devices: int
    generation_devices: int


class Controller(Protocol):
    """What the runtime calls: ``update`` once per step, ``metrics`` to log it."""

    def update(self, inputs: ControllerInputs) -> Decision: ...
    def metrics(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...


def _inputs_metrics(x: ControllerInputs | None) -> dict[str, Any]:
    if x is None:
        return {}
    return {f"ctl_in_{k}": v for k, v in dataclasses.asdict(x).items() if v is not None}


def _decision_metrics(d: Decision) -> dict[str, Any]:
    return {f"ctl_{k}": v for k, v in dataclasses.asdict(d).items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerKnobs:
    """The adaptive controller's gains and bounds that a user sets (``controller.*`` in a
    config; their one definition and default: ``ControllerConfig`` and the config's
    ``ControllerSpec`` both extend this).

    Attributes:
      max_replay_ratio: largest rho, < 1. replay_step: rho increment.
      ess_min: replay-cycle ESS below which rho and alpha go down.
      staleness_target: mean staleness above which alpha goes down (None: off).
      balance_margin: |q - 1| within which the two sides count as balanced.
      queue_high: queue depth, in steps of fresh samples, that means training-bound
        (>= 1: a generation-bound step has at most one step queued).
      smoothing: EMA weight of the newest rate measurement, in (0, 1].
      move_patience: consecutive same-bound steps before, and steps between, moves.
    """

    max_replay_ratio: float = 0.75
    replay_step: float = 0.125
    ess_min: float = 0.5
    staleness_target: float | None = None
    balance_margin: float = 0.15
    queue_high: float = 2.0
    smoothing: float = 0.5
    move_patience: int = 3

    def knobs(self) -> dict[str, Any]:
        """These fields and their values (what ``ControllerConfig`` is built with)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ControllerKnobs)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig(ControllerKnobs):
    """Bounds and gains of ``AdaptiveController`` (validated eagerly).

    Attributes:
      batch_samples: learner batch size in samples (B * G).
      max_async_ratio: the user's maximum alpha.
      group_size: G, samples per prompt (fresh samples come in whole groups);
        must divide batch_samples.
      device_quantum: devices moved at once (one generation slice).
      min_learner_devices, min_generation_devices: floors of the role split.
      max_replay_ratio, replay_step, ess_min, staleness_target, balance_margin,
        queue_high, smoothing, move_patience: ``ControllerKnobs``.
    """

    batch_samples: int
    max_async_ratio: int
    group_size: int = 1
    device_quantum: int = 1
    min_learner_devices: int = 1
    min_generation_devices: int = 1

    def __post_init__(self) -> None:
        checks = {
            "batch_samples": self.batch_samples >= 1,
            "group_size": self.group_size >= 1 and self.batch_samples % self.group_size == 0,
            "max_async_ratio": self.max_async_ratio >= 0,
            "max_replay_ratio": 0 <= self.max_replay_ratio < 1,
            "replay_step": 0 < self.replay_step <= 1,
            "ess_min": 0 <= self.ess_min <= 1,
            "balance_margin": 0 <= self.balance_margin < 1,
            "queue_high": self.queue_high >= 1,
            "smoothing": 0 < self.smoothing <= 1,
            "device_quantum": self.device_quantum >= 1,
            "min_learner_devices": self.min_learner_devices >= 1,
            "min_generation_devices": self.min_generation_devices >= 1,
            "move_patience": self.move_patience >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"ControllerConfig: out of range: {[(k, getattr(self, k)) for k in bad]}"
            )


def in_flight_for(
    async_ratio: int, replay_ratio: float, batch_samples: int, group_size: int = 1
) -> int:
    """Requests to keep outstanding: (alpha + 1) * fresh samples per step.

    Fresh samples per step = G * fresh_groups_needed(batch_samples / G, rho), G =
    ``group_size`` (= max(1, round((1 - rho) * batch)) for G = 1).
    """
    groups = fresh_groups_needed(batch_samples // group_size, replay_ratio)
    return (async_ratio + 1) * groups * group_size


class AdaptiveController:
    """The rules in the module docstring; ``update`` is a function of its state and inputs.

    Args:
      config: bounds and gains.
      initial: the starting decision (its ``requests_in_flight`` is recomputed
        from its alpha and rho).

    Raises:
      ValueError: an initial decision outside the config's bounds.
    """

    def __init__(self, config: ControllerConfig, initial: Decision):
        c = config
        if not 0 <= initial.async_ratio <= c.max_async_ratio:
            raise ValueError(
                f"initial async_ratio {initial.async_ratio} outside [0, {c.max_async_ratio}]"
            )
        if not 0 <= initial.replay_ratio <= c.max_replay_ratio:
            raise ValueError(
                f"initial replay_ratio {initial.replay_ratio} outside [0, {c.max_replay_ratio}]"
            )
        if initial.learner_devices < c.min_learner_devices or (
            initial.generation_devices < c.min_generation_devices
        ):
            raise ValueError(
                f"initial split {initial.learner_devices} learner / "
                f"{initial.generation_devices} generation is below the floors "
                f"{c.min_learner_devices} / {c.min_generation_devices}"
            )
        self.config = config
        self._decision = dataclasses.replace(
            initial,
            requests_in_flight=in_flight_for(
                initial.async_ratio, initial.replay_ratio, c.batch_samples, c.group_size
            ),
        )
        self._proposed = self._decision
        self._unmoved: tuple[Any, ...] | None = None  # state before a proposed move
        self._gen_rate: float | None = None
        self._train_rate: float | None = None
        self._streak = 0  # > 0: consecutive generation-bound steps, < 0: training-bound
        self._last_move: int | None = None
        self._inputs: ControllerInputs | None = None
        self._flags: dict[str, Any] = {}

    @property
    def decision(self) -> Decision:
        return self._decision

    def _smooth(self, old: float | None, new: float) -> float:
        return (
            new if old is None else self.config.smoothing * new + (1 - self.config.smoothing) * old
        )

    def update(self, inputs: ControllerInputs) -> Decision:
        """Fold in one step's measurements and return the settings for the next step."""
        c, d = self.config, self._decision
        self._gen_rate = self._smooth(self._gen_rate, inputs.gen_rate)
        self._train_rate = self._smooth(self._train_rate, inputs.train_rate)
        fresh_per_step = max(1, int(round((1.0 - d.replay_ratio) * c.batch_samples)))
        supply = self._gen_rate / (self._train_rate * (1.0 - d.replay_ratio))
        backlog = inputs.queue_depth / fresh_per_step
        gen_bound = supply < 1 - c.balance_margin and backlog <= 1.0
        train_bound = supply > 1 + c.balance_margin or backlog > c.queue_high
        ess_low = inputs.ess is not None and inputs.ess < c.ess_min
        stale_high = c.staleness_target is not None and inputs.staleness_mean > c.staleness_target

        rho, alpha = d.replay_ratio, d.async_ratio
        if gen_bound and not ess_low:
            rho = min(c.max_replay_ratio, rho + c.replay_step)
        elif train_bound or ess_low:
            rho = max(0.0, rho - c.replay_step)
        if gen_bound and not (ess_low or stale_high):
            alpha = min(c.max_async_ratio, alpha + 1)
        elif train_bound or ess_low or stale_high:
            alpha = max(0, alpha - 1)

        self._streak = (
            max(self._streak, 0) + 1
            if gen_bound
            else min(self._streak, 0) - 1
            if train_bound
            else 0
        )
        learner, gen = d.learner_devices, d.generation_devices
        rested = self._last_move is None or inputs.step - self._last_move >= c.move_patience
        moved = 0
        if (
            rested
            and self._streak >= c.move_patience
            and learner - c.device_quantum >= c.min_learner_devices
        ):
            moved = c.device_quantum  # learner -> generation
        elif (
            rested
            and -self._streak >= c.move_patience
            and gen - c.device_quantum >= c.min_generation_devices
        ):
            moved = -c.device_quantum  # generation -> learner
        self._unmoved = None
        if moved:
            learner, gen = learner - moved, gen + moved
            self._unmoved = (self._gen_rate, self._train_rate, self._last_move)
            self._last_move, self._streak = inputs.step, 0
            self._gen_rate = self._train_rate = None  # measured on the old layout

        self._decision = Decision(
            replay_ratio=rho,
            async_ratio=alpha,
            requests_in_flight=in_flight_for(alpha, rho, c.batch_samples, c.group_size),
            learner_devices=learner,
            generation_devices=gen,
        )
        self._proposed = self._decision
        self._inputs = inputs
        self._flags = {
            "ctl_supply_ratio": supply,
            "ctl_generation_bound": gen_bound,
            "ctl_training_bound": train_bound,
            "ctl_ess_low": ess_low,
            "ctl_stale_high": stale_high,
            "ctl_devices_moved_to_generation": moved,
        }
        return self._decision

    def applied(self, decision: Decision) -> None:
        """What the runtime put in force after the last ``update`` (its role split is
        the old one unless the elastic pool moved the devices).

        The controller continues from ``decision``. A proposed move that was not
        applied does not count as a move: the rate averages and the time of the
        last move are restored (the streak stays reset, so the proposal comes back
        after ``move_patience`` more steps bound the same way).

        Raises:
          ValueError: rho, alpha or requests in flight other than proposed (only
            the role split may differ).
        """
        p = self._proposed
        kept = ("replay_ratio", "async_ratio", "requests_in_flight")
        if any(getattr(decision, k) != getattr(p, k) for k in kept):
            raise ValueError(f"applied decision {decision} changes more than the split of {p}")
        split = (decision.learner_devices, decision.generation_devices)
        if self._unmoved is not None and split != (p.learner_devices, p.generation_devices):
            self._gen_rate, self._train_rate, self._last_move = self._unmoved
        self._unmoved = None
        self._decision = decision

    def metrics(self) -> dict[str, Any]:
        """The last update's inputs (``ctl_in_*``), flags, the decision in force (``ctl_*``)
        and the proposed role split (``ctl_proposed_learner_devices`` /
        ``ctl_proposed_generation_devices``; differs from ``ctl_*`` when a move was not
        applied)."""
        p = self._proposed
        return {
            **_inputs_metrics(self._inputs),
            **self._flags,
            **_decision_metrics(self._decision),
            "ctl_proposed_learner_devices": p.learner_devices,
            "ctl_proposed_generation_devices": p.generation_devices,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; ``load_state_dict`` resumes the same decisions."""
        return {
            "decision": dataclasses.asdict(self._decision),
            "gen_rate": self._gen_rate,
            "train_rate": self._train_rate,
            "streak": self._streak,
            "last_move": self._last_move,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._decision = self._proposed = Decision(**state["decision"])
        self._gen_rate, self._train_rate = state["gen_rate"], state["train_rate"]
        self._streak, self._last_move = int(state["streak"]), state["last_move"]


class FixedSchedule:
    """A controller that ignores its inputs: decision by step, for ablations.

    Args:
      schedule: (from_step, Decision) pairs, from_step ascending, the first 0;
        the decision for step s is the last one with from_step <= s.
    """

    def __init__(self, schedule: Sequence[tuple[int, Decision]]):
        steps = [s for s, _ in schedule]
        if not steps or steps[0] != 0 or steps != sorted(set(steps)):
            raise ValueError(f"FixedSchedule: from_steps must start at 0 and increase, got {steps}")
        self._schedule = list(schedule)
        self._decision = self._schedule[0][1]
        self._inputs: ControllerInputs | None = None

    def update(self, inputs: ControllerInputs) -> Decision:
        self._decision = [d for s, d in self._schedule if s <= inputs.step][-1]
        self._inputs = inputs
        return self._decision

    def metrics(self) -> dict[str, Any]:
        return {**_inputs_metrics(self._inputs), **_decision_metrics(self._decision)}

    def state_dict(self) -> dict[str, Any]:
        return {}
