"""The elastic resource pool in the live loop: devices change role at a step boundary.

ReFlow (arXiv 2610.21640) moves devices between generation and training as the
two sides' rates change; ROLL's partial_gpu_mode shrinks and expands its
generation servers the same way. Here the decision in force (an adaptive
controller's role split or a fixed ``controller.device_schedule``) names the
learner's device count; ``ElasticPool.move_to`` carries it out between two
learner steps, in whole generation slices (``sync.reshard_plan``):

* the learner grows (takes the first generation slices): each slice's server
  leaves the pool and stops; what it finished is taken, what it still held is
  re-queued on the other servers (the fleet tells the rollout,
  ``RolloutScheduler.servers_changed``; counted
  ``elastic_requeued``, no prompt lost or counted twice); then the TrainState
  (params + optimizer state) is resharded onto the larger learner mesh device to
  device (``sync.reshard``) and the step for that mesh comes from the learner's
  per-layout cache (``LearnerProgram.move_to``: compiled once per layout).
* the learner shrinks: the state moves onto the smaller mesh first (freeing the
  devices), then each freed slice gets an engine (built once per device layout,
  ``ThreadFleet``), the current weights device to device, and only then a server
  that takes requests.

Weight publication per generation mesh (``sync.publish``'s staging reshard) is a
jitted identity per (learner, generation) layout pair, cached by JAX, so it too
compiles once per layout.

Resume: a checkpoint is restored onto the configured learner mesh
(``mesh.learner``), then the loop moves to the split of the decision in force
(saved with the replay cycle) before its first step. So a run resumed from a
checkpoint saved on a grown layout trains on that layout again, by the same move.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from jaxflash.runtime.config.elastic_spec import learner_axes
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from jaxflash.runtime.fleet.placement import Placement
from jaxflash.runtime.fleet.thread_fleet import ThreadFleet
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sync.reshard_plan import RoleSplit, plan_role_split

log = logging.getLogger(__name__)


def _ids(mesh: Mesh) -> tuple[int, ...]:
    return tuple(int(d.id) for d in mesh.devices.flat)


@dataclasses.dataclass
class MoveRecord:
    """The last move: devices per direction, re-queued requests, reshard size and time."""

    to_learner: int = 0
    to_generation: int = 0
    requeued: int = 0
    bytes: int = 0
    seconds: float = 0.0


class ElasticPool:
    """Moves generation slices into and out of the learner mesh of a running job.

    Args:
      learner: the learner (its state moves; one process only).
      fleet: the thread fleet (it retires and adds slots and their servers and tells
        the rollout, ``ThreadFleet.resize``; a slot's index is its server's in the pool).
      placement: the starting placement (disjoint, thread servers).
      learner_shape: ``mesh.learner`` axis sizes (fsdp takes the size changes).
      state: ``state_dict`` from a checkpoint (moves and re-queued counts go on).

    Raises:
      ValueError: a colocated placement (``runtime.config.elastic_spec`` refuses it first).
    """

    def __init__(
        self,
        *,
        learner: LearnerProgram,
        fleet: ThreadFleet,
        placement: Placement,
        learner_shape: Mapping[str, int],
        state: dict[str, Any] | None = None,
    ):
        if placement.colocated or not placement.generation:
            raise ValueError("ElasticPool needs disjoint generation slices of thread servers")
        self._learner, self._fleet = learner, fleet
        self._learner_shape = dict(learner_shape)
        self._gen_shape = dict(placement.generation[0].shape)
        self._devices = {int(d.id): d for d in jax.devices()}
        self.split = RoleSplit(
            learner=_ids(placement.learner),
            generation=tuple(_ids(m) for m in placement.generation),
        )
        self._slot = {s: i for i, s in enumerate(self.split.generation)}  # slice -> server
        state = state or {}
        self.moves = int(state.get("moves", 0))
        self.requeued = int(state.get("requeued", 0))
        self.last = MoveRecord()

    @property
    def learner_devices(self) -> int:
        return len(self.split.learner)

    def move_to(self, learner_devices: int, *, counted: bool = True) -> int:
        """Make the learner ``learner_devices`` devices large; returns the size in force.

        Between learner steps only (after the step's weights were published). The
        version generation holds is the learner's ``step``. ``counted`` False: a
        resumed run returning to its checkpoint's split (not a new move).

        Raises:
          ValueError: a size that is not whole slices away, or that would leave no
            generation slice (``plan_role_split``), or that forms no learner mesh.
        """
        change = plan_role_split(self.split, int(learner_devices))
        if not change.moved:
            return self.learner_devices
        learner_axes(self._learner_shape, len(change.after.learner))  # raises first
        t0 = time.perf_counter()
        done = self._fleet.resize(
            retire=[self._slot.pop(s) for s in change.to_learner],
            learner_mesh=self._learner_mesh(change.after.learner),
            add=[make_mesh([self._devices[d] for d in s], self._gen_shape)
                 for s in change.to_generation],
            learner=self._learner,
        )  # fmt: skip
        self._slot.update(zip(change.to_generation, done.added, strict=True))
        requeued = done.requeued
        self.split = change.after
        self.requeued += requeued
        record = MoveRecord(
            to_learner=sum(len(s) for s in change.to_learner),
            to_generation=sum(len(s) for s in change.to_generation),
            requeued=requeued,
            bytes=done.reshard_bytes,
            seconds=time.perf_counter() - t0,
        )
        log.info("elastic move%s: %s", "" if counted else " (resume)", record)
        if counted:
            self.moves += 1
            self.last = record
        return self.learner_devices

    def _learner_mesh(self, ids: tuple[int, ...]) -> Mesh:
        axes = learner_axes(self._learner_shape, len(ids))
        return make_mesh([self._devices[d] for d in ids], axes)

    def step_metrics(self) -> dict[str, Any]:
        """The split after this step boundary and the move made since the last call
        (README names); call once per step.

        learner_devices, generation_slices: the split in force for the next step;
        elastic_moves, elastic_requeued: cumulative; elastic_to_learner /
        elastic_to_generation: devices moved at this boundary; elastic_reshard_bytes,
        elastic_move_s: the state resharded and the move's wall time (s);
        elastic_train_step_builds, elastic_engine_builds: learner steps and engines
        built so far (one per layout: moving back builds nothing).
        """
        last, self.last = self.last, MoveRecord()
        return {
            "learner_devices": self.learner_devices,
            "generation_slices": len(self.split.generation),
            "elastic_moves": self.moves,
            "elastic_requeued": self.requeued,
            "elastic_to_learner": last.to_learner,
            "elastic_to_generation": last.to_generation,
            "elastic_reshard_bytes": last.bytes,
            "elastic_move_s": last.seconds,
            "elastic_train_step_builds": len(self._learner.train_steps),
            "elastic_engine_builds": self._fleet.engine_builds,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able counts for the checkpoint (the split itself is the replay cycle's
        decision, which the loop moves back to on resume)."""
        return {"moves": self.moves, "requeued": self.requeued}


def make_elastic(
    *,
    controller: Any,
    mesh: Any,
    learner: LearnerProgram,
    fleet: Any,
    placement: Placement,
    extra: dict[str, Any],
    learner_devices: int | None,
) -> ElasticPool | None:
    """The run's ElasticPool (None unless ``controller.elastic``), on the split in force.

    Args:
      controller, mesh: the experiment's ``controller`` and ``mesh`` sections
        (``runtime.elastic_spec.check_elastic`` passed).
      learner, fleet, placement: as ``ElasticPool``.
      extra: the checkpoint metadata's ``extra`` ({} on a fresh start).
      learner_devices: the decision in force's learner size (the replay cycle's;
        on resume the checkpointed split, moved to here before the first step).
    """
    if not controller.elastic:
        return None
    pool = ElasticPool(
        learner=learner,
        fleet=fleet,
        placement=placement,
        learner_shape=mesh.learner,
        state=extra.get("elastic"),
    )
    if learner_devices is not None and learner_devices != pool.learner_devices:
        pool.move_to(learner_devices, counted=False)  # back to the checkpoint's split
    return pool
