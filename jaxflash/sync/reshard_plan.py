"""Which devices change role when the elastic pool resizes the learner (pure).

ReFlow's elastic resource pool (arXiv 2610.21640) and ROLL's partial_gpu_mode move
devices between generation and training at a step boundary. Devices move as
whole generation slices (a slice is one generation server's mesh):

- the learner grows by taking the first generation slices, in order; their
  in-flight requests must be aborted and re-queued (the runtime counts them);
- the learner shrinks by giving its last devices back as new generation slices,
  placed first in the generation list (they sit next to the learner's devices).

The learner's devices stay in their order with new ones appended, so a shrink
followed by a grow returns the original layout (and ``reshard.LayoutCache`` hits).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleSplit:
    """Device ids per role.

    Attributes:
      learner: the learner mesh's device ids, in mesh order.
      generation: one tuple of device ids per generation slice, all of one size.
    """

    learner: tuple[int, ...]
    generation: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        sizes = {len(s) for s in self.generation}
        if not self.learner or not self.generation or len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                f"RoleSplit needs learner devices and equal, non-empty generation slices; got "
                f"learner {self.learner}, slices {self.generation}"
            )
        ids = list(self.learner) + [d for s in self.generation for d in s]
        if len(ids) != len(set(ids)):
            raise ValueError(f"RoleSplit: a device has two roles: {sorted(ids)}")

    @property
    def slice_size(self) -> int:
        return len(self.generation[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleChange:
    """A planned move.

    Attributes:
      before, after: the splits.
      to_learner: generation slices that join the learner (abort + re-queue their requests).
      to_generation: learner devices that become new generation slices.
    """

    before: RoleSplit
    after: RoleSplit
    to_learner: tuple[tuple[int, ...], ...]
    to_generation: tuple[tuple[int, ...], ...]

    @property
    def moved(self) -> bool:
        return bool(self.to_learner or self.to_generation)


def plan_role_split(current: RoleSplit, learner_devices: int) -> RoleChange:
    """Plan the split with ``learner_devices`` learner devices.

    Args:
      current: the split in force.
      learner_devices: the learner size wanted (e.g. ``Decision.learner_devices``).

    Returns:
      RoleChange (``moved`` False when the size is unchanged).

    Raises:
      ValueError: a change that is not a whole number of slices, that would leave
        no generation slice or no learner device (names the numbers).
    """
    n, size = len(current.learner), current.slice_size
    delta = learner_devices - n
    if delta % size:
        raise ValueError(
            f"plan_role_split: learner {n} -> {learner_devices} devices is not a whole number "
            f"of generation slices of {size}"
        )
    k = delta // size
    if k >= len(current.generation) or learner_devices < 1:
        raise ValueError(
            f"plan_role_split: {learner_devices} learner devices would leave "
            f"{len(current.generation) - k} generation slices of {size} (need >= 1) "
            "or no learner device"
        )
    if k > 0:
        taken = current.generation[:k]
        after = RoleSplit(
            learner=current.learner + tuple(d for s in taken for d in s),
            generation=current.generation[k:],
        )
        return RoleChange(before=current, after=after, to_learner=taken, to_generation=())
    if k < 0:
        freed = current.learner[learner_devices:]
        slices = tuple(freed[i : i + size] for i in range(0, len(freed), size))
        after = RoleSplit(
            learner=current.learner[:learner_devices], generation=slices + current.generation
        )
        return RoleChange(before=current, after=after, to_learner=(), to_generation=slices)
    return RoleChange(before=current, after=current, to_learner=(), to_generation=())
