"""A paged engine's configuration on its mesh: slot groups and the attention path.

``resolve_paged`` is what ``LlamaEngine`` does with ``EngineConfig(kv_cache="paged")``
when it is built: the pool's split over the mesh (``models.caches.pool_layout.pool_layout``:
kv heads over the axes the rules give them, pages and slots over every other axis,
the G slot groups), the divisibility checks that split needs, and
``paged_attention="auto"`` resolved (the TPU kernel where it tiles one chip's heads).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from jaxflash.generation.engine.state import EngineConfig
from jaxflash.models.caches.paged_kv_cache import kernel_supported
from jaxflash.models.caches.pool_layout import PoolLayout, pool_layout
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.sharding.rules import Rules


def resolve_paged(
    model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules: Rules | None
) -> tuple[EngineConfig, PoolLayout | None]:
    """A paged engine's config with ``page_groups`` and ``paged_attention="auto"``
    resolved for ``mesh``, and the pool's layout (None: one device, or dense).

    "auto" takes the TPU kernel on a TPU mesh where it tiles the heads one chip holds,
    except in the exact mode (``model_config.exact_numerics``), whose attention is the
    reference path's (the kernel's reduction order is its own).

    Raises:
      ValueError: the slot groups do not divide the slots or the pages (naming the
        mesh, both numbers and the settings to change).
    """
    if not config.paged:
        return config, None
    layout = pool_layout(model_config, mesh, rules)
    groups = 1 if layout is None else layout.groups
    for what, value in (("slots", config.max_concurrent_decodes), ("pages", config.pool_pages)):
        if value % groups:
            raise ValueError(
                f"paged KV cache on mesh {dict(mesh.shape)}: pages and slots split into "
                f"{groups} slot groups (mesh axes {layout.group_axes}; kv heads over "
                f"{layout.head_axes or 'no axis'}), but {value} {what} do not divide by "
                f"{groups} (rollout.num_slots={config.max_concurrent_decodes}, "
                f"rollout.num_pages={config.pool_pages})"
            )
    attention = config.paged_attention
    if attention == "auto":
        on_tpu = mesh.devices.flat[0].platform == "tpu"
        kernel = (
            on_tpu and not model_config.exact_numerics and kernel_supported(model_config, layout)
        )
        attention = "tpu_kernel" if kernel else "reference"
    config = dataclasses.replace(config, paged_attention=attention, page_groups=groups)
    return config, layout
