"""What an elastic run (``controller.elastic=True``) may ask for, checked before anything loads.

The elastic pool (``runtime.control.elastic``; ReFlow arXiv 2610.21640, ROLL's
partial_gpu_mode) moves whole generation slices between the learner and
generation at a step boundary (``sync.reshard_plan``). It works where both roles
are threads of this program on disjoint devices, and where every learner size it
can reach forms a learner mesh: the learner grows and shrinks along ``fsdp``
(``data`` and ``tensor`` keep their sizes), so every reachable size must be a
multiple of data x tensor. ``check_elastic`` refuses the rest, naming the fields.

Floors: the learner keeps at least one fsdp row (data x tensor devices) and
generation at least one slice; an adaptive controller moves one slice at a time
(its ``device_quantum`` is the slice size).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jaxflash.runtime.config.replay_spec import ControllerSpec
from jaxflash.runtime.config.specs import MeshSpec, check


def fixed_axes(learner: Mapping[str, int]) -> int:
    """data x expert x tensor of a learner mesh: the devices of one fsdp row (elastic
    moves keep it)."""
    return (
        int(learner.get("data", 1)) * int(learner.get("expert", 1)) * int(learner.get("tensor", 1))
    )


def learner_axes(learner: Mapping[str, int], devices: int) -> dict[str, int]:
    """The learner mesh's axis sizes with ``devices`` devices: fsdp takes the change.

    Raises:
      ValueError: ``devices`` is not a multiple of data x expert x tensor (names the
        numbers).
    """
    row = fixed_axes(learner)
    if devices < row or devices % row:
        raise ValueError(
            f"a learner of {devices} devices cannot keep mesh.learner's "
            f"{'data x expert x tensor' if 'expert' in learner else 'data x tensor'} = {row}"
        )
    axes = {"data": int(learner.get("data", 1)), "fsdp": devices // row}
    if "expert" in learner:  # a MoE learner keeps its expert split
        axes["expert"] = int(learner["expert"])
    return {**axes, "tensor": int(learner.get("tensor", 1))}


def floors(mesh: MeshSpec) -> tuple[int, int]:
    """(fewest learner devices, fewest generation devices) an elastic run goes to."""
    return fixed_axes(mesh.learner), math.prod(int(v) for v in mesh.generation.values())


def check_elastic(controller: ControllerSpec, mesh: MeshSpec) -> None:
    """Refuse an elastic run the pool cannot carry out (no-op with elastic=False).

    Raises:
      ConfigError: colocated placement or generation programs with
        controller.elastic; a device_schedule whose first size is not mesh.learner's,
        whose size changes are not whole generation slices, that would leave no
        generation slice or go below the learner floor, or whose sizes do not form
        a learner mesh; an adaptive controller whose slice size is not a multiple
        of the learner's data x tensor.
    """
    if not controller.elastic:
        return
    check(
        not mesh.colocated,
        "controller.elastic=True needs mesh.colocated=False: devices move between "
        "disjoint learner and generation slices (switching placement live is not built)",
    )
    check(
        not mesh.generation_processes,
        "controller.elastic=True with mesh.generation_processes=True: generation programs "
        "own their devices in other processes; elastic moves work with thread servers only",
    )
    n_learner = math.prod(int(v) for v in mesh.learner.values())
    min_learner, slice_size = floors(mesh)
    total = n_learner + mesh.num_generation_slices * slice_size
    if controller.kind == "adaptive":
        check(
            slice_size % min_learner == 0,
            f"controller.elastic with controller.kind='adaptive' moves one generation slice "
            f"({slice_size} devices, mesh.generation) at a time, which must be a multiple of "
            f"mesh.learner's data x tensor = {min_learner} so every learner size forms a mesh",
        )
        return
    steps = controller.device_steps()
    check(
        bool(steps),
        "controller.elastic=True with controller.kind='fixed' needs controller.device_schedule",
    )
    check(
        steps[0][1] == n_learner,
        f"controller.device_schedule starts at {steps[0][1]} learner devices but mesh.learner "
        f"{dict(mesh.learner)} has {n_learner}: one of them would be ignored (make them equal)",
    )
    for step, n in steps:
        where = f"controller.device_schedule entry {step}:{n}"
        check(
            (n - n_learner) % slice_size == 0,
            f"{where}: {n} - {n_learner} learner devices is not a whole number of generation "
            f"slices of {slice_size} (mesh.generation {dict(mesh.generation)})",
        )
        check(
            min_learner <= n <= total - slice_size,
            f"{where}: the learner must keep >= {min_learner} devices (mesh.learner data x "
            f"tensor) and leave >= 1 generation slice of {slice_size} out of {total} devices",
        )
        check(
            n % min_learner == 0,
            f"{where}: {n} devices do not form a learner mesh with mesh.learner's data x "
            f"tensor = {min_learner}",
        )
