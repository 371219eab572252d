"""A host TrainBatch on the learner's devices: packed, split into micro-batches, checked.

``device_batch`` is what a jitted learner program (``learner.step``, ``learner.scoring``)
receives: a dict of TrainBatch fields [M, b, T] laid out per ``batch_sharding`` (b over
the rules' "batch" axes). Rows of one sequence each are packed first when
``learner.packing`` is on (``learner.packing``); a batch whose shapes disagree, or
that holds replayed rows for a step without a replay loss, is refused here, before
any device work. ``mesh_context`` is where those programs run.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxflash.learner.batching import ROUTES_FIELD, TRAIN_BATCH_FIELDS, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.packing import pack_groups, pack_rows
from jaxflash.models.caches import attention
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.sharding.rules import Rules, logical_to_spec
from jaxflash.types import TrainBatch

DeviceBatch = dict[str, jax.Array]  # TrainBatch fields, [M, b, T] each


def batch_sharding(mesh: Mesh, rules: Rules, micro_batch_size: int) -> NamedSharding:
    """Sharding of [M, b, T] batch arrays: b over the rules' "batch" axes if divisible."""
    spec = logical_to_spec((None, "batch", None), mesh, rules, (1, micro_batch_size, 1))
    return NamedSharding(mesh, spec)


def to_device_batch(
    batch: TrainBatch, micro_batch_size: int, sharding: NamedSharding, *, dual_cycle: bool
) -> DeviceBatch:
    """Host TrainBatch [B, T] or [M, b, T] -> dict of device arrays [M, b, T].

    Raises:
      ValueError: inconsistent shapes, or replayed rows (``cycle_bt`` != 0) for a
        step built without ``replay_loss`` (they would silently take the fresh loss).
    """
    if np.ndim(batch.input_ids_bt) == 2:
        batch = split_micro_batches(batch, micro_batch_size)
    arrays = {k: getattr(batch, k) for k in TRAIN_BATCH_FIELDS}
    for k in ("cycle_bt", "segment_ids_bt"):  # None: all fresh / one sequence per row
        if arrays[k] is None:
            arrays[k] = np.zeros(np.shape(arrays["input_ids_bt"]), np.int32)
    if not dual_cycle and np.any(np.asarray(arrays["cycle_bt"]) != 0):
        raise ValueError(
            "train batch has replayed rows (cycle_bt != 0) but the learner was built "
            "without LearnerConfig.replay_loss (one loss for every row)"
        )
    shape = np.shape(arrays["input_ids_bt"])
    if len(shape) != 3 or shape[1] != micro_batch_size:
        raise ValueError(
            f"train batch must be [B, T] or [M, b={micro_batch_size}, T], got input_ids {shape}"
        )
    for k, v in arrays.items():
        if np.shape(v) != shape:
            raise ValueError(f"train batch field {k} has shape {np.shape(v)}, expected {shape}")
    routes = batch.routed_experts_btlk  # MoE routes [M, b, T, L, k]: only when recorded
    if routes is not None:
        if np.shape(routes)[:3] != shape or np.ndim(routes) != 5:
            raise ValueError(
                f"train batch field {ROUTES_FIELD} has shape {np.shape(routes)}, expected "
                f"{shape} + (L, k)"
            )
        arrays[ROUTES_FIELD] = routes
    return jax.device_put(arrays, sharding)


def device_batch(batch: TrainBatch, lc: LearnerConfig, sharding: NamedSharding) -> DeviceBatch:
    """A host batch packed (``learner.packing``, prompts shared under
    ``learner.prefix_sharing``) when asked, then on the devices."""
    if lc.packing and np.ndim(batch.input_ids_bt) == 2 and one_per_row(batch):
        if lc.prefix_sharing:
            batch = pack_groups(
                batch, row_length=lc.pack_length, length_multiple=lc.length_multiple
            )[0]
        else:
            batch = pack_rows(batch, row_length=lc.pack_length)[0]
    return to_device_batch(batch, lc.micro_batch_size, sharding, dual_cycle=lc.dual_cycle)


def one_per_row(batch: TrainBatch) -> bool:
    """Whether every row holds one sequence (no segment ids, or none above 1)."""
    return batch.segment_ids_bt is None or int(np.max(batch.segment_ids_bt)) <= 1


def mesh_context(mesh: Mesh, mc: ModelConfig):
    """``jax.set_mesh(mesh)`` where attention runs the splash kernel (its ``shard_map``
    reads the mesh), else a no-op (nothing else changes)."""
    platform = mesh.devices.flat[0].platform
    if attention.resolve(mc.attention, platform, mc.sliding_window) == "splash":
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()
