"""TPU chips and slice names: what a ``--topology`` means, and a roofline per chip.

No JAX here: the names parse, and the chip figures are known, without libtpu.

A slice is named as Google Cloud writes its accelerator type: ``v5e-16``,
``v6e-8``, ``v5p-64``, ``v4-32`` (also ``v5litepod-16``, GCP's API name for
v5e), or by its chip grid as libtpu takes it: ``v5e:4x4``, ``v5p:2x4x4``. The
number in a v5e / v6e name counts chips; in a v5p / v4 name it counts
TensorCores, two per chip, so ``v5p-64`` is 32 chips (a 2x4x4 grid).

Chip figures (per chip, from the Google Cloud TPU system-architecture pages):

- v4: https://cloud.google.com/tpu/docs/v4 -- 275 bf16 TFLOP/s, 32 GiB HBM2,
  1200 GB/s.
- v5e: https://cloud.google.com/tpu/docs/v5e -- 197 bf16 TFLOP/s, 16 GB HBM2,
  819 GB/s, 400 GB/s bidirectional ICI per chip.
- v5p: https://cloud.google.com/tpu/docs/v5p -- 459 bf16 TFLOP/s, 95 GB HBM2e,
  2765 GB/s, 1200 GB/s bidirectional ICI per chip.
- v6e (Trillium): https://cloud.google.com/tpu/docs/v6e -- 918 bf16 TFLOP/s,
  32 GB HBM, 1638 GB/s.

``usable_hbm_bytes`` is what the TPU compiler in libtpu 0.0.42.1 lets one
program use per device (the "available HBM" of its RESOURCE_EXHAUSTED message,
read on this machine): a little under the chip's HBM. Headroom is against it.
"""

from __future__ import annotations

import dataclasses
import math
import re

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipSpec:
    """Published figures of one TPU chip.

    Attributes:
      kind: "v4", "v5e", "v5p" or "v6e" (libtpu's topology prefix).
      hbm_bytes: HBM per chip as published (bytes).
      usable_hbm_bytes: HBM one program may use per chip under libtpu's compiler.
      peak_flops: bf16 peak, FLOP/s per chip.
      hbm_bandwidth: HBM bandwidth, bytes/s per chip.
      cores_in_name: TensorCores per chip counted by the GCP name's number (2 for
        v4 / v5p, whose ``v5p-8`` is 4 chips; 1 for v5e / v6e).
      dims: rank of the chip grid (2 for v5e / v6e, 3 for v4 / v5p).
      source: the page the figures come from.
      ici_bandwidth: bidirectional inter-chip interconnect bandwidth per chip,
        bytes/s, as published (0: not taken from a source here; the forecast then
        leaves the weight copy between slices out).
    """

    kind: str
    hbm_bytes: int
    usable_hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    cores_in_name: int
    dims: int
    source: str
    ici_bandwidth: float = 0.0


CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec(
        kind="v4",
        hbm_bytes=32 * GIB,
        usable_hbm_bytes=int(30.5 * GIB),  # libtpu: 15.25 GiB per TensorCore device
        peak_flops=275e12,
        hbm_bandwidth=1200e9,
        cores_in_name=2,
        dims=3,
        source="https://cloud.google.com/tpu/docs/v4",
    ),
    "v5e": ChipSpec(
        kind="v5e",
        hbm_bytes=16 * GIB,
        usable_hbm_bytes=int(15.75 * GIB),
        peak_flops=197e12,
        hbm_bandwidth=819e9,
        cores_in_name=1,
        dims=2,
        source="https://cloud.google.com/tpu/docs/v5e",
        ici_bandwidth=400e9,
    ),
    "v5p": ChipSpec(
        kind="v5p",
        hbm_bytes=95 * 10**9,
        usable_hbm_bytes=int(95.74 * GIB),
        peak_flops=459e12,
        hbm_bandwidth=2765e9,
        cores_in_name=2,
        dims=3,
        source="https://cloud.google.com/tpu/docs/v5p",
        ici_bandwidth=1200e9,
    ),
    "v6e": ChipSpec(
        kind="v6e",
        hbm_bytes=32 * 10**9,
        usable_hbm_bytes=int(31.25 * GIB),
        peak_flops=918e12,
        hbm_bandwidth=1638e9,
        cores_in_name=1,
        dims=2,
        source="https://cloud.google.com/tpu/docs/v6e",
    ),
}

_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e"}
# Slice sizes (chips) offered per kind: v5e / v6e up to a 256-chip pod (GCP's
# tables); v4 / v5p the power-of-two shapes up to 1024 chips (larger ones exist).
_MAX_CHIPS = {"v4": 1024, "v5e": 256, "v5p": 1024, "v6e": 256}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipTopology:
    """A TPU slice by name.

    Attributes:
      name: as given (``v5e-16``).
      chip: its ChipSpec.
      grid: chips per dimension, e.g. (4, 4) or (2, 4, 4).
    """

    name: str
    chip: ChipSpec
    grid: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.grid)

    @property
    def libtpu_name(self) -> str:
        """The ``topology_name`` of ``jax.experimental.topologies.get_topology_desc``."""
        return f"{self.chip.kind}:{'x'.join(map(str, self.grid))}"

    @property
    def gcp_name(self) -> str:
        """GCP's accelerator type (``v5p-64`` counts TensorCores)."""
        return f"{self.chip.kind}-{self.chips * self.chip.cores_in_name}"


