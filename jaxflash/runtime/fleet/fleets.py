"""The generation servers of a run and how new weights reach them: threads or processes.

One RL loop (``runtime.loop``) drives either kind through the same calls:

- ``ThreadFleet``: one ``LlamaEngine`` per generation mesh carved from this
  program's devices, a ``GenerationServer`` thread each; ``publish`` copies the
  learner's params device to device onto every generation mesh (with ``delta``, only
  the engine-side (bf16) weights that changed since the slot's version,
  ``sync.delta_publish``: bit-identical to a full copy; off by default, docs/PERF.md).
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

import dataclasses
import json
import math
import os
from collections.abc import Callable
from concurrent import futures
from typing import Any

import jax
from jax.sharding import Mesh

from jaxflash.generation.engine.params import as_engine_dtypes
from jaxflash.models.adapters.lora import tree_bytes
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.fleet.eval_generation import EngineGenerate, ProgramGenerate
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
from jaxflash.runtime.rollout.server_pool import ServerListener, ServerPool, ServersChanged
from jaxflash.sync.delta_publish import DeltaPublisher, DeltaSink
from jaxflash.sync.publish import AdapterPublisher, Publisher
from jaxflash.sync.reshard import LayoutCache
from jaxflash.sync.transfer_digest import tree_digest
from jaxflash.sync.transfer_layout import TreeLayout

TRANSFER_CHUNK_BYTES = 64 << 20
TRANSFER_TIMEOUT_S = 120.0
EVAL_TIMEOUT_S = 3600.0  # one evaluation on the generation programs, at most


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What every server of a fleet is built with, given once (``make_fleet``).

    Attributes:
      on_finished: where finished samples go (the rollout's ``Inbox.generated``).
      clock: the run's time source (timings; thread servers' too).
      server_factory: builds each thread server like ``GenerationServer`` (tests
        wrap it to inject faults; generation programs take only the default).
    """

    on_finished: Callable[[Any], None]
    clock: Any
    server_factory: Callable[..., Any] = GenerationServer


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSync:
    """One publish: the copy (or offer + pull) and the handover to the servers.

    Attributes:
      copy_s: seconds until every server held the weights (D2D copies, or pulls).
      handover_s: seconds the rollout took to hand them over and release capacity
        (``ServersApplied.seconds``).
      bytes: bytes moved, all servers together (the adapters only under LoRA; under
        delta publish the deltas, or the full engine-side tree of a slot that fell back).
      changed_frac, full_fallbacks: thread delta publish (``DeltaStats.sync_fields``).
    """

    copy_s: float
    handover_s: float
    bytes: int
    changed_frac: float | None = None
    full_fallbacks: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resized:
    """One ``ThreadFleet.resize``: requests re-queued, the learner's reshard, new slots."""

    requeued: int
    reshard_bytes: int
    added: tuple[int, ...]


@dataclasses.dataclass
class _Slot:
    """A generation slot: engine, its param shardings, its publisher, the params it holds
    (and, under delta publish, what it reports to the fleet's ``DeltaPublisher``)."""

    engine: Any
    shardings: Any
    publisher: Publisher | AdapterPublisher
    params: Any = None
    sink: DeltaSink | None = None


