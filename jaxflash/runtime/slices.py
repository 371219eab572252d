"""Disjoint device slices for the async runtime: one learner mesh, N generation meshes.

ROLL Flash (arXiv 2510.11345) decouples rollout from training by giving each its
own devices. The learner takes the first ``prod(mesh.learner)`` devices; each of
``mesh.num_generation_slices`` generation slices takes the next
``prod(mesh.generation)`` devices, with its own mesh (one GenerationServer each).

On CPU every generation slice should hold ONE device: XLA's CPU client never
overlaps two multi-device programs, so multi-device slices would serialise with
the learner (../shared/DESIGN.md). With 8 fake devices: learner 6 + 2 x 1.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from jaxflash.runtime.experiment import MeshSpec
from jaxflash.sharding.mesh import make_mesh


def build_slices(
    spec: MeshSpec, devices: list[jax.Device] | None = None
) -> tuple[Mesh, list[Mesh]]:
    """(learner mesh, [generation mesh per slice]) on disjoint devices.

    Args:
      spec: mesh section of the experiment; ``colocated`` must be False.
      devices: devices to carve (default ``jax.devices()``), taken in order.

    Returns:
      The learner mesh over devices [0, L) and ``spec.num_generation_slices``
      meshes over the following blocks of ``prod(spec.generation)`` devices.

    Raises:
      ValueError: ``spec.colocated`` is True, or more devices are needed than
        exist (both numbers named).
    """
    if spec.colocated:
        raise ValueError("build_slices needs mesh.colocated=False (disjoint slices)")
    devices = list(jax.devices() if devices is None else devices)
    n_learner = math.prod(int(v) for v in spec.learner.values())
    n_gen = math.prod(int(v) for v in spec.generation.values())
    need = n_learner + spec.num_generation_slices * n_gen
    if need > len(devices):
        raise ValueError(
            f"slices need {need} devices (learner {dict(spec.learner)} = {n_learner}, "
            f"{spec.num_generation_slices} generation slices of {dict(spec.generation)} = "
            f"{n_gen} each) but only {len(devices)} are available"
        )
    learner = make_mesh(devices[:n_learner], dict(spec.learner))
    gens = []
    for i in range(spec.num_generation_slices):
        lo = n_learner + i * n_gen
        gens.append(make_mesh(devices[lo : lo + n_gen], dict(spec.generation)))
    return learner, gens
