"""Move a pytree (the learner's TrainState) onto a mesh of a different device set.

The elastic pool (ReFlow, arXiv 2610.21640; ROLL's partial_gpu_mode) changes the
learner's devices at a step boundary: params and optimizer state must land on
the new learner mesh bit for bit, without a trip through host memory.

``jax.device_put`` copies device to device only when every shard the target
needs already exists whole on some source device; otherwise it gathers the
array through the host (``jax._src.array.shard_sharded_device_array_slow_path``
falls back to ``x._value``; checked on jax 0.10.2). So each leaf takes one of
three paths, all device-side:

- ``direct``: the target's shards exist in the source layout (e.g. same
  PartitionSpec over an overlapping or equal-size device set): one ``device_put``.
- ``staged``: the target mesh's size divides the source's. Reshard on the source
  devices, laid out as (replica, *target mesh) with the target's PartitionSpec
  (a jitted identity: collectives on the source mesh), so every target shard
  exists whole; then ``device_put`` (as ``sync.publish`` does).
- ``via_replicated`` (growing, or sizes that do not divide): all-gather on the
  source mesh, copy the whole array to each target device, slice locally on the
  target mesh. Peak memory: one full leaf per target device, one leaf at a time.

Call it between two learner steps: ``new_state, report = reshard(state,
state_shardings(model_cfg, learner_cfg, new_mesh, rules))`` and drop ``state``:
on devices that belong to both meshes ``device_put`` may reuse the very buffer
instead of copying it, so the old tree shares buffers with the new one (and the
next train step donates them). Intermediates are released leaf by leaf.
``LayoutCache`` builds per-mesh objects (jitted train steps, shardings) once per
device layout and reuses them when the pool returns to a layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_STAGING_AXIS = "reshard_replica"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReshardReport:
    """What a reshard did: leaf counts per path and the bytes moved."""

    leaves: int
    bytes: int
    direct: int
    staged: int
    via_replicated: int


def _identity(x: Any) -> Any:
    return x


_JITS: dict[Hashable, Callable] = {}


def _to(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Jitted identity with out_shardings (one compiled copy per sharding and shape)."""
    fn = _JITS.get(sharding)
    if fn is None:
        fn = _JITS[sharding] = jax.jit(_identity, out_shardings=sharding)
    return fn(x)


def shards_present(src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape) -> bool:
    """True iff every shard ``dst`` places on a device exists whole in ``src``'s layout.

    Exactly the condition under which ``jax.device_put`` copies device to device.
    """

    def key(index: tuple) -> tuple:
        return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)

    have = {key(i) for i in src.devices_indices_map(tuple(shape)).values()}
    return all(key(i) in have for i in dst.devices_indices_map(tuple(shape)).values())


def _source_mesh(x: jax.Array) -> Mesh:
    sh = x.sharding
    if isinstance(sh, NamedSharding):
        return sh.mesh
    devices = sorted(sh.device_set, key=lambda d: d.id)
    return Mesh(np.asarray(devices, dtype=object), ("reshard_all",))


def staging_sharding(src: Mesh, tgt: Mesh, spec: PartitionSpec) -> NamedSharding | None:
    """``spec`` on ``src``'s devices laid out as (replica, *tgt's mesh shape), so each
    target shard exists whole on the source; None when tgt's size does not divide src's."""
    n_src, n_tgt = src.devices.size, tgt.devices.size
    if n_src % n_tgt or _STAGING_AXIS in tgt.axis_names:
        return None
    devices = np.asarray(src.devices).reshape((n_src // n_tgt, *tgt.devices.shape))
    return NamedSharding(Mesh(devices, (_STAGING_AXIS, *tgt.axis_names)), spec)


def _copy(x: jax.Array, target: NamedSharding) -> jax.Array:
    if not shards_present(x.sharding, target, x.shape):  # a bug here, not a slow path
        raise RuntimeError(f"reshard: shards of {target} missing on the source: host round trip")
    return jax.device_put(x, target)


def _move_leaf(x: jax.Array, target: NamedSharding) -> tuple[jax.Array, str]:
    if shards_present(x.sharding, target, x.shape):
        return _copy(x, target), "direct"
    src = _source_mesh(x)
    staging = staging_sharding(src, target.mesh, target.spec)
    if staging is not None and shards_present(staging, target, x.shape):
        return _copy(_to(x, staging), target), "staged"
    # Not .delete()d: device_put may hand back these very buffers on shared devices.
    gathered = _to(x, NamedSharding(src, PartitionSpec()))
    whole = _copy(gathered, NamedSharding(target.mesh, PartitionSpec()))
    return _to(whole, target), "via_replicated"


def reshard(tree: Any, target_shardings: Any) -> tuple[Any, ReshardReport]:
    """Copy every leaf of ``tree`` onto ``target_shardings`` without a host round trip.

    Args:
      tree: pytree of jax.Array (e.g. a TrainState) on the current learner mesh.
      target_shardings: same structure, NamedSharding leaves on the new mesh
        (``learner.state.state_shardings(..., new_mesh, rules)``); None subtrees
        of ``tree`` (e.g. ``ref_params=None``) are skipped.

    Returns:
      (the tree on the target shardings with bit-equal values, ReshardReport).
      Do not use ``tree`` afterwards: it may share buffers with the result.

    Raises:
      ValueError: structures differ, a target leaf that is not a NamedSharding,
        or a shape that the target sharding cannot split.
    """
    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    targets, tdef = jax.tree_util.tree_flatten(target_shardings, is_leaf=is_sharding)
    if treedef != tdef:
        raise ValueError(f"reshard: target_shardings {tdef} must mirror the tree {treedef}")
    counts = {"direct": 0, "staged": 0, "via_replicated": 0}
    out, nbytes = [], 0
    for i, (x, t) in enumerate(zip(leaves, targets, strict=True)):
        if not isinstance(t, NamedSharding):
            raise ValueError(f"reshard: target leaf {i} is {t!r}, not a NamedSharding")
        if not isinstance(x, jax.Array):
            raise ValueError(f"reshard: leaf {i} is {type(x).__name__}, not a jax.Array")
        try:
            t.shard_shape(x.shape)
        except ValueError as err:
            raise ValueError(f"reshard: leaf {i} of shape {x.shape}: {err}") from None
        y, path = _move_leaf(x, t)
        counts[path] += 1
        nbytes += x.nbytes
        out.append(y)
    report = ReshardReport(leaves=len(out), bytes=int(nbytes), **counts)
    return jax.tree_util.tree_unflatten(treedef, out), report


def mesh_layout(mesh: Mesh) -> tuple:
    """Hashable identity of a mesh's layout: axis names, shape and device ids in order."""
    return (mesh.axis_names, mesh.devices.shape, tuple(d.id for d in mesh.devices.flat))


class LayoutCache(Generic[T]):
    """``build(mesh)`` once per device layout (e.g. a jitted train step per learner mesh).

    Args:
      build: function of a Mesh; its result is kept and returned for every later
        mesh with the same ``mesh_layout``.
    """

    def __init__(self, build: Callable[[Mesh], T]):
        self._build = build
        self._cache: dict[tuple, T] = {}
        self.builds = 0

    def __call__(self, mesh: Mesh) -> T:
        key = mesh_layout(mesh)
        if key not in self._cache:
            self._cache[key] = self._build(mesh)
            self.builds += 1
        return self._cache[key]

    def values(self) -> list[T]:
        """Everything built so far, in build order."""
        return list(self._cache.values())
