"""Layout descriptors for weight transfer between JAX programs (JSON, no pickle).

Two JAX programs (a learner and a generation slice, each its own
``jax.distributed`` job or a single process) cannot share ``jax.Array``s or
``Mesh`` objects: their devices belong to different clients. What they can
exchange is a description of how each array is cut: per leaf, its tree path,
shape, dtype, the mesh's axis names and shape, and the PartitionSpec. From that
both ends compute, with the same pure function, the block of the array that sits
at each mesh position (``LeafLayout.shard_index``), and so agree before any byte
moves on which whole shards travel.

Why it matters: ``jax.experimental.transfer`` copies buffers by their order, not
by their meaning; pulling into a sharding that cuts the array differently from
the sender's gives wrong values with no error (checked on jax 0.10.2). The rule
enforced here (``check_receivable``): every shard the receiver needs must exist
*whole* in the sender's layout; otherwise the transfer is refused naming the
leaf and both layouts. A sender makes that true by resharding on its own devices
to the receiver's layout first (``stage_for_layout``, the staging trick of
``sync.publish``).

Positions are row-major over ``mesh.devices`` (``mesh.devices.flat`` order), so
position p of a receiver's mesh and position p of a sender's staging mesh hold
the same block when their (axis names, shape, spec) agree.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.sharding.leaves import LayoutMismatchError, check_same_leaves

SpecEntry = str | tuple[str, ...] | None
Index = tuple[tuple[int, int], ...]  # per dim: [start, stop)

_FORMAT = 1
_STAGING_AXIS = "transfer_replica"


def _norm_entry(entry: Any) -> SpecEntry:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        return entry[0] if len(entry) == 1 else tuple(entry)
    raise ValueError(f"unsupported PartitionSpec entry {entry!r} (use None, an axis or a tuple)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafLayout:
    """How one array is cut over a mesh.

    Attributes:
      path: tree path of the leaf (``jax.tree_util.keystr``, e.g. "['layers']['w_q']").
      shape: the global array shape.
      dtype: numpy dtype name ("float32", "bfloat16", "int32", ...).
      mesh_axes: the mesh's axis names, outermost first.
      mesh_shape: the mesh's size along each axis.
      spec: one entry per array dim: None (not split), a mesh axis, or a tuple of
        mesh axes (split over their product, first axis major).

    Raises:
      ValueError: spec longer than the shape, an axis not in the mesh or used
        twice, mesh sizes < 1, or a dim not divisible by its axes' product
        (names the leaf and the numbers).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    spec: tuple[SpecEntry, ...]

    def __post_init__(self) -> None:
        where = f"leaf {self.path}"
        if len(self.mesh_axes) != len(self.mesh_shape) or min(self.mesh_shape, default=1) < 1:
            raise ValueError(f"{where}: mesh axes {self.mesh_axes} vs shape {self.mesh_shape}")
        if len(self.spec) > len(self.shape):
            raise ValueError(f"{where}: spec {self.spec} has more entries than shape {self.shape}")
        spec = tuple(_norm_entry(e) for e in self.spec) + (None,) * (
            len(self.shape) - len(self.spec)
        )
        object.__setattr__(self, "spec", spec)
        used: list[str] = []
        for dim, entry in enumerate(spec):
            axes = self._axes(entry)
            for a in axes:
                if a not in self.mesh_axes:
                    raise ValueError(f"{where}: spec axis {a!r} not in mesh axes {self.mesh_axes}")
                if a in used:
                    raise ValueError(f"{where}: mesh axis {a!r} splits two dims in {spec}")
                used.append(a)
            parts = self._parts(axes)
            if self.shape[dim] % parts:
                raise ValueError(
                    f"{where}: dim {dim} of size {self.shape[dim]} is not divisible by "
                    f"{parts} (mesh axes {axes})"
                )
        np.dtype(jnp.dtype(self.dtype))  # raises TypeError on an unknown dtype name

    @staticmethod
    def _axes(entry: SpecEntry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else entry

    def _parts(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh_shape[self.mesh_axes.index(a)] for a in axes)

    @property
    def positions(self) -> int:
        """Number of mesh positions (devices of the mesh)."""
        return math.prod(self.mesh_shape)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(
            n // self._parts(self._axes(e)) for n, e in zip(self.shape, self.spec, strict=True)
        )

    @property
    def itemsize(self) -> int:
        return np.dtype(jnp.dtype(self.dtype)).itemsize

    @property
    def shard_nbytes(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    def shard_index(self, position: int) -> Index:
        """[start, stop) per dim of the block held at mesh position ``position``."""
        coords = dict(zip(self.mesh_axes, np.unravel_index(position, self.mesh_shape), strict=True))
        index = []
        for n, entry, size in zip(self.shape, self.spec, self.shard_shape, strict=True):
            block = 0
            for a in self._axes(entry):  # mixed radix, first axis major (as JAX does)
                block = block * self.mesh_shape[self.mesh_axes.index(a)] + int(coords[a])
            index.append((block * size, block * size + size) if n else (0, 0))
        return tuple(index)

    def describe(self) -> str:
        mesh = ", ".join(f"{a}={s}" for a, s in zip(self.mesh_axes, self.mesh_shape, strict=True))
        return f"{self.dtype}{list(self.shape)} on mesh ({mesh}) spec {PartitionSpec(*self.spec)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "mesh_axes": list(self.mesh_axes),
            "mesh_shape": list(self.mesh_shape),
            "spec": [list(e) if isinstance(e, tuple) else e for e in self.spec],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeafLayout:
        want = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != want:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"LeafLayout JSON needs keys {sorted(want)}, got {got}")
        return cls(
            path=str(d["path"]),
            shape=tuple(int(n) for n in d["shape"]),
            dtype=str(d["dtype"]),
            mesh_axes=tuple(str(a) for a in d["mesh_axes"]),
            mesh_shape=tuple(int(n) for n in d["mesh_shape"]),
            spec=tuple(_norm_entry(e) for e in d["spec"]),
        )


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """LeafLayouts of a whole pytree, in ``jax.tree_util`` flatten order."""

    leaves: tuple[LeafLayout, ...]

    def __post_init__(self) -> None:
        paths = [leaf.path for leaf in self.leaves]
        if len(set(paths)) != len(paths):
            raise ValueError(f"TreeLayout: duplicate leaf paths in {paths}")

    def by_path(self) -> dict[str, LeafLayout]:
        return {leaf.path: leaf for leaf in self.leaves}

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tree (one copy of every leaf)."""
        return sum(math.prod(leaf.shape) * leaf.itemsize for leaf in self.leaves)

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, "leaves": [leaf.to_json() for leaf in self.leaves]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TreeLayout:
        if not isinstance(d, dict) or d.get("format") != _FORMAT or set(d) != {"format", "leaves"}:
            raise ValueError(f"TreeLayout JSON must be {{'format': {_FORMAT}, 'leaves': [...]}}")
        return cls(tuple(LeafLayout.from_json(x) for x in d["leaves"]))


def _spec_of(sharding: NamedSharding, ndim: int) -> tuple[SpecEntry, ...]:
    return tuple(_norm_entry(e) for e in sharding.spec) + (None,) * (ndim - len(sharding.spec))


def normalize_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A JAX shard index (tuple of slices, None for whole dims) as [start, stop) pairs."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def leaf_layout(path: str, x: Any) -> LeafLayout:
    """LeafLayout of an array or ShapeDtypeStruct placed with a NamedSharding.

    Checks the descriptor's own block arithmetic against JAX's
    ``devices_indices_map`` for this sharding, so the two can never disagree.

    Raises:
      LayoutMismatchError: no sharding, not a NamedSharding, or a mismatch with JAX.
    """
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise LayoutMismatchError(
            path,
            f"leaf {path}: transfer needs a NamedSharding, got {sharding!r} "
            "(put the array on a Mesh with jax.device_put(x, NamedSharding(mesh, spec)))",
        )
    mesh = sharding.mesh
    layout = LeafLayout(
        path=path,
        shape=tuple(int(n) for n in x.shape),
        dtype=np.dtype(x.dtype).name,
        mesh_axes=tuple(mesh.axis_names),
        mesh_shape=tuple(int(n) for n in mesh.devices.shape),
        spec=_spec_of(sharding, len(x.shape)),
    )
    jax_map = sharding.devices_indices_map(layout.shape)
    for p, device in enumerate(mesh.devices.flat):
        if normalize_index(jax_map[device], layout.shape) != layout.shard_index(p):
            raise LayoutMismatchError(
                path, f"leaf {path}: block arithmetic disagrees with JAX at position {p}"
            )
    return layout


def layout_of(tree: Any) -> TreeLayout:
    """TreeLayout of a pytree of NamedSharding-placed arrays or ShapeDtypeStructs."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return TreeLayout(tuple(leaf_layout(jax.tree_util.keystr(kp), x) for kp, x in flat))


def check_receivable(offered: TreeLayout, wanted: TreeLayout) -> None:
    """Refuse unless every shard ``wanted`` needs exists whole in ``offered``.

    Args:
      offered: the sender's layout (what it holds, per leaf).
      wanted: the receiver's layout (what it must end up with).

    Raises:
      LayoutMismatchError: leaves missing on either side, a different shape or dtype,
        or a receiver shard that is not a whole sender shard. The message names
        the leaf and both layouts.
    """
    have, need = offered.by_path(), wanted.by_path()
    check_same_leaves(
        {p: (x.shape, x.dtype) for p, x in have.items()},
        {p: (x.shape, x.dtype) for p, x in need.items()},
    )
    for path, w in need.items():
        o = have[path]
        held = {o.shard_index(p) for p in range(o.positions)}
        for p in range(w.positions):
            if w.shard_index(p) not in held:
                raise LayoutMismatchError(
                    path,
                    f"leaf {path}: sharding mismatch: the receiver's layout {w.describe()} needs "
                    f"block {list(w.shard_index(p))} (position {p}), which the sender's layout "
                    f"{o.describe()} does not hold whole. Reshard the sender to the receiver's "
                    "layout first (sync.transfer_layout.stage_for_layout).",
                )


def stage_for_layout(params: Any, wanted: TreeLayout) -> Any:
    """Copy ``params`` onto their own devices laid out as the receiver's layout.

    The sender's devices are arranged as (replica, *receiver mesh shape) and each
    leaf gets the receiver's PartitionSpec (a jitted identity with
    ``out_shardings``: collectives on the sender's mesh, never through the host),
    so every block the receiver needs exists whole on some sender device.

    Args:
      params: pytree of jax.Array (NamedSharding) on the sender's mesh; in a
        multi-process sender every process calls this (SPMD).
      wanted: the receiver's TreeLayout (from its JSON descriptor).

    Returns:
      A new pytree (fresh buffers; ``params`` is untouched) whose
      ``layout_of`` passes ``check_receivable(.., wanted)``.

    Raises:
      LayoutMismatchError: tree paths or shapes differ from ``wanted``, or the
        sender's device count is not a multiple of a receiver mesh's size.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    need = wanted.by_path()
    paths = [jax.tree_util.keystr(kp) for kp, _ in flat]
    if sorted(paths) != sorted(need):
        raise LayoutMismatchError(
            "", f"stage_for_layout: tree paths {paths} != wanted {sorted(need)}"
        )
    meshes: dict[tuple, Mesh] = {}
    shardings = []
    for path, (_, x) in zip(paths, flat, strict=True):
        w = need[path]
        if tuple(x.shape) != w.shape:
            raise LayoutMismatchError(path, f"leaf {path}: shape {x.shape} != wanted {w.shape}")
        devices = np.asarray(x.sharding.mesh.devices).reshape(-1)
        if devices.size % w.positions:
            raise LayoutMismatchError(
                path,
                f"leaf {path}: the sender's {devices.size} devices are not a multiple of the "
                f"receiver mesh's {w.positions} positions; no staging layout exists",
            )
        key = (tuple(d.id for d in devices), w.mesh_axes, w.mesh_shape)
        if key not in meshes:
            grid = devices.reshape((devices.size // w.positions, *w.mesh_shape))
            meshes[key] = Mesh(grid, (_STAGING_AXIS, *w.mesh_axes))
        shardings.append(NamedSharding(meshes[key], PartitionSpec(*w.spec)))
    leaves = [x for _, x in flat]
    staged = jax.jit(lambda xs: xs, out_shardings=shardings)(leaves)
    # The learner donates ``params`` in its next step, so no output may share a
    # buffer with them; should XLA forward an input unchanged, copy that leaf.
    staged = [
        jax.device_put(y, y.sharding, may_alias=False) if _shares_buffer(x, y) else y
        for x, y in zip(leaves, staged, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, staged)


def _shares_buffer(x: jax.Array, y: jax.Array) -> bool:
    ptrs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in ptrs for s in y.addressable_shards)
