"""jaxflash.checkpoint: Orbax checkpoints of the sharded TrainState + JSON metadata."""

from jaxflash.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointMeta,
    CheckpointStats,
    numpy_rng_state,
    python_rng_state,
    set_numpy_rng_state,
    set_python_rng_state,
)
from jaxflash.checkpoint.storage import CheckpointWriteError, StorageFault, diagnose

__all__ = [
    "CheckpointMeta",
    "CheckpointStats",
    "CheckpointWriteError",
    "Checkpointer",
    "StorageFault",
    "diagnose",
    "numpy_rng_state",
    "python_rng_state",
    "set_numpy_rng_state",
    "set_python_rng_state",
]
