"""The dual replay cycle inside the loop: the replay buffer and each step's mix.

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
rho comes from the step controller (``runtime.control.step_control``), which owns
the decision (rho, alpha, requests in flight, the role split) and updates it from
each step's report; this module holds only the data side.

``state_dict`` (buffer contents, counters, the sampler's RNG) goes into the
checkpoint's metadata, next to the step controller's; a ``ReplayCycle`` built with
it draws exactly what the uninterrupted one would.

With rho = 0 and no controller there is no ``ReplayCycle``: the loop is exactly
the one without replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxflash.learner.batching import pack_batch
from jaxflash.replay.dual_cycle import (
    DualCycleComposer,
    DualCycleConfig,
    fresh_groups_needed,
    replay_count,
)
from jaxflash.replay.replay_buffer import ReplayBuffer
from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec, replay_active
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
      replay, controller: the config sections (the controller's schedule bounds the
        rows: every step packs the most rows any of its rho values gives).
      batch_prompts: ``rollout.prompts_per_step`` B, the learner batch in groups.
      group_size: G.
      seed: seeds the buffer's sampler.
      state: a ``state_dict`` from a checkpoint (None: a fresh buffer).

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
        seed: int,
        state: dict[str, Any] | None = None,
    ):
        self.group_size, self.batch_prompts = group_size, batch_prompts
        self.default_ratio = replay.ratio  # rho when the caller names none
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

    # ------------------------------------------------------------------ the batch
    def step_batch(
        self,
        lb: LearnerBatch,
        *,
        learner_version: int,
        replay_ratio: float | None = None,
        pad_id: int,
        max_len: int,
        length_multiple: int = 32,
    ) -> tuple[TrainBatch | None, dict[str, Any]]:
        """The learner batch of a step: the fresh cycle plus the replay cycle (``mix``).

        Args:
          lb: the fresh cycle (``learner_batch``): samples with loss, advantages.
          replay_ratio: this step's rho (``StepControl.replay_ratio``; None:
            ``replay.ratio``).

        Returns:
          (TrainBatch [rows, T] with ``cycle_bt``, or None when nothing carries
          loss; the composer's metrics).
        """
        mixed = self.mix(
            lb.samples,
            lb.advantages,
            learner_version=learner_version,
            replay_ratio=replay_ratio,
            pad_id=pad_id,
            max_len=max_len,
            length_multiple=length_multiple,
        )
        return mixed.batch, mixed.metrics

    def mix(
        self,
        samples: Sequence[Sample],
        advantages: np.ndarray,
        *,
        learner_version: int,
        replay_ratio: float | None = None,
        pad_id: int,
        max_len: int,
        length_multiple: int = 32,
    ) -> MixedStep:
        """Draw the replay cycle, store the fresh samples, pack both.

        Args:
          samples: the step's fresh samples that carry loss (``LearnerBatch.samples``).
          advantages: float32 [len(samples)], their advantages.
          learner_version: the version the step trains at (ages are taken against it).
          replay_ratio: this step's rho (None: ``replay.ratio``).
          pad_id, max_len, length_multiple: as ``pack_batch``.

        Returns:
          MixedStep with ``self.rows`` rows.
        """
        mixed = self._composer.compose(
            samples,
            list(advantages),
            learner_version=learner_version,
            replay_ratio=self.default_ratio if replay_ratio is None else replay_ratio,
        )
        if not mixed.samples:
            return MixedStep(None, (), np.zeros((0,), np.int8), mixed.metrics)
        batch = pack_batch(
            list(mixed.samples),
            np.stack([np.asarray(a, np.float32) for a in mixed.advantages]),
            pad_id=pad_id,
            max_len=max_len,
            length_multiple=length_multiple,
            num_sequences=self.rows,
            cycle_b=mixed.cycle_b,
        )
        cycle_b = np.zeros((self.rows,), np.int8)
        cycle_b[: len(mixed.cycle_b)] = mixed.cycle_b
        return MixedStep(batch, mixed.samples, cycle_b, mixed.metrics)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the buffer (contents, counters, RNG)."""
        return {"buffer": self.buffer.state_dict()}


def make_replay_cycle(
    *, replay: Any, controller: Any, rollout: Any, seed: int, extra: dict[str, Any]
) -> ReplayCycle | None:
    """The run's ReplayCycle, or None when the config has no replay cycle.

    Args:
      replay, controller, rollout: the experiment's sections (``exp.replay``, ...).
      seed: the experiment's seed (the buffer's sampling).
      extra: the checkpoint metadata's ``extra`` ({} on a fresh start): its
        "replay" entry restores the buffer.
    """
    if not replay_active(replay, controller):
        return None
    return ReplayCycle(
        replay,
        controller,
        batch_prompts=rollout.prompts_per_step,
        group_size=rollout.group_size,
        seed=seed,
        state=extra.get("replay"),
    )
