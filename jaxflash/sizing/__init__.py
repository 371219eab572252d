"""jaxflash.sizing: compile the learner and the engine ahead of time for a topology.

Layer 4 (next to ``runtime``; no threads): it imports ``learner`` and
``generation`` to lower their jitted programs against abstract arrays.
``sizing.chips`` and ``sizing.tpu`` import no JAX (the launcher reads them before
JAX starts), so the names below load lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ProgramMemory", "dry_run", "format_report"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("jaxflash.sizing.dry_run"), name)
    raise AttributeError(f"module 'jaxflash.sizing' has no attribute {name!r}")