class ThreadFleet:
    """Generation servers as threads on this program's generation meshes.

    Slot i holds server i of ``pool`` (the pool gives the index; a slot retired by
    ``resize`` is gone, one added takes the pool's next index). Engines are built
    once per device layout (``sync.reshard.LayoutCache``): a slice that returns to
    devices it held before reuses its engine and compiled programs.

    With ``delta`` (full fine-tuning; off by default: on CPU it is slower than the full
    copy, docs/PERF.md "Delta publish") a publish sends deltas
    (``sync.delta_publish.DeltaPublisher``: one source, a sink per slot; a new slot takes
    the full tree); otherwise the whole learner tree, which the engine then casts.
    """

    def __init__(
        self,
        exp: ExperimentConfig,
        model_config: Any,
        placement: Placement,
        tokenizer: Any,
        servers: ServerSettings,
        *,
        delta: bool = False,
    ):
        engine = {"rollout": exp.rollout, "env": exp.env, "lora": exp.learner.lora}
        self._engine_for = LayoutCache(
            lambda mesh: make_engine(model_config, mesh, tokenizer, **engine)
        )
        self._lora = exp.learner.lora is not None
        # Exact: the engine-side values are the cast place_params would do (bit-equal).
        self._delta = None
        if delta and not self._lora:
            self._delta = DeltaPublisher(lambda p: as_engine_dtypes(p, model_config))
        self._stop_ids, self._partial = tokenizer.stop_ids, exp.rollout.partial_rollout
        self._settings = servers
        self._slots = {i: self._slot(mesh) for i, mesh in enumerate(placement.generation)}
        self.pool: ServerPool | None = None  # ``start`` builds it
        self._listener: ServerListener | None = None  # ``listen`` names it
        self.last_publish_bytes = 0  # bytes the last publish moved, all slots together

    def _slot(self, mesh: Mesh) -> _Slot:
        engine, shardings = self._engine_for(mesh)
        # LoRA: the base goes to the slot once, then only the adapters move.
        publisher = AdapterPublisher(engine, shardings) if self._lora else Publisher()
        return _Slot(engine, shardings, publisher, sink=DeltaSink() if self._delta else None)

    @property
    def delta_stats(self) -> Any:
        """``sync.delta_publish.DeltaStats`` of this fleet's publishes (None: delta off)."""
        return None if self._delta is None else self._delta.stats

    def _push(self, slot: _Slot, learner: LearnerProgram, version: int) -> None:
        pub = slot.publisher
        if self._delta is not None:
            if self._delta.source.version != version:  # once per version, every slot
                self._delta.advance(learner.params, version)
            slot.params = self._delta.publish(slot.sink, slot.shardings, version)
            self.last_publish_bytes += self._delta.stats.last_bytes
        elif isinstance(pub, AdapterPublisher):
            slot.params = pub.publish(learner.params, learner.base, version).params
            self.last_publish_bytes += pub.last_bytes
        else:
            self.last_publish_bytes += tree_bytes(learner.params)
            slot.params = pub.publish(learner.params, slot.shardings, version).params

    def _copy(self, slots: list[_Slot], learner: LearnerProgram, version: int) -> None:
        """Learner params -> each slot's mesh, device to device (version ``version``)."""
        for slot in slots:
            self._push(slot, learner, version)
        jax.block_until_ready([slot.params for slot in slots])

    def _server(self, i: int, slot: _Slot, version: int) -> Any:
        s = self._settings
        return s.server_factory(
            f"gen{i}", slot.engine, slot.params, policy_version=version, stop_ids=self._stop_ids,
            partial_rollout=self._partial, on_finished=s.on_finished, clock=s.clock,
        )  # fmt: skip

    @property
    def engine_builds(self) -> int:
        """Engines built so far (one per generation device layout ever used)."""
        return self._engine_for.builds

    def start(self, learner: LearnerProgram, version: int) -> ServerPool:
        """The learner's params on every slot as ``version``, a server each: ``pool``
        (what the rollout routes to; started by the scheduler)."""
        self.last_publish_bytes = 0
        self._copy(list(self._slots.values()), learner, version)
        self.pool = ServerPool([self._server(i, s, version) for i, s in self._slots.items()])
        return self.pool

    def listen(self, listener: ServerListener) -> None:
        """``listener`` (the rollout routing to ``pool``) is told every change of the
        servers from now on (``publish``, ``resize``)."""
        self._listener = listener

    def publish(self, learner: LearnerProgram, version: int) -> WeightSync:
        """Learner params -> every slot, device to device; then the listener hands them
        to the servers (under its lock: deaths are seen there) and releases capacity."""
        clock = self._settings.clock
        t0 = clock.now()
        self.last_publish_bytes = 0
        self._copy(list(self._slots.values()), learner, version)
        copy_s = clock.now() - t0
        held = [self._slots[i].params if i in self._slots else None for i in range(len(self.pool))]
        done = self._listener.servers_changed(ServersChanged(version=version, weights=held))
        delta = {} if self._delta is None else self._delta.stats.sync_fields()
        return WeightSync(
            copy_s=copy_s, handover_s=done.seconds, bytes=self.last_publish_bytes, **delta
        )

    def resize(
        self,
        *,
        retire: list[int],
        learner_mesh: Mesh,
        add: list[Mesh],
        learner: LearnerProgram,
    ) -> Resized:
        """The elastic move (between learner steps, after the step's publish).

        Servers ``retire`` leave the rollout (the listener is told; their requests are
        re-queued) and their slots go; the learner state moves onto ``learner_mesh``;
        then each mesh of ``add`` gets a slot holding the learner's params and a server,
        and the listener is told of them together: they join at the pool's next indices.
        """
        requeued = 0
        for i in retire:  # stop generating there before the learner takes the devices
            requeued += self._listener.servers_changed(ServersChanged(retired=(i,))).requeued
            del self._slots[i]
        report = learner.move_to(learner_mesh)
        jax.block_until_ready(learner.state)
        version, slots, servers = learner.step, [], []
        for n, mesh in enumerate(add):  # weights on the new slice before it takes requests
            slot = self._slot(mesh)
            self._copy([slot], learner, version)
            slots.append(slot)
            servers.append(self._server(len(self.pool) + n, slot, version))
        added = self._listener.servers_changed(ServersChanged(added=servers)).added if add else ()
        self._slots.update(zip(added, slots, strict=True))
        return Resized(requeued=requeued, reshard_bytes=report.bytes, added=tuple(added))

    def generator(self) -> EngineGenerate:
        """What evaluation generates with: the first slot's engine at its params."""
        slot = self._slots[min(self._slots)]
        return EngineGenerate(slot.engine, slot.params, self._stop_ids)

    def close(self) -> None:
        pass


