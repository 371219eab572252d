"""Carving devices into a learner mesh and generation meshes, for both placements.

* Colocated (``mesh.colocated=True``, the synchronous baseline): the learner takes
  the first ``prod(mesh.learner)`` devices and ONE generation server runs on the
  first ``prod(mesh.generation)`` of those same devices; it is idle while the
  learner trains (α = 0: nothing is admitted until the new weights are out).
* Disjoint (ROLL Flash rollout-train decoupling, arXiv 2510.11345): the learner
  takes devices [0, L) and each of ``mesh.num_generation_slices`` slices the next
  ``prod(mesh.generation)`` devices, one generation server each.
* Generation programs (``mesh.generation_processes=True``): the learner takes
  devices [0, L) of this program; generation slices are other JAX programs
  with devices of their own (``runtime.fleet.fleets``), so none are carved here.

On CPU every generation slice should hold ONE device: XLA's CPU client never
overlaps two multi-device programs, so multi-device slices would serialise with
the learner. With 8 fake devices: learner 6 + 2 x 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jaxflash.runtime.config.experiment import MeshSpec
from jaxflash.runtime.config.specs import ConfigError
from jaxflash.sharding.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the learner and the generation servers run.

    Attributes:
      learner: the learner mesh.
      generation: one mesh per generation server.
      colocated: the generation mesh shares the learner's devices.
    """

    learner: Mesh
    generation: tuple[Mesh, ...]
    colocated: bool

    def describe(self) -> str:
        """E.g. "learner devices 0-5, generation [6], [7] (disjoint)"."""

        def ids(mesh: Mesh) -> str:
            d = sorted(int(x.id) for x in mesh.devices.flat)
            if len(d) > 1 and d == list(range(d[0], d[-1] + 1)):
                return f"{d[0]}-{d[-1]}"
            return ",".join(map(str, d))

        if not self.generation:
            return f"learner devices {ids(self.learner)}, generation in separate programs"
        gens = ", ".join(f"[{ids(m)}]" for m in self.generation)
        kind = "colocated" if self.colocated else "disjoint"
        return f"learner devices {ids(self.learner)}, generation {gens} ({kind})"


def carve(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> Placement:
    """The placement ``spec`` asks for, over ``devices`` (default ``jax.devices()``) in order.

    Raises:
      ConfigError (a ValueError): more devices are needed than exist (both numbers
        named), or a colocated generation mesh larger than the learner's.
    """
    devices = list(jax.devices() if devices is None else devices)
    n_learner = math.prod(int(v) for v in spec.learner.values())
    n_gen = math.prod(int(v) for v in spec.generation.values())
    if spec.generation_processes:  # generation programs have their own devices
        need, starts = n_learner, []
    elif spec.colocated:
        if n_gen > n_learner:
            raise ConfigError(
                f"mesh.generation {dict(spec.generation)} needs {n_gen} devices but a "
                f"colocated server runs on the learner's {n_learner} (mesh.learner)"
            )
        need, starts = n_learner, [0]
    else:
        need = n_learner + spec.num_generation_slices * n_gen
        starts = [n_learner + i * n_gen for i in range(spec.num_generation_slices)]
    if need > len(devices):
        raise ConfigError(
            f"mesh needs {need} devices (learner {dict(spec.learner)} = {n_learner}, "
            f"{len(starts)} generation mesh(es) of {dict(spec.generation)} = {n_gen}, "
            f"colocated={spec.colocated}) but only {len(devices)} are available"
        )
    learner = make_mesh(devices[:n_learner], dict(spec.learner))
    generation = tuple(make_mesh(devices[s : s + n_gen], dict(spec.generation)) for s in starts)
    return Placement(learner=learner, generation=generation, colocated=spec.colocated)
