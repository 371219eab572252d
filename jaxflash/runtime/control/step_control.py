"""The step controller: after each learner step, a typed report in, a typed plan out.

ReFlow's adaptive scheduler (arXiv 2610.21640; built from the nearest published
mechanisms, ``replay.controller``) decides, from what the last step measured, the
next step's replay ratio rho, staleness bound alpha, requests in flight and the
learner / generation role split. ``StepControl`` owns that decision and the
controller that makes it (adaptive, a fixed schedule, or none: the config's values
every step). The loop calls, once per step,

    plan = control.after_step(StepReport(...), move=elastic.move_to or None)

and applies the plan: ``scheduler.reconfigure(plan.scheduler)`` (alpha and the
admission capacity), ``plan.fresh_prompts`` fresh groups next step, and rho for
the replay cycle's mix (``control.replay_ratio``). A different role split is handed
to ``move`` (the elastic pool moves generation slices; it returns the learner size
in force), and the controller is told the split actually in force; without
``move`` the split is only proposed (``ctl_proposed_*``).

``state_dict`` (the controller's state and the decision in force) goes into the
checkpoint next to the replay buffer's; a resumed run decides exactly as an
uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxflash.replay.controller import (
    AdaptiveController,
    ControllerInputs,
    Decision,
    in_flight_for,
)
from jaxflash.replay.dual_cycle import fresh_groups_needed
from jaxflash.runtime.config.elastic_spec import floors as elastic_floors
from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec, replay_active
from jaxflash.runtime.control.controller_setup import make_controller


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one learner step measured: the step controller's inputs.

    Attributes:
      next_version: learner version the next step trains at (the decision's step).
      samples_generated: the scheduler's cumulative count of generated samples.
      step_s: the step's wall time (s).
      train_s: the update's wall time (s).
      trained_samples: rows that carried loss (fresh + replayed; 0: nothing trained).
      queue_samples: scored samples waiting for the learner.
      staleness_mean: mean staleness (versions) of the fresh samples trained.
      replay_ess: the replay cycle's normalised token ESS in (0, 1], None when nothing
        was replayed.
    """

    next_version: int
    samples_generated: int
    step_s: float
    train_s: float
    trained_samples: int
    queue_samples: int
    staleness_mean: float
    replay_ess: float | None

    @classmethod
    def measure(
        cls,
        *,
        next_version: int,
        samples_generated: int,
        queue_samples: int,
        step_s: float,
        train_s: float,
        staleness: np.ndarray,
        learner_metrics: dict[str, Any],
    ) -> StepReport:
        """A step's report from its raw measures: ``staleness`` int [fresh samples
        trained] (versions); of the learner's metrics, the rows that carried loss
        ("sequences"; none on a skipped step) and the replay ESS ("replay_ess_token")."""
        return cls(
            next_version=next_version, samples_generated=samples_generated, step_s=step_s,
            train_s=train_s, trained_samples=int(learner_metrics.get("sequences", 0)),
            queue_samples=queue_samples,
            staleness_mean=float(staleness.mean()) if staleness.size else 0.0,
            replay_ess=learner_metrics.get("replay_ess_token"),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
    """``RolloutScheduler.reconfigure``'s arguments for the next step.

    Attributes:
      batch_prompts: fresh groups per learner batch.
      async_ratio: alpha, the staleness bound (versions).
      prompts_in_flight: admission capacity in prompts (ceil(requests / G), at least
        ``batch_prompts``).
    """

    batch_prompts: int
    async_ratio: int
    prompts_in_flight: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What the loop puts in force for the next step.

    Attributes:
      scheduler: the scheduler's settings.
      fresh_prompts: fresh groups the next batch takes from the servers.
      replay_ratio: rho of the next step's mix.
      learner_devices: the learner's size in force (after any elastic move).
      metrics: the controller's ``ctl_*`` metrics ({} without a controller, or on a
        step that trained nothing: the decision stands).
    """

    scheduler: SchedulerSettings
    fresh_prompts: int
    replay_ratio: float
    learner_devices: int
    metrics: dict[str, Any]


class StepControl:
    """The decision in force and the controller that updates it (module docstring).

    Args:
      replay, controller: the config sections.
      batch_prompts: ``rollout.prompts_per_step`` B.
      group_size: G.
      async_ratio: the run's alpha (the adaptive controller's maximum).
      learner_devices, generation_devices: the role split at the start.
      state: ``state_dict()`` from a checkpoint (None: a fresh start).
      samples_generated: the scheduler's ``samples_generated`` at the start.
      device_floors: with elastic moves, the adaptive controller's device_quantum,
        min_learner_devices and min_generation_devices; None: its defaults.
    """

    def __init__(
        self,
        replay: ReplaySpec,
        controller: ControllerSpec,
        *,
        batch_prompts: int,
        group_size: int,
        async_ratio: int,
        learner_devices: int,
        generation_devices: int,
        state: dict[str, Any] | None = None,
        samples_generated: int = 0,
        device_floors: dict[str, int] | None = None,
    ):
        self.batch_prompts, self.group_size = batch_prompts, group_size
        batch_samples = batch_prompts * group_size
        self._decision = Decision(
            replay_ratio=replay.ratio,
            async_ratio=async_ratio,
            requests_in_flight=in_flight_for(async_ratio, replay.ratio, batch_samples, group_size),
            learner_devices=learner_devices,
            generation_devices=generation_devices,
        )
        self._controller = make_controller(
            controller,
            replay,
            self._decision,
            batch_samples=batch_samples,
            group_size=group_size,
            device_floors=device_floors,
            state=(state or {}).get("controller"),
        )
        if state:
            self._decision = Decision(**state["decision"])
        self._generated_before = int(samples_generated)

    @property
    def decision(self) -> Decision:
        """The settings in force for the next step (the controller's, as applied)."""
        return self._decision

    @property
    def replay_ratio(self) -> float:
        """rho of the next step (the controller's last decision, or replay.ratio)."""
        return self._decision.replay_ratio

    @property
    def fresh_prompts(self) -> int:
        """Fresh groups of the next step: the B groups of the batch minus rho's share."""
        return fresh_groups_needed(self.batch_prompts, self._decision.replay_ratio)

    def plan(self, metrics: dict[str, Any] | None = None) -> StepPlan:
        """The decision in force as a plan (``after_step`` returns it updated)."""
        d, G = self._decision, self.group_size
        fresh = self.fresh_prompts
        return StepPlan(
            scheduler=SchedulerSettings(
                batch_prompts=fresh,
                async_ratio=d.async_ratio,
                prompts_in_flight=max(fresh, -(-d.requests_in_flight // G)),
            ),
            fresh_prompts=fresh,
            replay_ratio=d.replay_ratio,
            learner_devices=d.learner_devices,
            metrics=dict(metrics or {}),
        )

    def after_step(
        self, report: StepReport, *, move: Callable[[int], int] | None = None
    ) -> StepPlan:
        """Feed the controller one step's report; its decision is the next step's plan.

        Args:
          report: what the step measured.
          move: the elastic pool's ``move_to`` (wanted learner devices -> learner
            devices in force); None: a different split is only proposed.

        Returns:
          the plan in force from the next step (unchanged without a controller, and on
          a step that trained nothing: there is no training rate to measure).
        """
        before, self._generated_before = self._generated_before, report.samples_generated
        if self._controller is None or report.trained_samples < 1:
            return self.plan()
        kept = self._decision
        inputs = ControllerInputs(
            step=report.next_version,
            gen_rate=max(report.samples_generated - before, 0) / max(report.step_s, 1e-9),
            train_rate=report.trained_samples / max(report.train_s, 1e-9),
            queue_depth=max(int(report.queue_samples), 0),
            staleness_mean=float(report.staleness_mean),
            ess=None if report.replay_ess is None else min(max(report.replay_ess, 1e-12), 1.0),
        )
        proposed = self._controller.update(inputs)
        learner = kept.learner_devices
        if move is not None and proposed.learner_devices != learner:
            learner = int(move(proposed.learner_devices))  # the elastic pool moves devices
        self._decision = dataclasses.replace(
            proposed,
            learner_devices=learner,
            generation_devices=kept.learner_devices + kept.generation_devices - learner,
        )
        if isinstance(self._controller, AdaptiveController):
            self._controller.applied(self._decision)
        return self.plan(self._controller.metrics())

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the controller's state and the decision in force."""
        return {
            "controller": self._controller.state_dict() if self._controller else {},
            "decision": dataclasses.asdict(self._decision),
        }


def make_step_control(
    *,
    replay: Any,
    controller: Any,
    rollout: Any,
    mesh: Any,
    learner_devices: int,
    generation_devices: int,
    extra: dict[str, Any],
) -> StepControl | None:
    """The run's StepControl (None when the config has no replay cycle and no controller).

    Args:
      replay, controller, rollout, mesh: the experiment's sections (``exp.replay``, ...).
      learner_devices, generation_devices: the placement's role split.
      extra: the checkpoint metadata's ``extra`` ({} on a fresh start): its "replay"
        entry restores the decision and the controller, "counters" the generation count.
    """
    if not replay_active(replay, controller):
        return None
    floors = None
    if controller.elastic:  # one slice at a time, within the elastic pool's floors
        min_learner, slice_size = elastic_floors(mesh)
        floors = {
            "device_quantum": slice_size,
            "min_learner_devices": min_learner,
            "min_generation_devices": slice_size,
        }
    return StepControl(
        replay,
        controller,
        batch_prompts=rollout.prompts_per_step,
        group_size=rollout.group_size,
        async_ratio=rollout.async_ratio,
        learner_devices=learner_devices,
        generation_devices=generation_devices,
        state=extra.get("replay"),
        samples_generated=int(extra.get("counters", {}).get("samples_generated", 0)),
        device_floors=floors,
    )
