"""The generation servers of a run and how new weights reach them: threads or processes.

One RL loop (``runtime.loop``) drives either kind through the same calls:

- ``ThreadFleet``: one ``LlamaEngine`` per generation mesh carved from this
  program's devices, a ``GenerationServer`` thread each; ``publish`` copies the
  learner's params device to device onto every generation mesh (with ``delta``, only
  the engine-side (bf16) weights that changed since the slot's version,
  ``sync.delta_publish``: bit-identical to a full copy; off for thread engines unless
  set, docs/PERF.md).
- ``ProcessFleet`` (``mesh.generation_processes=True``): one generation program
  per slice (``runtime.fleet.gen_program``: local child processes, or programs already
  running at ``mesh.generation_addresses``), a ``RemoteGenerationServer`` each;
  ``publish`` stages the params in the programs' layout and offers them through
  every learner process's ``WeightSender`` (``LearnerProgram.offer``); each
  program pulls the version it is told (``WeightOffer``) into its own sharding.

The fleet owns its servers and their weights: ``start`` puts the first weights on
every server and builds ``pool``, what the rollout routes to; ``listen(rollout)``
names the one it tells what changed (a ``ServerListener``: one call,
``servers_changed``); ``publish(learner, version)`` copies (or offers) each new version,
then tells the rollout, which hands it to every server under its lock (params on its
mesh, or a ``WeightOffer``); ``resize`` is the elastic move, told the same way;
``generator`` is what held-out evaluation generates with, on either kind. The fleet
never calls into the rollout otherwise.
"""

from __future__ import annotations

from typing import Any

from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.fleet.fleet_types import Resized, ServerSettings, WeightSync
from jaxflash.runtime.fleet.placement import Placement
from jaxflash.runtime.fleet.process_fleet import ProcessFleet
from jaxflash.runtime.fleet.thread_fleet import ThreadFleet

__all__ = [
    "ProcessFleet",
    "Resized",
    "ServerSettings",
    "ThreadFleet",
    "WeightSync",
    "make_fleet",
]


def make_fleet(
    exp: ExperimentConfig,
    model_config: Any,
    placement: Placement,
    tokenizer: Any,
    workdir: str,
    servers: ServerSettings,
) -> ThreadFleet | ProcessFleet:
    """The fleet ``exp.mesh`` asks for (its engines built, or its programs configured)."""
    engine = {"rollout": exp.rollout, "env": exp.env, "lora": exp.learner.lora}
    delta = exp.mesh.delta_publish
    if exp.mesh.generation_processes:
        return ProcessFleet(
            model_config, tokenizer.stop_ids, workdir, servers,
            mesh=exp.mesh, model=exp.model, seed=exp.seed, delta=delta, **engine,
        )  # fmt: skip
    return ThreadFleet(model_config, placement, tokenizer, servers, delta=delta, **engine)
