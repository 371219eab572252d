"""jaxflash.sizing: compile the learner and the engine ahead of time for a topology.

Layer 4 (next to ``runtime``; no threads): it imports ``learner`` and
``generation`` to lower their jitted programs against abstract arrays.
"""

from jaxflash.sizing.dry_run import ProgramMemory, dry_run, format_report

__all__ = ["ProgramMemory", "dry_run", "format_report"]
