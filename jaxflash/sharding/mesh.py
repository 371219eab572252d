"""Device meshes with jaxflash's fixed axis names.

Axes, outermost first: ``data`` (pure data parallel: replicas), ``fsdp`` (data
parallel with parameters sharded across it, arXiv 2304.11277), ``expert`` (expert
parallel: a mixture-of-experts layer's experts split across it, data parallel for
everything else, GShard arXiv 2006.16668), ``tensor`` (tensor parallel: heads / MLP /
vocabulary split, arXiv 1909.08053). Every mesh has all four axes (size 1 when
unused), so one rules table works on any mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "expert", "tensor")


def make_mesh(devices: Sequence[jax.Device], axis_sizes: dict[str, int]) -> Mesh:
    """A mesh over ``devices`` laid out as data x fsdp x expert x tensor.

    Args:
      devices: the devices of this slice, in order; ``tensor`` varies fastest, so
        neighbouring devices (same host / fast link) form the tensor groups.
      axis_sizes: sizes for any of "data", "fsdp", "expert", "tensor"; missing ones
        are 1.
        Their product must equal len(devices).

    Returns:
      jax.sharding.Mesh with axis_names ("data", "fsdp", "expert", "tensor").

    Raises:
      ValueError: an unknown axis name, a size < 1, or a product that differs
        from the device count (both numbers named).
    """
    unknown = sorted(set(axis_sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"make_mesh: unknown axis names {unknown}; use {MESH_AXES}")
    sizes = tuple(int(axis_sizes.get(name, 1)) for name in MESH_AXES)
    named = dict(zip(MESH_AXES, sizes, strict=True))
    if min(sizes) < 1:
        raise ValueError(f"make_mesh: axis sizes must be >= 1, got {named}")
    devices = list(devices)
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"make_mesh: axis sizes {named} multiply to "
            f"{int(np.prod(sizes))}, but {len(devices)} devices were given"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)
