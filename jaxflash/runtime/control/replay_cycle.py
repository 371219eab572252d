"""The dual replay cycle inside the RLVR loop: buffer, composer, controller and its decisions.

ReFlow (arXiv 2610.21640) mixes every learner batch from a fresh cycle (samples
from the generation servers, trained once: the alpha-bounded path) and a replay
cycle (recent trajectories drawn again from a buffer) at a replay ratio rho. The
loop (``runtime.loop``) builds one ``ReplayCycle`` when the config has a replay
cycle (``replay_spec.replay_active``) and calls, per learner step:

1. ``mix`` with the fresh samples that carry loss and their advantages: draws the
   replay cycle at this step's rho *before* storing the fresh samples (a sample
   is never replayed in the step it is trained fresh), packs fresh rows first,
   then replayed ones, padded to a fixed row count (one compiled step), with
   each row's cycle in ``TrainBatch.cycle_bt`` (0 fresh, 1 replay). Replayed
   samples keep their stored behaviour logprobs and per-token versions, so the
   learner's ratios for them are taken against the policy that generated them.
   The learner step (``learner.cycles``) applies the fresh loss to fresh rows and
   ``replay.correction`` to replayed ones, and reports importance ratios
   w = pi_theta / mu and ESS per cycle from its own forward pass.
2. ``control`` after the update: the controller's inputs (generation and
   training rates, queue depth, staleness, replay ESS) and decision, as
   ``ctl_*`` metrics. The decision is in force from the next step on: its rho
   sets the fresh groups (round((1 - rho) B)) and the replayed samples of the
   step, and the loop hands its alpha and requests in flight to the scheduler
   (``scheduler_settings`` -> ``RolloutScheduler.reconfigure``: staleness bound
   and admission capacity). A change of role split is carried out by the
   elastic pool when ``controller.elastic`` (``runtime.control.elastic``: generation
   slices join or leave the learner at this step boundary), and otherwise only
   proposed (``ctl_proposed_*``).

``state_dict`` (buffer contents, counters, the sampler's RNG, the controller's
state and current decision) goes into the checkpoint's metadata; a
``ReplayCycle`` built with it draws exactly what the uninterrupted one would.

With rho = 0 and no controller there is no ``ReplayCycle``: the loop is exactly
the one without replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxflash.learner.batching import pack_batch
from jaxflash.replay.controller import (
    AdaptiveController,
    ControllerInputs,
    Decision,
    in_flight_for,
)
from jaxflash.replay.dual_cycle import (
    DualCycleComposer,
    DualCycleConfig,
    fresh_groups_needed,
    replay_count,
)
from jaxflash.replay.replay_buffer import ReplayBuffer
from jaxflash.runtime.config.elastic_spec import floors as elastic_floors
from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec, replay_active
from jaxflash.runtime.control.controller_setup import make_controller
from jaxflash.runtime.workloads.learner_batch import LearnerBatch
from jaxflash.types import Sample, TrainBatch


@dataclasses.dataclass(frozen=True)
class MixedStep:
    """One step's mixed batch.

    Attributes:
      batch: TrainBatch [rows, T] (None when nothing carries loss).
      samples: fresh samples, then replayed ones (batch row order).
      cycle_b: int8 [rows], 0 fresh / 1 replay (padding rows 0; they carry no tokens).
      metrics: the composer's per-step metrics (docs/REPLAY.md).
    """

    batch: TrainBatch | None
    samples: tuple[Sample, ...]
    cycle_b: np.ndarray
    metrics: dict[str, Any]


class ReplayCycle:
    """The replay cycle of one run (see module docstring).

    Args:
      replay, controller: the config sections.
      batch_prompts: ``rollout.prompts_per_step`` B, the learner batch in groups.
      group_size: G.
      async_ratio: the run's alpha (the adaptive controller's maximum).
      learner_devices, generation_devices: the role split, as the controller sees it.
      seed: seeds the buffer's sampler.
      state: a ``state_dict`` from a checkpoint (None: a fresh buffer).
      samples_generated: the scheduler's ``samples_generated`` at the start.
      device_floors: with elastic moves, the adaptive controller's device_quantum,
        min_learner_devices and min_generation_devices (``elastic_spec``); None:
        ``ControllerConfig``'s defaults (its split is only proposed).

    Raises:
      ValueError: a saved state whose buffer config differs from this run's.
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
        seed: int,
        state: dict[str, Any] | None = None,
        samples_generated: int = 0,
        device_floors: dict[str, int] | None = None,
    ):
        self.group_size, self.batch_prompts = group_size, batch_prompts
        self._per_prompt = replay.sampler == "per_prompt"
        # Rows of every packed batch (one compiled step): the most any step's rho gives.
        self.rows = max(self._rows_at(rho) for rho in controller.ratios(replay))
        buffer_config = replay.buffer_config(seed=seed)
        buffer = (
            ReplayBuffer.from_state_dict(buffer_config, state["buffer"])
            if state
            else ReplayBuffer(buffer_config)
        )
        self._composer = DualCycleComposer(
            buffer,
            DualCycleConfig(advantages=replay.advantages, estimator=replay.advantage_estimator),
        )
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
        self._generated_before = int(samples_generated)  # the scheduler's counter at start

    def _rows_at(self, rho: float) -> int:
        """Fresh plus replayed samples of a full step at ``rho`` (per-prompt draws
        round per group of G, buffer-wide ones over the step)."""
        fresh = fresh_groups_needed(self.batch_prompts, rho) * self.group_size
        if self._per_prompt:
            return fresh + fresh // self.group_size * replay_count(self.group_size, rho)
        return fresh + replay_count(fresh, rho)

    @property
    def buffer(self) -> ReplayBuffer:
        return self._composer.buffer

    @property
    def decision(self) -> Decision:
        """The settings in force for the next step (the controller's, as applied)."""
        return self._decision

    @property
    def fresh_prompts(self) -> int:
        """Fresh groups of the next step: the B groups of the batch minus rho's share."""
        return fresh_groups_needed(self.batch_prompts, self._decision.replay_ratio)

    def scheduler_settings(self) -> dict[str, int]:
        """The next step's ``RolloutScheduler.reconfigure`` arguments: fresh groups,
        alpha, and the requests in flight as whole prompts (ceil(requests / G))."""
        d, G = self._decision, self.group_size
        return {
            "batch_prompts": self.fresh_prompts,
            "async_ratio": d.async_ratio,
            "prompts_in_flight": max(self.fresh_prompts, -(-d.requests_in_flight // G)),
        }

    @property
    def replay_ratio(self) -> float:
        """rho of the next step (the controller's last decision, or replay.ratio)."""
        return self._decision.replay_ratio

    # ------------------------------------------------------------------ the batch
    def step_batch(
        self, lb: LearnerBatch, *, learner_version: int, pad_id: int, max_len: int
    ) -> tuple[TrainBatch | None, dict[str, Any]]:
        """The learner batch of a step: the fresh cycle plus the replay cycle (``mix``).

        Args:
          lb: the fresh cycle (``learner_batch``): samples with loss, advantages.

        Returns:
          (TrainBatch [rows, T] with ``cycle_bt``, or None when nothing carries
          loss; the composer's metrics).
        """
        mixed = self.mix(
            lb.samples,
            lb.advantages,
            learner_version=learner_version,
            pad_id=pad_id,
            max_len=max_len,
        )
        return mixed.batch, mixed.metrics

    def mix(
        self,
        samples: Sequence[Sample],
        advantages: np.ndarray,
        *,
        learner_version: int,
        pad_id: int,
        max_len: int,
    ) -> MixedStep:
        """Draw the replay cycle, store the fresh samples, pack both.

        Args:
          samples: the step's fresh samples that carry loss (``LearnerBatch.samples``).
          advantages: float32 [len(samples)], their advantages.
          learner_version: the version the step trains at (ages are taken against it).
          pad_id, max_len: as ``pack_batch``.

        Returns:
          MixedStep with ``self.rows`` rows.
        """
        mixed = self._composer.compose(
            samples,
            list(advantages),
            learner_version=learner_version,
            replay_ratio=self.replay_ratio,
        )
        if not mixed.samples:
            return MixedStep(None, (), np.zeros((0,), np.int8), mixed.metrics)
        batch = pack_batch(
            list(mixed.samples),
            np.stack([np.asarray(a, np.float32) for a in mixed.advantages]),
            pad_id=pad_id,
            max_len=max_len,
            num_sequences=self.rows,
            cycle_b=mixed.cycle_b,
        )
        cycle_b = np.zeros((self.rows,), np.int8)
        cycle_b[: len(mixed.cycle_b)] = mixed.cycle_b
        return MixedStep(batch, mixed.samples, cycle_b, mixed.metrics)

    # ------------------------------------------------------------------ the controller
    def control(
        self,
        *,
        next_version: int,
        samples_generated: int,
        step_s: float,
        trained_samples: int,
        train_s: float,
        queue_samples: int,
        staleness_mean: float,
        replay_ess: float | None,
        move: Callable[[int], int] | None = None,
    ) -> dict[str, Any]:
        """Feed the controller this step's measurements; its decision is the next step's.

        rho, alpha and the requests in flight are put in force (``decision``,
        ``scheduler_settings``; the loop hands them to the scheduler). A different
        role split is handed to ``move`` (the elastic pool: wanted learner devices ->
        learner devices in force); without ``move`` it is only logged
        (``ctl_proposed_*``). The controller is told the split actually in force.

        Args:
          next_version: learner version the next step trains at (the decision's step).
          samples_generated: the scheduler's cumulative ``samples_generated``.
          step_s, train_s: this step's wall time and update time (s).
          trained_samples: rows that carried loss this step.
          queue_samples: scored samples waiting for the learner.
          staleness_mean: mean staleness of the fresh samples trained.
          replay_ess: the replay cycle's token ESS (None when nothing was replayed).
          move: ``ElasticPool.move_to`` (None: devices keep their roles).

        Returns:
          ``ctl_in_*`` (inputs), the controller's flags and ``ctl_*`` (decision);
          {} without a controller, and on a step that trained nothing (no training
          rate to measure: the decision stands).
        """
        before, self._generated_before = self._generated_before, samples_generated
        if self._controller is None or trained_samples < 1:
            return {}
        generated = samples_generated - before
        kept = self._decision
        inputs = ControllerInputs(
            step=next_version,
            gen_rate=max(generated, 0) / max(step_s, 1e-9),
            train_rate=trained_samples / max(train_s, 1e-9),
            queue_depth=max(int(queue_samples), 0),
            staleness_mean=float(staleness_mean),
            ess=None if replay_ess is None else min(max(replay_ess, 1e-12), 1.0),
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
        return self._controller.metrics()

    def control_from(
        self,
        metrics: dict[str, Any],
        *,
        next_version: int,
        move: Callable[[int], int] | None = None,
    ) -> dict[str, Any]:
        """``control`` with its inputs read from the step's metrics row (README names)."""
        return self.control(
            move=move,
            next_version=next_version,
            samples_generated=int(metrics.get("samples_generated", 0)),
            step_s=float(metrics["step_time_s"]),
            trained_samples=int(metrics.get("sequences", 0)),
            train_s=float(metrics["train_time_s"]),
            queue_samples=int(metrics.get("buffer_pending", 0)) * self.group_size,
            staleness_mean=float(metrics.get("staleness_mean", 0.0)),
            replay_ess=metrics.get("replay_ess_token"),
        )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the buffer (contents, counters, RNG), the controller, the decision."""
        return {
            "buffer": self.buffer.state_dict(),
            "controller": self._controller.state_dict() if self._controller else {},
            "decision": dataclasses.asdict(self._decision),
        }


def make_replay_cycle(
    exp: Any,
    *,
    learner_mesh: Any,
    generation_meshes: Sequence[Any],
    extra: dict[str, Any],
) -> ReplayCycle | None:
    """The run's ReplayCycle, or None when the config has no replay cycle.

    Args:
      exp: the ``ExperimentConfig``.
      learner_mesh, generation_meshes: the placement (the controller's role split).
      extra: the checkpoint metadata's ``extra`` ({} on a fresh start): its
        "replay" entry restores the buffer, and its "counters" the generation count.
    """
    if not replay_active(exp.replay, exp.controller):
        return None
    floors = None
    if exp.controller.elastic:  # one slice at a time, within the elastic pool's floors
        min_learner, slice_size = elastic_floors(exp.mesh)
        floors = {
            "device_quantum": slice_size,
            "min_learner_devices": min_learner,
            "min_generation_devices": slice_size,
        }
    return ReplayCycle(
        exp.replay,
        exp.controller,
        batch_prompts=exp.rollout.prompts_per_step,
        group_size=exp.rollout.group_size,
        async_ratio=exp.rollout.async_ratio,
        learner_devices=int(learner_mesh.devices.size),
        generation_devices=sum(int(m.devices.size) for m in generation_meshes),
        seed=exp.seed,
        state=extra.get("replay"),
        samples_generated=int(extra.get("counters", {}).get("samples_generated", 0)),
        device_floors=floors,
    )
