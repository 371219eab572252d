"""The learner of a run, born sharded: the model loaded, the state created or restored."""

from __future__ import annotations

import logging
from typing import Any

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.console import Console, describe_model, describe_schedule
from jaxflash.runtime.fleet.learner_links import LeaderLinks
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from jaxflash.runtime.fleet.placement import Placement
from jaxflash.runtime.model_setup import check_workdir_model, describe_source, load_model
from jaxflash.sharding.distributed import advertised_host
from jaxflash.sync.transfer_sender import WeightSender

log = logging.getLogger(__name__)


def start_learner(
    exp: ExperimentConfig,
    tokenizer: Any,
    placement: Placement,
    workdir: str,
    console: Console,
    links: LeaderLinks | None = None,
) -> tuple[LearnerProgram, ModelConfig]:
    """Load the model, then build (or restore from ``workdir``) the learner on its mesh.

    Args:
      exp: the experiment as run (the workload's: prompt limits derived).
      tokenizer: the policy's tokenizer (the vocabulary is reconciled with it).
      placement: the run's placement (the learner's mesh).
      links: on process 0 of a multi-process learner, the other processes.

    Returns:
      (the learner, the model config); a resumed learner's ``meta.step`` > 0.

    Raises:
      ConfigError / ValueError: see ``model_setup.load_model`` and
        ``check_workdir_model`` (a workdir of another model).
    """
    what = describe_source(exp.model)
    with console.phase("loading the model", announce=f"loading the model ({what}) ..."):
        model_config, imported_params = load_model(exp.model, exp.rollout, tokenizer)
    log.debug("model: %s", model_config)
    console.line(f"model: {describe_model(model_config, exp.learner.lora)}")
    console.line(describe_schedule(exp))
    check_workdir_model(workdir, model_config)
    console.background("setting up the learner, the generation engines and the reward workers")
    with console.phase("building the learner state"):
        # Generation programs pull weights from every learner process's sender.
        sender = WeightSender(host=advertised_host()) if exp.mesh.generation_processes else None
        learner = LearnerProgram(
            exp, model_config, imported_params, placement.learner, workdir,
            sender=sender, links=links,
        )  # fmt: skip
    return learner, model_config
