"""How a paged KV cache's page pool and rows split over a device mesh.

kv heads split over the axes the sharding rules give ``kv_heads`` (when they divide
K); pages and rows (slots) split over every other mesh axis of size > 1, the G *slot
groups*: group g holds pages [g N/G, (g+1) N/G) and rows [g B/G, (g+1) B/G), so writes
and reads run inside ``shard_map`` on the chips that hold the row, with page ids made
local (``local_page_ids``). Used by ``models.caches.paged_kv_cache`` and the engine's
state (``generation.engine.state``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.sharding.rules import Rules, logical_to_spec


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """How pools and rows split over a mesh (static and hashable: a ``PageTable`` field).

    Attributes:
      mesh: the engine's mesh.
      head_axes: mesh axes splitting the kv heads (whole (key, value) pairs per shard).
      group_axes: mesh axes splitting pages and rows into ``groups`` slot groups, in
        mesh order (group g = the linear index over them, major to minor).
    """

    mesh: Mesh
    head_axes: tuple[str, ...] = ()
    group_axes: tuple[str, ...] = ()

    @property
    def groups(self) -> int:
        """G, slot groups (1 when pages are not split)."""
        return math.prod(self.mesh.shape[a] for a in self.group_axes)

    @property
    def head_shards(self) -> int:
        """Shards of the kv heads (1 when they are not split)."""
        return math.prod(self.mesh.shape[a] for a in self.head_axes)

    def spec(self, *dims: str | None) -> PartitionSpec:
        """PartitionSpec with "groups" / "heads" dims mapped to their mesh axes."""
        axes = {"groups": self.group_axes, "heads": self.head_axes}

        def one(d):
            got = axes.get(d, ()) if d else ()
            return None if not got else got[0] if len(got) == 1 else got

        return PartitionSpec(*map(one, dims))

    @property
    def pool_spec(self) -> PartitionSpec:
        """One layer's pool [N, P, 2K, H]: pages over groups, combined heads over heads."""
        return self.spec("groups", None, "heads", None)

    def shard(self, fn: Callable, in_specs, out_specs) -> Callable:
        """``fn`` per shard (``jax.shard_map`` over the whole mesh)."""
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def page_offset(self, local_pages: int) -> jax.Array:
        """Inside ``shard``: the first global page id of this shard's group."""
        if not self.group_axes:
            return jnp.zeros((), jnp.int32)
        return jax.lax.axis_index(self.group_axes) * local_pages


def pool_layout(config: ModelConfig, mesh: Mesh | None, rules: Rules | None) -> PoolLayout | None:
    """The split of a paged pool on ``mesh``: kv heads as ``rules`` split them (decided on
    K), pages and rows over every other mesh axis of size > 1.

    Returns:
      None on one device (nothing to split). Without rules everything is replicated
      (a layout with no axes: G = 1).
    """
    if mesh is None or mesh.devices.size == 1:
        return None
    if rules is None:
        return PoolLayout(mesh)
    entry = logical_to_spec(("kv_heads",), mesh, rules, (config.n_kv_heads,))[0]
    heads = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    groups = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in heads)
    return PoolLayout(mesh, heads, groups)


def local_page_ids(table_xm: jax.Array, offset: jax.Array, local_pages: int) -> jax.Array:
    """Global page ids -> this shard's (id - offset); ids of other groups and the
    sentinel become the local sentinel ``local_pages`` (writes there are dropped; reads
    clip or clamp to a real page whose contents are masked out)."""
    local = table_xm - offset
    return jnp.where((local >= 0) & (local < local_pages), local, local_pages)
