"""Abstract TPU chips from libtpu, for compiling without holding a TPU.

``libtpu`` (the ``jaxflash[tpu]`` extra) carries the TPU compiler. Given a slice
name, ``jax.experimental.topologies.get_topology_desc`` returns compile-only
devices of that slice: jit with shardings over a ``Mesh`` of them, ``.lower()``
against ``jax.ShapeDtypeStruct``s and ``.compile()`` give the TPU executable's
``memory_analysis()`` and ``cost_analysis()``. Nothing runs and nothing is
allocated; any concrete array op still runs on the default (CPU) device.

libtpu is loaded only here, when a topology is asked for: importing jaxflash,
or running on CPU with libtpu installed, never initialises it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from jaxflash.sizing.chips import ChipTopology

LIBTPU_PIN = "libtpu==0.0.42.1"  # the version jax[tpu]==0.10.2 pins (pyproject's tpu extra)

# Compile-only use: no TPU metadata server to query, this host is the slice's one
# worker, and a second libtpu load (another process) is allowed.
TPU_COMPILE_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "true",
}


class MissingTpuExtraError(ImportError):
    """libtpu is not installed: the message is one line naming what to install."""


def missing_extra_message() -> str:
    return (
        f"--topology compiles for TPU chips with libtpu, which is not installed: "
        f"pip install 'jaxflash[tpu]' (or pip install {LIBTPU_PIN})"
    )


def check_libtpu() -> None:
    """Raise MissingTpuExtraError (one line) unless the libtpu package is importable."""
    if importlib.util.find_spec("libtpu") is None:
        raise MissingTpuExtraError(missing_extra_message())


def topology_devices(topology: ChipTopology) -> list[Any]:
    """The slice's compile-only devices (one per chip; per TensorCore on v4).

    Raises:
      MissingTpuExtraError: libtpu is absent (one line naming the package).
      ValueError: libtpu cannot lay the slice out (its first line, naming the slice).
    """
    check_libtpu()
    for key, value in TPU_COMPILE_ENV.items():
        os.environ.setdefault(key, value)
    from jax.experimental import topologies  # noqa: PLC0415

    kwargs: dict[str, Any] = {}
    if topology.chips < 4 or (topology.chip.dims == 2 and topology.chips == 8):
        # libtpu's default host holds 2x2x1 chips; a 1-chip slice, and v5e / v6e's
        # 8-chip single-host VM (2x4), say their host's bounds themselves.
        kwargs["chips_per_host_bounds"] = [*topology.grid, 1][:3]
    try:
        desc = topologies.get_topology_desc(
            topology_name=topology.libtpu_name, platform="tpu", **kwargs
        )
    except Exception as err:  # libtpu's INVALID_ARGUMENT: the grid it cannot lay out
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--topology {topology.name!r}: libtpu refused it: {first}") from None
    return list(desc.devices)
