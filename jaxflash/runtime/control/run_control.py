"""The control room's door: what the loop asks of control around each learner step.

``RunControl`` holds the run's replay cycle (``control.replay_cycle``), its step
controller (``control.step_control``) and its elastic pool (``control.elastic``), each
None when the config has none, so the loop asks without asking which:

- ``fresh_prompts`` / ``async_ratio``: B and alpha in force at the start;
- ``mix``: the step's training batch (the fresh rows, plus the replayed ones at rho);
  the replay cycle reports its metrics to the step's tracker;
- ``end_step``: the typed plan for the next step put in force (``after_step``; None:
  the settings stand), the elastic move made when its role split changed, both
  reported to the tracker;
- ``checkpoint_state``: what a checkpoint keeps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxflash.runtime.control.elastic import ElasticPool, make_elastic
from jaxflash.runtime.control.replay_cycle import make_replay_cycle
from jaxflash.runtime.control.step_control import StepPlan, StepReport, make_step_control
from jaxflash.runtime.fleet.placement import Placement
from jaxflash.runtime.workloads.learner_batch import LearnerBatch
from jaxflash.types import TrainBatch


class RunControl:
    """The replay cycle, the step controller and the elastic pool of one run.

    Args:
      replay, controller, rollout, mesh: the experiment's sections (``exp.replay``, ...).
      seed: the experiment's seed (the replay buffer's sampling).
      placement: the run's placement (the role split at the start).
      extra: the checkpoint metadata's ``extra`` ({} on a fresh start): a resumed run
        continues the checkpoint's buffer, decision and elastic counts.
    """

    def __init__(
        self,
        *,
        replay: Any,
        controller: Any,
        rollout: Any,
        mesh: Any,
        seed: int,
        placement: Placement,
        extra: dict[str, Any],
    ):
        self._controller, self._rollout, self._mesh = controller, rollout, mesh
        self._placement, self._extra = placement, extra
        sections = dict(replay=replay, controller=controller, rollout=rollout)
        self.cycle = make_replay_cycle(**sections, seed=seed, extra=extra)
        self.steps = make_step_control(
            **sections,
            mesh=mesh,
            learner_devices=int(placement.learner.devices.size),
            generation_devices=sum(int(m.devices.size) for m in placement.generation),
            extra=extra,
        )
        self.elastic: ElasticPool | None = None
        self._scheduler: Any = None  # the rollout (``attach``)
        self.rows = 0  # samples carrying loss in the last ``mix``

    @property
    def fresh_prompts(self) -> int:
        """Fresh groups per learner batch in force (B without a step controller)."""
        return self.steps.fresh_prompts if self.steps else self._rollout.prompts_per_step

    @property
    def async_ratio(self) -> int:
        """alpha in force (``rollout.async_ratio`` without a step controller)."""
        return self.steps.decision.async_ratio if self.steps else self._rollout.async_ratio

    def attach(self, *, learner: Any, fleet: Any, scheduler: Any) -> None:
        """Build the elastic pool (``controller.elastic``) over the run's learner and fleet
        (which tells the rollout); a resumed run moves to its checkpoint's split here.
        ``scheduler``: the rollout the plan reconfigures."""
        self._scheduler = scheduler
        d = self.steps.decision if self.steps else None
        self.elastic = make_elastic(
            controller=self._controller, mesh=self._mesh, learner=learner, fleet=fleet,
            placement=self._placement, extra=self._extra,
            learner_devices=d.learner_devices if d else None,
        )  # fmt: skip

    def mix(
        self,
        lb: LearnerBatch,
        tracker: Any,
        *,
        learner_version: int,
        pad_id: int,
        max_len: int,
        length_multiple: int = 32,
    ) -> TrainBatch | None:
        """The step's training batch (None: nothing carries loss); reports the replay
        cycle's metrics as the ``replay`` section (none without replay) and keeps
        ``rows``, the samples that carry loss (fresh + replayed)."""
        if self.cycle is None:
            batch, metrics = lb.batch, {}
        else:
            batch, metrics = self.cycle.step_batch(
                lb, learner_version=learner_version, replay_ratio=self.steps.replay_ratio,
                pad_id=pad_id, max_len=max_len, length_multiple=length_multiple,
            )  # fmt: skip
        self.rows = len(lb.samples) + metrics.get("cycle_replay_samples", 0)
        tracker.report("replay", metrics)
        return batch

    def after_step(self, report: StepReport) -> StepPlan | None:
        """The plan in force from the next step (None without a step controller): rho,
        alpha, the requests in flight and, with the elastic pool, the role split
        (devices move here)."""
        if self.steps is None:
            return None
        move = self.elastic.move_to if self.elastic is not None else None
        return self.steps.after_step(report, move=move)

    def end_step(
        self, tracker: Any, *, next_version: int, progress: tuple[int, int], step_s: float,
        train_s: float, staleness: np.ndarray, learner_metrics: dict[str, Any],
    ) -> None:  # fmt: skip
        """Put the next step's plan in force (``after_step`` on the step's report): the
        scheduler reconfigured (rho, alpha, requests in flight; ``fresh_prompts``
        follows); reports the ``control`` (``ctl_*``) and ``elastic`` sections.

        Args:
          next_version: the version the next step trains at.
          progress: ``RolloutScheduler.progress()`` before the publish (samples
            generated, groups pending).
          step_s, train_s: the step's and the update's seconds.
          staleness: int [fresh samples trained] (``LearnerBatch.staleness``).
          learner_metrics: the update's (``learner_batch.learner_metrics``).
        """
        generated, pending = progress
        plan = self.after_step(StepReport.measure(  # None without a step controller
            next_version=next_version, samples_generated=generated,
            queue_samples=pending * self._rollout.group_size, step_s=step_s,
            train_s=train_s, staleness=staleness, learner_metrics=learner_metrics,
        ))  # fmt: skip
        if plan is not None:  # in force from the next step
            tracker.report("control", plan.metrics)
            self._scheduler.reconfigure(**dataclasses.asdict(plan.scheduler))
        tracker.report("elastic", self.elastic_metrics())

    def elastic_metrics(self) -> dict[str, Any]:
        """The elastic pool's per-step metrics ({} without it); once per step."""
        return self.elastic.step_metrics() if self.elastic is not None else {}

    def checkpoint_state(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(the replay cycle's and step controller's state, the elastic pool's), each
        None when off (``resume.checkpoint_meta``'s replay and elastic)."""
        replay = {**self.cycle.state_dict(), **self.steps.state_dict()} if self.cycle else None
        return replay, (self.elastic.state_dict() if self.elastic is not None else None)