class ProcessFleet:
    """Generation servers as separate JAX programs, reached over gRPC.

    Programs pull the full tree at every version (``mesh.delta_publish`` applies to
    thread engines only so far; ``sync.transfer_delta`` is the programs' delta path,
    not yet wired here, docs/PERF.md "Delta publish").

    Starting: every local program is launched first (their imports overlap),
    then each is connected and configured; all must report the same weight
    layout (the same mesh shape), which the learner stages its weights for.

    Args:
      exp: the run (mesh.generation, num_generation_slices, generation_addresses,
        weight_transfer, generation_digests; rollout settings for the engine).
      model_config: the model every program builds.
      stop_ids: ids that end a response (``Tokenizer.stop_ids``).
      workdir: program logs go to ``<workdir>/generation/``.
      servers: what each ``RemoteGenerationServer`` reports to (its clock is the
        wall clock: only the publish timings read ``servers.clock``).

    Raises:
      ValueError: a ``server_factory`` other than the default (it builds thread
        servers; fault-injecting factories do not apply to processes); programs
        that report different layouts.
      ProgramUnavailableError: a program did not start or refused its configuration.
    """

    def __init__(
        self,
        exp: ExperimentConfig,
        model_config: Any,
        stop_ids: Any,
        workdir: str,
        servers: ServerSettings,
    ):
        if servers.server_factory is not GenerationServer:
            raise ValueError("server_factory applies to thread servers, not generation programs")
        m = exp.mesh
        self._servers: list[RemoteGenerationServer] = []  # close() may run before the end
        self._dir = os.path.join(workdir, "generation")
        os.makedirs(self._dir, exist_ok=True)
        self._exp, self._settings = exp, servers
        config = {
            "model_config": dataclasses.asdict(model_config),
            "engine": dataclasses.asdict(engine_config(rollout=exp.rollout, env=exp.env)),
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
            config["lora"] = {**lora, "source": lora_base_source(model=exp.model, seed=exp.seed)}
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
        self.last_publish_bytes = 0  # bytes offered by the last publish, per program

    def _offer(self, learner: LearnerProgram, version: int) -> WeightOffer:
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
        return offer

    def start(self, learner: LearnerProgram, version: int) -> ServerPool:
        """Offer ``version``; one ``RemoteGenerationServer`` per program: ``pool`` (each
        pulls that version when the scheduler starts it)."""
        self._offer(learner, version)
        self._servers = [
            RemoteGenerationServer(
                client,
                self._board,
                partial_rollout=self._exp.rollout.partial_rollout,
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
            for _ in pool.map(lambda s: self._pull(s, offer), self._servers):
                pass
        copy_s = clock.now() - t0
        change = ServersChanged(version=version, weights=[offer] * len(self.clients))
        done = self._listener.servers_changed(change)
        return WeightSync(copy_s=copy_s, handover_s=done.seconds, bytes=self.last_publish_bytes)

    @staticmethod
    def _pull(server: RemoteGenerationServer, offer: WeightOffer) -> None:
        try:
            server.pull(offer, TRANSFER_TIMEOUT_S)
        except RemoteServerDownError:
            pass  # its check() raises now: the scheduler re-routes, the supervisor restarts

    def resize(self, **_: Any) -> Resized:
        raise ValueError("elastic moves need thread servers (runtime.config.elastic_spec)")

    def generator(self) -> ProgramGenerate:
        """What evaluation generates with: the programs, beside the rollout's requests
        (started here if the scheduler has not yet: the evaluation before step 1)."""
        for server in self._servers:
            if not server.started:
                server.start()
        econf = engine_config(rollout=self._exp.rollout, env=self._exp.env)
        return ProgramGenerate(self._servers, econf, EVAL_TIMEOUT_S)

    def close(self) -> None:
        """Shut the programs down unless servers own them (the scheduler stops those)."""
        if not self._servers:
            for client in self.clients:
                client.shutdown()


def make_fleet(
    exp: ExperimentConfig,
    model_config: Any,
    placement: Placement,
    tokenizer: Any,
    workdir: str,
    servers: ServerSettings,
) -> ThreadFleet | ProcessFleet:
    """The fleet ``exp.mesh`` asks for (its engines built, or its programs configured)."""
    if exp.mesh.generation_processes:
        return ProcessFleet(exp, model_config, tokenizer.stop_ids, workdir, servers)
    delta = exp.mesh.delta_publish
    return ThreadFleet(exp, model_config, placement, tokenizer, servers, delta=delta)
