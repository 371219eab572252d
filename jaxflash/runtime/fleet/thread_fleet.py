"""Generation servers as threads on this program's generation meshes (``ThreadFleet``).

One ``LlamaEngine`` per generation mesh carved from this program's devices, a
``GenerationServer`` thread each; ``publish`` copies the learner's params device to
device onto every generation mesh (with ``delta``, only the engine-side (bf16) weights
that changed since the slot's version, ``sync.delta_publish``: bit-identical to a full
copy; off by default, docs/PERF.md); ``resize`` is the elastic move. Built by
``fleets.make_fleet``; what a fleet is, and the calls both kinds answer: ``fleets``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from jaxflash.generation.engine.params import as_engine_dtypes
from jaxflash.models.adapters.lora import LoraConfig, tree_bytes
from jaxflash.runtime.config.env_spec import EnvSpec
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.fleet.eval_generation import EngineGenerate
from jaxflash.runtime.fleet.fleet_types import Resized, ServerSettings, WeightSync
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from jaxflash.runtime.fleet.placement import Placement
from jaxflash.runtime.model_setup import make_engine
from jaxflash.runtime.rollout.server_pool import ServerListener, ServerPool, ServersChanged
from jaxflash.sync.delta_publish import DeltaPublisher, DeltaSink
from jaxflash.sync.publish import AdapterPublisher, Publisher
from jaxflash.sync.reshard import LayoutCache


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

    Args:
      model_config: the model every engine builds.
      placement: the generation meshes (one slot each).
      tokenizer: its ``stop_ids`` end a response.
      servers: what every server is built with (``ServerSettings``).
      rollout, env, lora: the experiment's sections the engines are built from
        (``model_setup.make_engine``); ``lora`` None: full fine-tuning.
      delta: publish deltas (``mesh.delta_publish``; ignored under LoRA).
    """

    def __init__(
        self,
        model_config: Any,
        placement: Placement,
        tokenizer: Any,
        servers: ServerSettings,
        *,
        rollout: RolloutSpec,
        env: EnvSpec,
        lora: LoraConfig | None,
        delta: bool = False,
    ):
        engine = {"rollout": rollout, "env": env, "lora": lora}
        self._engine_for = LayoutCache(
            lambda mesh: make_engine(model_config, mesh, tokenizer, **engine)
        )
        self._lora = lora is not None
        # Exact: the engine-side values are the cast place_params would do (bit-equal).
        self._delta = None
        if delta and not self._lora:
            self._delta = DeltaPublisher(lambda p: as_engine_dtypes(p, model_config))
        self._stop_ids, self._partial = tokenizer.stop_ids, rollout.partial_rollout
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
