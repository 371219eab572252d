"""jaxflash.learner: config, sharded TrainState, batch packing and the jitted train step."""

from jaxflash.learner.batching import bucket_length, pack_batch, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.scoring import make_logprob_fn
from jaxflash.learner.state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    from_params,
    state_shardings,
)
from jaxflash.learner.step import make_grad_fn, make_train_step

__all__ = [
    "LearnerConfig",
    "TrainState",
    "abstract_train_state",
    "bucket_length",
    "create_train_state",
    "from_params",
    "make_grad_fn",
    "make_logprob_fn",
    "make_train_step",
    "pack_batch",
    "split_micro_batches",
    "state_shardings",
]
