"""The generation servers of a run and how new weights reach them: threads or processes.

One RL loop (``runtime.rlvr``) drives either kind through the same calls:

- ``ThreadFleet``: one ``LlamaEngine`` per generation mesh carved from this
  program's devices, a ``GenerationServer`` thread each; ``publish`` copies the
  learner's params device to device onto every generation mesh (``sync.publish``).
- ``ProcessFleet`` (``mesh.generation_processes=True``): one generation program
  per slice (``runtime.gen_program``: local child processes, or programs already
  running at ``mesh.generation_addresses``), a ``RemoteGenerationServer`` each;
  ``publish`` stages the params in the programs' layout and offers them through
  every learner process's ``WeightSender`` (``LearnerProgram.offer``); each
  program pulls the version it is told (``WeightOffer``) into its own sharding.

``publish(learner, version)`` returns what ``RolloutScheduler.publish`` hands to
each server (params on its mesh, or a ``WeightOffer``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from concurrent import futures
from typing import Any

import jax

from jaxflash.runtime.experiment import ExperimentConfig
from jaxflash.runtime.gen_endpoint import FixedProgram, LocalProgram, ProgramClient
from jaxflash.runtime.gen_server import GenerationServer
from jaxflash.runtime.learner_program import LearnerProgram
from jaxflash.runtime.model_setup import engine_config, make_engine
from jaxflash.runtime.placement import Placement
from jaxflash.runtime.remote_server import (
    OfferBoard,
    RemoteGenerationServer,
    RemoteServerDownError,
)
from jaxflash.runtime.rpc_wire import WeightOffer
from jaxflash.sync.publish import Publisher
from jaxflash.sync.transfer_digest import tree_digest
from jaxflash.sync.transfer_layout import TreeLayout

TRANSFER_CHUNK_BYTES = 64 << 20
TRANSFER_TIMEOUT_S = 120.0


class ThreadFleet:
    """Generation servers as threads on this program's generation meshes."""

    def __init__(self, exp: ExperimentConfig, model_config: Any, placement: Placement, tokenizer):
        self.engines = [
            make_engine(exp, model_config, mesh, tokenizer) for mesh in placement.generation
        ]
        self._publishers = [Publisher() for _ in self.engines]

    def publish(self, learner: LearnerProgram, version: int) -> list[Any]:
        """Learner params -> every generation mesh, device to device (version v)."""
        pairs = zip(self._publishers, self.engines, strict=True)
        out = [pub.publish(learner.params, shard, version).params for pub, (_, shard) in pairs]
        jax.block_until_ready(out)
        return out

    def servers(
        self,
        gen_params: list[Any],
        *,
        version: int,
        stop_ids: Any,
        partial_rollout: str,
        on_finished: Callable,
        clock: Any,
        server_factory: Callable[..., Any] = GenerationServer,
    ) -> list[Any]:
        return [
            server_factory(
                f"gen{i}",
                engine,
                params,
                policy_version=version,
                stop_ids=stop_ids,
                partial_rollout=partial_rollout,
                on_finished=on_finished,
                clock=clock,
            )
            for i, ((engine, _), params) in enumerate(zip(self.engines, gen_params, strict=True))
        ]

    def eval_target(self, gen_params: list[Any]) -> tuple[Any, Any] | None:
        """(engine, params) that evaluation runs on."""
        return self.engines[0][0], gen_params[0]

    def close(self) -> None:
        pass


