"""The learner of a run, born sharded: the model loaded, the state created or restored;
and ``follow``, what a learner process other than 0 runs."""

from __future__ import annotations

import logging
from typing import Any

from jaxflash.models.config.model_config import ModelConfig
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.console import Console, describe_model, describe_schedule
from jaxflash.runtime.fleet.learner_links import FollowerLink, LeaderLinks
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from jaxflash.runtime.fleet.placement import Placement
from jaxflash.runtime.model_setup import check_workdir_model, describe_source, load_model
from jaxflash.runtime.resume import finished_step
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
    console.line(
        describe_schedule(rollout=exp.rollout, controller=exp.controller, learner=exp.learner)
    )
    check_workdir_model(workdir, model_config)
    console.background("setting up the learner, the generation engines and the reward workers")
    with console.phase("building the learner state"):
        # Generation programs pull weights from every learner process's sender.
        sender = WeightSender(host=advertised_host()) if exp.mesh.generation_processes else None
        if links is not None:  # the others build the same learner (``follow``)
            links.post("setup", max_prompt_tokens=int(exp.data.max_prompt_tokens))
        learner = LearnerProgram(
            model_config, imported_params, placement.learner, workdir, **_sections(exp),
            sender=sender, links=links,
        )  # fmt: skip
    return learner, model_config


def _sections(exp: ExperimentConfig) -> dict[str, Any]:
    """What ``LearnerProgram`` reads of the experiment."""
    return {
        "learner": exp.learner,
        "checkpoint": exp.checkpoint,
        "model": exp.model,
        "seed": exp.seed,
        "block_digests": exp.mesh.generation_processes and exp.mesh.generation_digests,
    }


def follow(exp: ExperimentConfig, workdir: str, *, host: str = "127.0.0.1") -> int:
    """A learner process other than 0: run process 0's learner commands until it closes.

    Builds the same learner (after process 0 says which prompt length it derived)
    and applies every posted command. Returns 0 when process 0 closed (or
    exited before the learner was built: a finished run or a config error there).

    Raises:
      ConnectionError: process 0 vanished mid-run.
    """
    from jaxflash.runtime.fleet.placement import carve  # noqa: PLC0415
    from jaxflash.runtime.model_setup import load_tokenizer  # noqa: PLC0415

    sender = WeightSender(host=host) if exp.mesh.generation_processes else None
    link = FollowerLink(sender_address="" if sender is None else sender.address)
    try:
        header, _ = link.next()
        if header["op"] == "finished_step":  # process 0 checks whether the run is done
            finished_step(workdir, exp.total_steps)  # (opening the checkpoints is collective)
            header, _ = link.next()
        if header["op"] == "exit":
            return 0
        if header["op"] != "setup":
            raise ValueError(f"expected the setup command first, got {header['op']!r}")
        exp = exp.with_prompt_lengths(int(header["max_prompt_tokens"]))
        tokenizer = load_tokenizer(exp.model)
        model_config, imported = load_model(exp.model, exp.rollout, tokenizer)
        placement = carve(exp.mesh)
        program = LearnerProgram(
            model_config, imported, placement.learner, workdir, **_sections(exp),
            sender=sender, leader=False,
        )  # fmt: skip
        del imported
        while True:
            header, arrays = link.next()
            if header["op"] == "exit":
                program.close()
                return 0
            if not program.apply(header.pop("op"), header, arrays):
                try:  # closed: wait for process 0 to say exit (or to go away)
                    link.next()
                except ConnectionError:
                    pass
                return 0
    finally:
        link.close()
