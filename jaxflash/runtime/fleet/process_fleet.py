"""Generation servers as separate JAX programs, reached over gRPC (``ProcessFleet``).

``mesh.generation_processes=True``: one generation program per slice
(``runtime.fleet.gen_program``: local child processes, or programs already running at
``mesh.generation_addresses``), a ``RemoteGenerationServer`` each; ``publish`` stages
the params in the programs' layout and offers them through every learner process's
``WeightSender`` (``LearnerProgram.offer``); each program pulls the version it is told
(``WeightOffer``) into its own sharding. Built by ``fleets.make_fleet``; what a fleet
is, and the calls both kinds answer: ``fleets``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from concurrent import futures
from typing import Any

import jax

from jaxflash.generation.engine.params import as_engine_dtypes
from jaxflash.models.adapters.lora import LoraConfig, tree_bytes
from jaxflash.runtime.config.env_spec import EnvSpec
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.config.specs import MeshSpec, ModelSpec
from jaxflash.runtime.fleet.eval_generation import ProgramGenerate
from jaxflash.runtime.fleet.fleet_types import Resized, ServerSettings, WeightSync
from jaxflash.runtime.fleet.gen_endpoint import FixedProgram, LocalProgram, ProgramClient
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from jaxflash.runtime.fleet.remote_server import (
    OfferBoard,
    RemoteGenerationServer,
    RemoteServerDownError,
)
from jaxflash.runtime.fleet.rpc_wire import WeightOffer
from jaxflash.runtime.model_setup import engine_config, lora_base_source
from jaxflash.runtime.rollout.server_pool import ServerListener, ServerPool, ServersChanged
from jaxflash.sync.transfer_digest import tree_digest
from jaxflash.sync.transfer_layout import TreeLayout

TRANSFER_CHUNK_BYTES = 64 << 20
TRANSFER_TIMEOUT_S = 120.0
EVAL_TIMEOUT_S = 3600.0  # one evaluation on the generation programs, at most


class ProcessFleet:
    """Generation servers as separate JAX programs, reached over gRPC.

    With ``delta`` (``mesh.delta_publish``, not LoRA) programs hold the engine-side tree
    and pull only what changed, each host its own blocks (``sync.transfer_delta``).

    Starting: every local program is launched first (their imports overlap),
    then each is connected and configured; all must report the same weight
    layout (the same mesh shape), which the learner stages its weights for.

    Args:
      model_config: the model every program builds.
      stop_ids: ids that end a response (``Tokenizer.stop_ids``).
      workdir: program logs go to ``<workdir>/generation/``.
      servers: what each ``RemoteGenerationServer`` reports to (its clock is the
        wall clock: only the publish timings read ``servers.clock``).
      mesh: the experiment's mesh section (generation, num_generation_slices,
        generation_addresses, generation_hosts, weight_transfer, generation_digests).
      rollout, env: the sections the programs' engines are built from (``engine_config``).
      lora: the adapters' config (None: full fine-tuning); ``model``, ``seed``: where
        the programs build the frozen base from under LoRA (``lora_base_source``).
      delta: ``mesh.delta_publish`` (ignored under LoRA): each version after a program's
        first goes as the XOR of the engine-side bits that changed (docs/PERF.md).

    Raises:
      ValueError: a ``server_factory`` other than the default (it builds thread
        servers; fault-injecting factories do not apply to processes); programs
        that report different layouts.
      ProgramUnavailableError: a program did not start or refused its configuration.
    """

    def __init__(
        self,
        model_config: Any,
        stop_ids: Any,
        workdir: str,
        servers: ServerSettings,
        *,
        mesh: MeshSpec,
        rollout: RolloutSpec,
        env: EnvSpec,
        lora: LoraConfig | None,
        model: ModelSpec,
        seed: int,
        delta: bool = False,
    ):
        if servers.server_factory is not GenerationServer:
            raise ValueError("server_factory applies to thread servers, not generation programs")
        m = mesh
        self._servers: list[RemoteGenerationServer] = []  # close() may run before the end
        self._dir = os.path.join(workdir, "generation")
        os.makedirs(self._dir, exist_ok=True)
        self._mesh, self._rollout, self._env, self._settings = mesh, rollout, env, servers
        config = {
            "model_config": dataclasses.asdict(model_config),
            "engine": dataclasses.asdict(engine_config(rollout=rollout, env=env)),
            "mesh": {k: int(v) for k, v in m.generation.items()},
            "partial_rollout": rollout.partial_rollout,
            "stop_ids": sorted(int(i) for i in stop_ids),
            "transfer": {
                "method": m.weight_transfer,
                "chunk_bytes": TRANSFER_CHUNK_BYTES,
                "timeout_s": TRANSFER_TIMEOUT_S,
            },  # fmt: skip
            "digests": bool(m.generation_digests),
        }
        self._delta = bool(delta) and lora is None
        self._engine_view = jax.jit(functools.partial(as_engine_dtypes, model_config=model_config))
        if self._delta:
            config["delta"] = True
        if lora is not None:  # programs build the base; only adapters move
            adapters = {"config": dataclasses.asdict(lora)}
            config["lora"] = {**adapters, "source": lora_base_source(model=model, seed=seed)}
        devices = math.prod(int(v) for v in m.generation.values())
        names = [f"gen{i}" for i in range(m.num_generation_slices)]
        if m.generation_addresses:
            pairs = zip(names, m.generation_addresses, strict=True)
            endpoints = [FixedProgram(n, a) for n, a in pairs]
        else:
            endpoints = [
                LocalProgram(
                    n,
                    devices=devices,
                    log_path=os.path.join(self._dir, f"{n}.log"),
                    processes=m.generation_hosts,
                )  # fmt: skip
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
        self.pool: ServerPool | None = None  # ``start`` builds it
        self._listener: ServerListener | None = None  # ``listen`` names it
        self.last_publish_bytes = 0  # bytes the last publish moved, every program together

    def _offer(self, learner: LearnerProgram, version: int) -> WeightOffer:
        """Offer the learner's params as ``version``; the same offer for every program."""
        if self._board is None and learner.base is not None:
            for client in self.clients:  # the programs' LoRA bases are the learner's
                client.expected_base_digest = learner.base_record["digest"]
                client.check_base()
        senders = learner.offer(self.layout, delta=self._delta)
        offer = WeightOffer(version=int(version), senders=senders)
        # Until the programs report what their pulls moved (``publish``): the full tree each.
        self.last_publish_bytes = tree_bytes(learner.params) * len(self.clients)
        if self._mesh.generation_digests and jax.process_count() == 1:
            # The learner's side of the bit-for-bit check: each program logs the digest
            # of what it installed (under delta, in the engine's dtypes); both must equal
            # this (tests compare them).
            held = self._engine_view(learner.params) if self._delta else learner.params
            line = {"version": int(version), "digest": tree_digest(held)}
            with open(os.path.join(self._dir, "learner.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        if self._board is None:
            self._board = OfferBoard(offer)
        self._board.post(offer)
        return offer

    def start(self, learner: LearnerProgram, version: int) -> ServerPool:
        """Offer ``version``; one ``RemoteGenerationServer`` per program: ``pool`` (each
        pulls that version when the scheduler starts it)."""
        self._offer(learner, version)
        self._servers = [
            RemoteGenerationServer(
                client,
                self._board,
                partial_rollout=self._rollout.partial_rollout,
                on_finished=self._settings.on_finished,
                log_path=os.path.join(self._dir, f"{client.name}.jsonl"),
            )
            for client in self.clients
        ]
        self.pool = ServerPool(self._servers)
        return self.pool

    def listen(self, listener: ServerListener) -> None:
        """``listener`` (the rollout routing to ``pool``) is told every new version."""
        self._listener = listener

    def publish(self, learner: LearnerProgram, version: int) -> WeightSync:
        """Offer ``version``; every program installs it (pulls in parallel) before the
        listener hands the offer to the servers and releases capacity."""
        clock = self._settings.clock
        t0 = clock.now()
        offer = self._offer(learner, version)
        with futures.ThreadPoolExecutor(len(self._servers)) as pool:
            moved = list(pool.map(lambda s: self._pull(s, offer), self._servers))
        if all(m is not None for m in moved):  # what the pulls moved (deltas or full trees)
            self.last_publish_bytes = sum(moved)
        copy_s = clock.now() - t0
        change = ServersChanged(version=version, weights=[offer] * len(self.clients))
        done = self._listener.servers_changed(change)
        return WeightSync(copy_s=copy_s, handover_s=done.seconds, bytes=self.last_publish_bytes)

    @staticmethod
    def _pull(server: RemoteGenerationServer, offer: WeightOffer) -> int | None:
        try:
            return server.pull(offer, TRANSFER_TIMEOUT_S)
        except RemoteServerDownError:
            return None  # its check() raises now: the scheduler re-routes, restarts it

    def resize(self, **_: Any) -> Resized:
        raise ValueError("elastic moves need thread servers (runtime.config.elastic_spec)")

    def generator(self) -> ProgramGenerate:
        """What evaluation generates with: the programs, beside the rollout's requests
        (started here if the scheduler has not yet: the evaluation before step 1)."""
        for server in self._servers:
            if not server.started:
                server.start()
        econf = engine_config(rollout=self._rollout, env=self._env)
        return ProgramGenerate(self._servers, econf, EVAL_TIMEOUT_S)

    def close(self) -> None:
        """Shut the programs down unless servers own them (the scheduler stops those)."""
        if not self._servers:
            for client in self.clients:
                client.shutdown()