def grid_for(kind: str, chips: int) -> tuple[int, ...]:
    """The chip grid GCP gives a slice of ``chips`` chips (v5e 16 -> 4x4, v5p 32 -> 2x4x4).

    2-D kinds: 1x1, 2x2 (4), 2x4 (8), then doubling the shorter side. 3-D kinds:
    2x2x1 (4), 2x2x2 (8), then doubling the shortest side from the last.

    Raises:
      ValueError: not a power of two, or beyond the kind's largest listed slice.
    """
    dims = CHIPS[kind].dims
    if chips < 1 or chips & (chips - 1) or chips > _MAX_CHIPS[kind]:
        raise ValueError(f"{kind} has no slice of {chips} chips")
    if dims == 2:
        if chips == 2:  # not offered by GCP as a slice
            raise ValueError(f"{kind} has no slice of {chips} chips")
        grid = [1, 1]
        while math.prod(grid) < chips:
            i = 0 if grid[0] < grid[1] or math.prod(grid) == 1 else 1
            grid[i] *= 2
        return tuple(sorted(grid))
    if chips < 4:
        raise ValueError(f"{kind} has no slice of {chips} chips")
    grid = [2, 2, 1]
    while math.prod(grid) < chips:
        grid[min(range(3), key=lambda i: (grid[i], -i))] *= 2
    return tuple(grid)  # GCP's order: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...


def valid_names() -> list[str]:
    """Every GCP-style slice name ``parse_topology`` takes, smallest first per kind."""
    out = []
    for kind, spec in CHIPS.items():
        chips = 1
        while chips <= _MAX_CHIPS[kind]:
            try:
                grid_for(kind, chips)
                out.append(f"{kind}-{chips * spec.cores_in_name}")
            except ValueError:
                pass
            chips *= 2
    return out


def parse_topology(name: str) -> ChipTopology:
    """A slice from its GCP name (``v5e-16``, ``v5p-64``) or grid form (``v5e:4x4``).

    Raises:
      ValueError: an unknown kind or size, naming the valid ones.
    """
    text = name.strip().lower()
    m_grid = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", text)
    m_gcp = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    kind = re.split(r"[:-]", text, maxsplit=1)[0]
    kind = _ALIASES.get(kind, kind)
    listing = ", ".join(valid_names())
    if kind not in CHIPS:
        raise ValueError(
            f"--topology {name!r}: unknown TPU kind; use one of {sorted(CHIPS)} as "
            f"<kind>-<N> (GCP's name: {listing}) or <kind>:<grid> (e.g. v5e:4x4)"
        )
    spec = CHIPS[kind]
    example = f"{kind}:{'x'.join(map(str, grid_for(kind, 16)))}"
    if not (m_grid or m_gcp):
        raise ValueError(
            f"--topology {name!r}: not a slice name; use {kind}-<N> (GCP's name) or "
            f"{kind}:<grid> (e.g. {example})"
        )
    if m_grid:
        grid = tuple(int(x) for x in m_grid.group(2).split("x"))
        if len(grid) != spec.dims or min(grid) < 1:
            raise ValueError(
                f"--topology {name!r}: a {kind} grid has {spec.dims} dimensions (e.g. {example})"
            )
        try:  # a slice size GCP offers (a power of two of chips: so is every side)
            grid_for(kind, math.prod(grid))
        except ValueError as err:
            raise ValueError(f"--topology {name!r}: {err}; valid: {listing}") from None
        return ChipTopology(name=name, chip=spec, grid=grid)
    n = int(m_gcp.group(2))
    if n % spec.cores_in_name:
        raise ValueError(
            f"--topology {name!r}: {kind}-N counts TensorCores ({spec.cores_in_name} per "
            f"chip), so N must be even; valid: {listing}"
        )
    try:
        grid = grid_for(kind, n // spec.cores_in_name)
    except ValueError as err:
        raise ValueError(f"--topology {name!r}: {err}; valid: {listing}") from None
    return ChipTopology(name=name, chip=spec, grid=grid)


def roofline_seconds(
    flops: float, bytes_accessed: float, chip: ChipSpec, *, share: int = 1
) -> float:
    """Lower bound on a program's time on one device: max(FLOPs / peak, bytes / bandwidth).

    Args:
      flops: FLOPs one device executes (``compiled.cost_analysis()["flops"]`` of an
        SPMD program is per device).
      bytes_accessed: HBM bytes one device reads and writes (``"bytes accessed"``).
      chip: the chip's figures.
      share: devices per chip (2 when libtpu exposes each TensorCore of a v4 chip as
        a device): each gets 1/share of the chip's peak and bandwidth.

    Returns:
      Seconds; ignores communication, latency and imperfect overlap.
    """
    return max(flops * share / chip.peak_flops, bytes_accessed * share / chip.hbm_bandwidth)
