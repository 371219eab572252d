"""The generation servers of a run and how new weights reach them: threads or processes.

One RL loop (``runtime.loop``) drives either kind through the same calls:

- ``ThreadFleet``: one ``LlamaEngine`` per generation mesh carved from this
  program's devices, a ``GenerationServer`` thread each; ``publish`` copies the
  learner's params device to device onto every generation mesh (``sync.publish``).
- ``ProcessFleet`` (``mesh.generation_processes=True``): one generation program
  per slice (``runtime.fleet.gen_program``: local child processes, or programs already
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
from jax.sharding import Mesh

from jaxflash.models.lora import tree_bytes
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.fleet.gen_endpoint import FixedProgram, LocalProgram, ProgramClient
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from jaxflash.runtime.fleet.placement import Placement
from jaxflash.runtime.fleet.remote_server import (
    OfferBoard,
    RemoteGenerationServer,
    RemoteServerDownError,
)
from jaxflash.runtime.fleet.rpc_wire import WeightOffer
from jaxflash.runtime.model_setup import engine_config, lora_base_source, make_engine
from jaxflash.sync.publish import AdapterPublisher, Publisher
from jaxflash.sync.reshard import LayoutCache
from jaxflash.sync.transfer_digest import tree_digest
from jaxflash.sync.transfer_layout import TreeLayout

TRANSFER_CHUNK_BYTES = 64 << 20
TRANSFER_TIMEOUT_S = 120.0


class ThreadFleet:
    """Generation servers as threads on this program's generation meshes.

    Slot i holds server i's engine (``servers`` builds them in this order), or
    None once the elastic pool retired it (``remove_slice``); ``add_slice`` appends
    an engine for devices the learner gave back. Engines are built once per device
    layout (``sync.reshard.LayoutCache``): a slice that returns to devices it held
    before reuses its engine and compiled programs.
    """

    def __init__(self, exp: ExperimentConfig, model_config: Any, placement: Placement, tokenizer):
        self._engine_for = LayoutCache(lambda mesh: make_engine(exp, model_config, mesh, tokenizer))
        self.engines: list[tuple[Any, Any] | None] = [
            self._engine_for(mesh) for mesh in placement.generation
        ]
        self._lora = exp.learner.lora is not None
        self._publishers: list[Any] = [self._publisher(slot) for slot in self.engines]
        self._published: list[Any] = [None] * len(self.engines)
        self.last_publish_bytes = 0  # bytes the last publish moved, all slots together

    def _publisher(self, slot: tuple[Any, Any]) -> Publisher | AdapterPublisher:
        # LoRA: the base goes to the slot once, then only the adapters move.
        return AdapterPublisher(*slot) if self._lora else Publisher()

    def _push(self, pub: Any, learner: LearnerProgram, shardings: Any, version: int) -> Any:
        if isinstance(pub, AdapterPublisher):
            params = pub.publish(learner.params, learner.base, version).params
            self.last_publish_bytes += pub.last_bytes
            return params
        self.last_publish_bytes += tree_bytes(learner.params)
        return pub.publish(learner.params, shardings, version).params

    @property
    def engine_builds(self) -> int:
        """Engines built so far (one per generation device layout ever used)."""
        return self._engine_for.builds

    def publish(self, learner: LearnerProgram, version: int) -> list[Any]:
        """Learner params -> every generation mesh, device to device (version v).

        Returns the fleet's own list (slot i: server i's params, None once retired),
        which ``remove_slice`` / ``add_slice`` keep current between publishes.
        """
        self.last_publish_bytes = 0
        out = [
            None if slot is None else self._push(pub, learner, slot[1], version)
            for pub, slot in zip(self._publishers, self.engines, strict=True)
        ]
        jax.block_until_ready([p for p in out if p is not None])
        self._published = out
        return out

    def remove_slice(self, i: int) -> None:
        """Slot i's devices joined the learner: it gets no weights any more (its
        published copy is dropped, freeing those devices)."""
        self.engines[i] = None
        self._publishers[i] = None
        self._published[i] = None

    def add_slice(self, mesh: Mesh, learner: LearnerProgram, version: int) -> tuple[int, Any]:
        """A slot on ``mesh`` holding the learner's params as ``version`` (device to
        device, before any server takes requests on it); returns (its index, params)."""
        engine, shardings = self._engine_for(mesh)
        publisher = self._publisher((engine, shardings))
        params = self._push(publisher, learner, shardings, version)
        jax.block_until_ready(params)
        self.engines.append((engine, shardings))
        self._publishers.append(publisher)
        self._published.append(params)
        return len(self.engines) - 1, params

    def server(
        self,
        i: int,
        params: Any,
        *,
        version: int,
        stop_ids: Any,
        partial_rollout: str,
        on_finished: Callable,
        clock: Any,
        server_factory: Callable[..., Any] = GenerationServer,
    ) -> Any:
        """The server of slot i (named gen{i}), holding ``params`` at ``version``."""
        slot = self.engines[i]
        if slot is None:
            raise ValueError(f"ThreadFleet.server: slot {i} was retired")
        return server_factory(
            f"gen{i}",
            slot[0],
            params,
            policy_version=version,
            stop_ids=stop_ids,
            partial_rollout=partial_rollout,
            on_finished=on_finished,
            clock=clock,
        )

    def servers(self, gen_params: list[Any], *, version: int, **server_kwargs: Any) -> list[Any]:
        """One server per slot (``server``'s keyword arguments)."""
        return [
            self.server(i, params, version=version, **server_kwargs)
            for i, params in enumerate(gen_params)
        ]

    def eval_target(self, gen_params: list[Any]) -> tuple[Any, Any] | None:
        """(engine, params) that evaluation runs on: the first slot not retired."""
        i = next(i for i, slot in enumerate(self.engines) if slot is not None)
        return self.engines[i][0], gen_params[i]

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
        self._servers: list[RemoteGenerationServer] = []  # close() may run before the end
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
        if exp.learner.lora is not None:  # programs build the base; only adapters move
            lora = {"config": dataclasses.asdict(exp.learner.lora)}
            config["lora"] = {**lora, "source": lora_base_source(exp)}
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
        self.last_publish_bytes = 0  # bytes offered by the last publish, per program

    def publish(self, learner: LearnerProgram, version: int) -> list[WeightOffer]:
        """Offer the learner's params as ``version``; the same offer for every program."""
        if self._board is None and learner.base is not None:
            for client in self.clients:  # the programs' LoRA bases are the learner's
                client.expected_base_digest = learner.base_record["digest"]
                client.check_base()
        offer = WeightOffer(version=int(version), senders=learner.offer(self.layout))
        self.last_publish_bytes = tree_bytes(learner.params) * len(self.clients)
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