class ProcessFleet:
    """Generation servers as separate JAX programs, reached over gRPC.

    Starting: every local program is launched first (their imports overlap),
    then each is connected and configured; all must report the same weight
    layout (the same mesh shape), which the learner stages its weights for.

    Args:
      exp: the run (mesh.generation, num_generation_slices, generation_addresses,
        weight_transfer, generation_digests; rollout settings for the engine).
      model_config: the model every program builds.
      stop_ids: ids that end a response (``Tokenizer.stop_ids``).
      workdir: program logs go to ``<workdir>/generation/``.

    Raises:
      ProgramUnavailableError: a program did not start or refused its configuration.
      ValueError: programs report different layouts.
    """

    def __init__(self, exp: ExperimentConfig, model_config: Any, stop_ids: Any, workdir: str):
        m = exp.mesh
        self._dir = os.path.join(workdir, "generation")
        os.makedirs(self._dir, exist_ok=True)
        self._exp = exp
        config = {
            "model_config": dataclasses.asdict(model_config),
            "engine": dataclasses.asdict(engine_config(exp)),
            "mesh": {k: int(v) for k, v in m.generation.items()},
            "partial_rollout": exp.rollout.partial_rollout,
            "stop_ids": sorted(int(i) for i in stop_ids),
            "transfer": {
                "method": m.weight_transfer,
                "chunk_bytes": TRANSFER_CHUNK_BYTES,
                "timeout_s": TRANSFER_TIMEOUT_S,
            },  # fmt: skip
            "digests": bool(m.generation_digests),
        }
        devices = math.prod(int(v) for v in m.generation.values())
        names = [f"gen{i}" for i in range(m.num_generation_slices)]
        if m.generation_addresses:
            pairs = zip(names, m.generation_addresses, strict=True)
            endpoints = [FixedProgram(n, a) for n, a in pairs]
        else:
            endpoints = [
                LocalProgram(n, devices=devices, log_path=os.path.join(self._dir, f"{n}.log"))
                for n in names
            ]
        for e in endpoints:
            e.launch()
        self.clients: list[ProgramClient] = []
        try:
            for e in endpoints:
                self.clients.append(ProgramClient(e, {**config, "name": e.name}))
        except BaseException:
            self.close()
            for e in endpoints:
                e.kill()
            raise
        layouts = [c.layout for c in self.clients]
        if any(layout != layouts[0] for layout in layouts[1:]):
            raise ValueError("generation programs report different weight layouts")
        self.layout = TreeLayout.from_json(layouts[0])
        self._board: OfferBoard | None = None
        self._servers: list[RemoteGenerationServer] = []

    def publish(self, learner: LearnerProgram, version: int) -> list[WeightOffer]:
        """Offer the learner's params as ``version``; the same offer for every program."""
        offer = WeightOffer(version=int(version), senders=learner.offer(self.layout))
        if self._exp.mesh.generation_digests and jax.process_count() == 1:
            # The learner's side of the bit-for-bit check: each program logs the digest
            # of what it installed; both must equal this (tests compare them).
            line = {"version": int(version), "digest": tree_digest(learner.params)}
            with open(os.path.join(self._dir, "learner.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        if self._board is None:
            self._board = OfferBoard(offer)
        self._board.post(offer)
        if self._servers:  # every program installs it before the scheduler hands it over
            with futures.ThreadPoolExecutor(len(self._servers)) as pool:
                for _ in pool.map(lambda s: self._pull(s, offer), self._servers):
                    pass
        return [offer] * len(self.clients)

    @staticmethod
    def _pull(server: RemoteGenerationServer, offer: WeightOffer) -> None:
        try:
            server.pull(offer, TRANSFER_TIMEOUT_S)
        except RemoteServerDownError:
            pass  # its check() raises now: the scheduler re-routes, the supervisor restarts

    def servers(
        self,
        gen_params: list[Any],
        *,
        version: int,
        stop_ids: Any,
        partial_rollout: str,
        on_finished: Callable,
        clock: Any,
        server_factory: Callable[..., Any] = GenerationServer,
    ) -> list[RemoteGenerationServer]:
        """One ``RemoteGenerationServer`` per program (after the first ``publish``).

        Raises:
          ValueError: a ``server_factory`` other than the default (it builds
            thread servers; fault-injecting factories do not apply to processes).
        """
        del gen_params, stop_ids, clock  # configured already; time is the wall clock
        if server_factory is not GenerationServer:
            raise ValueError("server_factory applies to thread servers, not generation programs")
        if self._board is None or self._board.latest.version != int(version):
            raise RuntimeError(f"ProcessFleet.servers: publish version {version} first")
        self._servers = [
            RemoteGenerationServer(
                client,
                self._board,
                partial_rollout=partial_rollout,
                on_finished=on_finished,
                log_path=os.path.join(self._dir, f"{client.name}.jsonl"),
            )
            for client in self.clients
        ]
        return self._servers

    def eval_target(self, gen_params: list[Any]) -> tuple[Any, Any] | None:
        del gen_params
        return None  # refused by ExperimentConfig (data.eval_size must be 0)

    def close(self) -> None:
        """Shut the programs down unless servers own them (the scheduler stops those)."""
        if not self._servers:
            for client in self.clients:
                client.shutdown()


def make_fleet(
    exp: ExperimentConfig, model_config: Any, placement: Placement, tokenizer: Any, workdir: str
) -> ThreadFleet | ProcessFleet:
    """The fleet ``exp.mesh`` asks for."""
    if exp.mesh.generation_processes:
        return ProcessFleet(exp, model_config, tokenizer.stop_ids, workdir)
    return ThreadFleet(exp, model_config, placement, tokenizer)
