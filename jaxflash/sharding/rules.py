"""Logical-axis rules: how each named array dimension maps onto mesh axes.

Models name their dimensions (``batch``, ``seq``, ``cache_seq``, ``layers``,
``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, and for
mixture-of-experts layers ``expert``, ``expert_mlp``, ``router``); a rules
table per role maps each name to a mesh axis, a tuple of mesh axes, or None
(replicated). A new parallelism strategy is a new table, not new model code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = dict[str, str | tuple[str, ...] | None]

LEARNER_RULES: Rules = {
    # Batch over the data-parallel axes (expert parallelism is data parallel outside
    # the experts); parameters' embed dim over fsdp (ZeRO-3 style: all-gathered per
    # layer inside the scan); heads, MLP and vocabulary over tensor (Megatron split);
    # experts over expert (their matrices never gathered whole on one device by the
    # layout; GSPMD moves tokens or weights as the grouped matmul needs).
    "batch": ("data", "fsdp", "expert"),
    "seq": None,
    "cache_seq": None,
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": "expert",
    "expert_mlp": "tensor",
    "router": None,  # [D, E] router: small, kept whole so routing needs no gather
}

GENERATOR_RULES: Rules = {
    # Tensor parallel only: full weights per tensor group, batch (engine slots)
    # over data; decode is latency-bound, so no per-layer weight gathers.
    "batch": "data",
    "seq": None,
    "cache_seq": None,
    "layers": None,
    "vocab": "tensor",
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": "expert",
    "expert_mlp": "tensor",
    "router": None,
}


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def logical_to_spec(
    axes: tuple[str | None, ...], mesh: Mesh, rules: Rules, shape: tuple[int, ...] | None = None
) -> PartitionSpec:
    """PartitionSpec for one array from its logical axis names.

    A dimension is replicated instead of sharded when (a) its name is None or
    maps to None, (b) the shape is given and the dim is not divisible by the
    product of its mesh axes' sizes (e.g. SmolLM2's 3 kv heads on a 2-way tensor
    axis: those weights are replicated over ``tensor`` while q heads, MLP and
    vocabulary still split), or (c) one of its mesh axes is already used by an
    earlier dimension of the same array (a mesh axis may shard one dim only).

    Args:
      axes: one logical name (or None) per array dim.
      mesh: target mesh.
      rules: logical name -> mesh axis / tuple of mesh axes / None.
      shape: the array's shape, to check divisibility; None skips the check.

    Raises:
      ValueError: a logical name missing from ``rules``, a rule naming an axis
        the mesh lacks, or ``shape`` of a different rank than ``axes``.
    """
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule; rules cover {sorted(rules)}")
        target = rules[name]
        mesh_axes = () if target is None else (target,) if isinstance(target, str) else target
        for a in mesh_axes:
            if a not in mesh.shape:
                raise ValueError(f"rule {name!r} -> {a!r}: mesh has axes {tuple(mesh.shape)}")
        # Size-1 axes shard nothing; dropping them keeps specs readable.
        mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1 and a not in used)
        size = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
        if not mesh_axes or (shape is not None and shape[i] % size):
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def logical_to_shardings(
    logical_axes_tree: Any, mesh: Mesh, rules: Rules, *, shapes: Any = None
) -> Any:
    """A NamedSharding for every leaf of a tree of logical-axis tuples.

    Args:
      logical_axes_tree: nested dict (or list) whose leaves are tuples of logical
        names, e.g. ``jaxflash.models.decoder.transformer.logical_axes(config)``.
      mesh: target mesh (``make_mesh``).
      rules: ``LEARNER_RULES``, ``GENERATOR_RULES`` or your own table.
      shapes: optional tree with the same structure whose leaves have ``.shape``
        (arrays or ShapeDtypeStructs, e.g. ``abstract_params(config)``). Pass it:
        with it, dims that do not divide evenly fall back to replication (see
        ``logical_to_spec``); without it they are assumed divisible.

    Returns:
      The same tree structure with NamedSharding leaves.
    """
    if shapes is None:
        return _map_axes(
            lambda axes: NamedSharding(mesh, logical_to_spec(axes, mesh, rules)), logical_axes_tree
        )
    return _map_axes(
        lambda axes, arr: NamedSharding(mesh, logical_to_spec(axes, mesh, rules, tuple(arr.shape))),
        logical_axes_tree,
        shapes,
    )


def _map_axes(fn, tree, *rest):
    if _is_axes(tree):
        return fn(tree, *rest)
    if isinstance(tree, dict):
        missing = set(tree) ^ set(rest[0]) if rest else set()
        if missing:
            raise ValueError(f"logical axes and shapes trees differ at keys {sorted(missing)}")
        return {k: _map_axes(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # NamedTuple, e.g. KVCache
        return type(tree)(*(_map_axes(fn, v, *(r[i] for r in rest)) for i, v in enumerate(tree)))
    if isinstance(tree, list):
        return [_map_axes(fn, v, *(r[i] for r in rest)) for i, v in enumerate(tree)]
    raise ValueError(f"expected a tuple of logical axis names, got {tree!r}")
