"""Publish learner weights to generation meshes, stamped with a policy version.

The copy is device-to-device: params are first resharded *on the learner mesh*
to the generator's PartitionSpec (a jitted identity with ``out_shardings``),
so every target shard already exists whole on some learner device and
``jax.device_put`` onto the generation mesh moves it device to device. Without
that step, shards that do not exist in the source layout are gathered through
the host (checked on jax 0.10.2).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxflash import failpoints
from jaxflash.types import PolicyVersion


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionedParams:
    """Params on the generation mesh with the learner version that produced them.

    Attributes:
      params: pytree of jax.Array placed on the target shardings.
      version: learner step count of these weights (0 = initial weights).
    """

    params: Any
    version: PolicyVersion


def _check_targets(params: Any, target_shardings: Any) -> None:
    p_struct = jax.tree_util.tree_structure(params)
    s_struct = jax.tree_util.tree_structure(
        target_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    if p_struct != s_struct:
        raise ValueError(
            "publish: target_shardings must mirror params' tree structure; "
            f"params {p_struct} vs target_shardings {s_struct}"
        )
    for sh in jax.tree_util.tree_leaves(
        target_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    ):
        if not isinstance(sh, NamedSharding):
            raise ValueError(f"publish: target shardings must be NamedSharding, got {sh!r}")


_REPLICA_AXIS = "publish_replica"


def _staging_mesh(src: Mesh, tgt: Mesh) -> Mesh | None:
    """The learner's devices arranged as (replica, *generation mesh shape).

    Laying params out on it with the generator's PartitionSpec makes every
    learner shard identical in shape and content to a generator shard (each
    replicated ``replica`` times), so the final copy is one whole shard per
    target device. None when the generation mesh's size does not divide the
    learner's.
    """
    n_src, n_tgt = src.devices.size, tgt.devices.size
    if n_src % n_tgt or _REPLICA_AXIS in tgt.axis_names:
        return None
    devices = np.asarray(src.devices).reshape((n_src // n_tgt, *tgt.devices.shape))
    return Mesh(devices, (_REPLICA_AXIS, *tgt.axis_names))


def staging_shardings(params: Any, target_shardings: Any) -> Any:
    """Per-leaf sharding on the learner's devices with the target's layout (what the
    publish program reshards to; ``jaxflash.sizing`` compiles it ahead of time).

    Leaves that cannot be staged (not NamedSharding-placed, or a generation
    mesh whose size does not divide the learner's) keep their learner sharding
    and ``device_put`` falls back to JAX's own transfer.
    """
    cache: dict[tuple[int, int], Mesh | None] = {}

    def one(x: jax.Array, target: NamedSharding) -> Any:
        src = x.sharding
        if not isinstance(src, NamedSharding):
            return src
        key = (id(src.mesh), id(target.mesh))
        if key not in cache:
            cache[key] = _staging_mesh(src.mesh, target.mesh)
        staging = cache[key]
        return src if staging is None else NamedSharding(staging, target.spec)

    return jax.tree.map(one, params, target_shardings)


def _reshard(params: Any, shardings: Any) -> Any:
    # A fresh jit per call is cached by JAX on (tree, shapes, shardings), so the
    # steady state compiles once per layout pair.
    return jax.jit(lambda p: p, out_shardings=shardings)(params)


def check_version(version: PolicyVersion, previous: PolicyVersion | None) -> None:
    """Raise ValueError unless ``version`` is >= 0 and greater than ``previous``.

    Versions only go up: a generator must never be handed weights older than the
    ones it has ("Versions only go up").
    """
    if int(version) < 0:
        raise ValueError(f"publish: version must be >= 0, got {version}")
    if previous is not None and int(version) <= int(previous):
        raise ValueError(
            f"publish: policy versions must increase; got version {int(version)} "
            f"after version {int(previous)}"
        )


def publish(
    params: Any,
    target_shardings: Any,
    version: PolicyVersion,
    *,
    previous_version: PolicyVersion | None = None,
) -> VersionedParams:
    """Copy learner params onto generation-mesh shardings, device to device.

    Args:
      params: pytree of jax.Array on the learner mesh (NamedSharding leaves).
      target_shardings: pytree of NamedSharding on the generation mesh, same
        structure as params.
      version: policy version to stamp (>= 0).
      previous_version: the version the receiver holds now, if any; ``version``
        must exceed it. ``Publisher`` tracks this across calls.

    Returns:
      VersionedParams with bit-equal values on the target shardings. The source
      params are not donated (the learner keeps training on them).

    Raises:
      ValueError: negative or non-increasing version (names both versions), or
        target_shardings not mirroring params.
    """
    check_version(version, previous_version)
    _check_targets(params, target_shardings)
    staged = _reshard(params, staging_shardings(params, target_shardings))
    failpoints.reach("weight_transfer")
    src_ids = {id(x) for x in jax.tree.leaves(params)}
    if any(id(x) in src_ids for x in jax.tree.leaves(staged)):
        # Never hand the generator the learner's own buffers: the train step
        # donates them, which would delete the generator's weights.
        moved = jax.device_put(staged, target_shardings, may_alias=False)
    else:
        # ``staged`` is our private copy: donate it so the two do not coexist.
        moved = jax.device_put(staged, target_shardings, donate=True)
    return VersionedParams(params=moved, version=int(version))


class Publisher:
    """``publish`` that remembers the last version and refuses to go back.

    Thread-safe: the learner loop publishes, generation threads may read
    ``last_version``.
    """

    def __init__(self, last_version: PolicyVersion | None = None) -> None:
        self._lock = threading.Lock()
        self._last = last_version

    @property
    def last_version(self) -> PolicyVersion | None:
        return self._last

    def publish(
        self, params: Any, target_shardings: Any, version: PolicyVersion
    ) -> VersionedParams:
        """``publish(params, target_shardings, version)`` with the last version checked."""
        with self._lock:
            out = publish(params, target_shardings, version, previous_version=self._last)
            self._last = out.version
            return out


class AdapterPublisher:
    """Publish a LoRA learner to one LoRA engine: the frozen base once, then only the
    adapters at each version (``models.adapters.lora``; the engine applies them unmerged).

    Args:
      engine: a ``LlamaEngine`` built with ``lora`` (``place_base``, ``with_adapters``).
      adapter_shardings: the adapters' stacked NamedShardings on the engine's mesh
        (the staging target of the device-to-device copy).

    Attributes:
      base_bytes: bytes of the base moved (once, at the first publish).
      last_bytes: bytes the last publish moved (the adapters'; plus the base the
        first time).
      total_bytes: bytes moved by every publish so far.
    """

    def __init__(self, engine: Any, adapter_shardings: Any) -> None:
        self._engine = engine
        self._shardings = adapter_shardings
        self._publisher = Publisher()
        self._base: Any = None
        self.base_bytes = self.last_bytes = self.total_bytes = 0

    def publish(self, adapters: Any, base: Any, version: PolicyVersion) -> VersionedParams:
        """The LoRA model on the engine's mesh at ``version`` (base kept, adapters new).

        Args:
          adapters: the learner's adapters (``TrainState.params`` under LoRA).
          base: the learner's stored base (``TrainState.base``); read once.
          version: as ``publish``.

        Raises:
          ValueError: as ``publish`` (non-increasing version, shardings mismatch).
        """
        moved = 0
        if self._base is None:
            self._base = self._engine.place_base(base)
            self.base_bytes = moved = _tree_bytes(base)
        out = self._publisher.publish(adapters, self._shardings, version)
        moved += _tree_bytes(adapters)
        self.last_bytes = moved
        self.total_bytes += moved
        return VersionedParams(
            params=self._engine.with_adapters(self._base, out.params), version=out.version
        )


def _tree_bytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
