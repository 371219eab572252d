"""Start a learner fresh or resume it from a run directory."""

from __future__ import annotations

import logging
import os
from typing import Any

from jax.sharding import Mesh

from jaxflash.checkpoint.checkpointer import Checkpointer, CheckpointMeta
from jaxflash.learner.state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    from_params,
)
from jaxflash.metrics.writer import truncate_jsonl
from jaxflash.models.config import ModelConfig
from jaxflash.runtime.experiment import ExperimentConfig
from jaxflash.runtime.ledger import PromptLedger
from jaxflash.sharding.rules import LEARNER_RULES

log = logging.getLogger(__name__)


def init_or_restore_learner(
    exp: ExperimentConfig,
    model_config: ModelConfig,
    imported_params: Any,
    learner_mesh: Mesh,
    workdir: str,
) -> tuple[TrainState, CheckpointMeta, PromptLedger, Checkpointer]:
    """The learner state, its metadata and the prompt ledger, restored when possible.

    A complete checkpoint under ``<workdir>/checkpoints`` is restored onto
    ``learner_mesh`` (Orbax ignores half-written ones); rows of metrics.jsonl and
    rollouts.jsonl written after it belong to lost work and are dropped. Otherwise
    the state is created born sharded: from ``imported_params`` (GGUF / HF), or
    randomly initialised when that is None.

    Returns:
      (state, meta, ledger, checkpointer); the caller owns the checkpointer.
    """
    checkpointer = Checkpointer(
        os.path.join(workdir, "checkpoints"), max_to_keep=exp.checkpoint.max_to_keep
    )
    abstract_state = abstract_train_state(model_config, exp.learner, learner_mesh, LEARNER_RULES)
    restored = checkpointer.restore_latest(abstract_state)
    if restored is not None:
        state, meta = restored
        ledger = PromptLedger.from_state_dict(meta.extra["ledger"])
        log.warning(
            "resumed from step %d (data cursor %d, %d prompts in flight)",
            meta.step,
            meta.data_cursor,
            len(ledger.open_ids),
        )
        truncate_jsonl(os.path.join(workdir, "metrics.jsonl"), "step", meta.step)
        truncate_jsonl(os.path.join(workdir, "rollouts.jsonl"), "learner_step", meta.step)
        return state, meta, ledger, checkpointer
    if imported_params is None:
        state = create_train_state(
            model_config, exp.learner, learner_mesh, LEARNER_RULES, seed=exp.seed
        )
    else:
        state = from_params(
            imported_params, model_config, exp.learner, learner_mesh, LEARNER_RULES, seed=exp.seed
        )
    return state, CheckpointMeta(step=0), PromptLedger(), checkpointer
