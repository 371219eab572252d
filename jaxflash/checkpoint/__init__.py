"""jaxflash.checkpoint: Orbax checkpoints of the sharded TrainState + JSON metadata."""

from jaxflash.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointMeta,
    numpy_rng_state,
    python_rng_state,
    set_numpy_rng_state,
    set_python_rng_state,
)

__all__ = [
    "CheckpointMeta",
    "Checkpointer",
    "numpy_rng_state",
    "python_rng_state",
    "set_numpy_rng_state",
    "set_python_rng_state",
]
