"""The learner as one SPMD JAX program, driven by the controller in its process 0.

``LearnerProgram`` owns the learner's state and every learner operation the RL
loop needs: ``train`` (the jitted step), ``skip`` (an empty step: the version
still advances), ``offer`` (stage the params in a generation program's layout and
offer them through this process's ``WeightSender``), ``save`` (a checkpoint) and
``preempted`` (did every process agree to stop here?).

With one process each call runs here. With several (``jax.distributed``;
``jax.process_count() > 1``), process 0 runs the controller and posts each call
to the others through ``LeaderLinks`` *before* running it; the others run
``learner_setup.follow``, which applies the same calls in the same order, so every process
issues the same collectives (the train step, the staging reshard, Orbax's save)
and holds the same state.

Preemption (SIGTERM). Multi-process: JAX's preemption service catches SIGTERM on
any process and ``multihost_utils.reached_preemption_sync_point(step)`` returns
True on every process at the same step (the max step any process reported, + 1),
so all of them save that step and exit cleanly. One process: a SIGTERM handler
sets a flag that the loop reads at every wait (``interrupt.check_stop``) and at the
step's end; a second SIGTERM ends the process at once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflash import failpoints
from jaxflash.checkpoint.checkpointer import CheckpointMeta
from jaxflash.generation.engine.params import as_engine_dtypes
from jaxflash.learner.state import state_shardings
from jaxflash.learner.step import make_train_step
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.runtime.fleet.learner_links import LeaderLinks
from jaxflash.runtime.resume import base_record, init_or_restore_learner
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.sync.reshard import LayoutCache, ReshardReport, reshard
from jaxflash.sync.transfer_layout import TreeLayout, stage_for_layout
from jaxflash.sync.transfer_sender import WeightSender
from jaxflash.types import TrainBatch

log = logging.getLogger(__name__)


class SenderPump:
    """A thread answering a ``WeightSender``'s requests (generation programs pulling)."""

    def __init__(self, sender: WeightSender):
        self.sender = sender
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sender.serve(0.05)
            except Exception as err:  # one bad request must not stop the learner
                log.warning("weight sender: %r", err)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sender.close()


class LearnerProgram:
    """The learner state and its operations, the same on every learner process.

    Args:
      model_config, imported_params, mesh, workdir: as
        ``runtime.resume.init_or_restore_learner`` (restores the latest checkpoint).
      learner, checkpoint, model, seed: the experiment's sections and seed, as
        ``init_or_restore_learner`` (``learner`` also builds the train step).
      sender: this process's ``WeightSender`` (generation programs pull from it),
        or None when generation runs in this process (threads).
      links: ``LeaderLinks`` on process 0 of a multi-process learner (None otherwise).
      block_digests: log the SHA-256 of every block this process offers, per version
        (``<workdir>/generation/learner_blocks.p<process>.jsonl``; keys as
        ``gen_hosts.shard_digests``): what each generation host's installed blocks
        are checked against, bit for bit (tests; costs a host copy per offer).
      leader: False on the other processes (``learner_setup.follow``): nothing is posted and the
        metrics and run records are process 0's business.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        imported_params: Any,
        mesh: Mesh,
        workdir: str,
        *,
        learner: Any,
        checkpoint: Any,
        model: Any,
        seed: int,
        sender: WeightSender | None = None,
        links: LeaderLinks | None = None,
        leader: bool = True,
        block_digests: bool = False,
    ):
        self._links = links
        # The params as the generation engines keep them (a delta offer's blocks).
        self._engine_view = jax.jit(functools.partial(as_engine_dtypes, model_config=model_config))
        self._digest_log = (
            os.path.join(workdir, "generation", f"learner_blocks.p{jax.process_index()}.jsonl")
            if block_digests
            else None
        )
        self._leader = leader
        self.state, self.meta, self.checkpointer = init_or_restore_learner(
            model_config, imported_params, mesh, workdir,
            learner=learner, checkpoint=checkpoint, model=model, seed=seed, records=leader,
        )  # fmt: skip
        # Per learner mesh: the jitted step and the state's shardings, built once per
        # device layout (an elastic move back to a layout reuses its compiled step).
        self._per_mesh = LayoutCache(
            lambda m: (
                make_train_step(model_config, learner, m, LEARNER_RULES),
                state_shardings(model_config, learner, m, LEARNER_RULES),
            )
        )
        self.mesh = mesh
        self._model, self._lora = model, learner.lora  # what ``base_record`` names
        self._base_record: dict[str, Any] | None = None  # LoRA: named in checkpoints
        self._train_step, self._shardings = self._per_mesh(mesh)
        self._pump = None if sender is None else SenderPump(sender)
        self.saved_step = int(self.meta.step)  # the newest checkpoint's step (0: none)
        self._sigterm = False
        self._previous_handler = None
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------ what the loop calls

    @property
    def step(self) -> int:
        """Learner steps taken == the policy version of ``params``."""
        return int(jax.device_get(self.state.step))

    @property
    def params(self) -> Any:
        """What is published: the params, or under LoRA the adapters only."""
        return self.state.params

    @property
    def base(self) -> Any:
        """The frozen LoRA base (``TrainState.base``); None without LoRA."""
        return self.state.base

    @property
    def base_record(self) -> dict[str, Any] | None:
        """LoRA: the base's source and SHA-256 digest (``resume.base_record``; what
        checkpoints and generation programs are checked against); None without LoRA."""
        if self.state.base is not None and self._base_record is None:
            self._base_record = base_record(self.state.base, model=self._model, lora=self._lora)
        return self._base_record

    @property
    def senders(self) -> tuple[str, ...]:
        """Every learner process's ``WeightSender`` address, in process order."""
        if self._pump is None:
            return ()
        others = () if self._links is None else self._links.follower_senders
        return (self._pump.sender.address, *others)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One jitted learner step on a host batch; its metrics as floats."""
        arrays = {
            f.name: np.asarray(getattr(batch, f.name))
            for f in dataclasses.fields(batch)
            if getattr(batch, f.name) is not None  # cycle_bt None: all fresh
        }
        self._post("train", arrays)
        self.state, metrics = self._train_step(self.state, batch)
        failpoints.reach("learner_step")
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def skip(self) -> None:
        """A step with nothing to train: the version advances, the weights do not."""
        self._post("skip")
        self.state = self.state.replace(
            step=jax.device_put(self.state.step + 1, self._shardings.step)
        )

    @property
    def train_steps(self) -> list[Any]:
        """The jitted steps built so far, one per learner mesh layout (``trace_count`` each)."""
        return [step for step, _ in self._per_mesh.values()]

    def move_to(self, mesh: Mesh) -> ReshardReport:
        """Put the state on ``mesh`` (the elastic pool's new learner devices) and use its step.

        Params and optimizer state are copied device to device (``sync.reshard``),
        bit for bit; the jitted step and shardings come from the per-layout cache
        (compiled once per layout). Between steps only (the old state is dropped).

        Raises:
          RuntimeError: a multi-process learner (every process would have to move;
            refused at start by ``runtime.elastic.check_elastic``).
        """
        if self._links is not None or not self._leader:
            raise RuntimeError("LearnerProgram.move_to: one learner process only")
        step, shardings = self._per_mesh(mesh)
        self.state, report = reshard(self.state, shardings)
        self._train_step, self._shardings, self.mesh = step, shardings, mesh
        return report

    def offer(self, layout: TreeLayout, *, delta: bool = False) -> tuple[str, ...]:
        """Stage ``params`` in a generation program's ``layout`` and offer them as
        version ``step`` on every process; returns the senders' addresses.

        With ``delta``, each process also offers its staged blocks as the engine keeps
        them (``as_engine_dtypes``): programs holding the previous version pull only
        the blocks' changes (``sync.transfer_delta``); the digest log hashes that view.

        Raises:
          RuntimeError: built without a sender. LayoutMismatchError: see
            ``stage_for_layout``.
        """
        if self._pump is None:
            raise RuntimeError("LearnerProgram.offer: built without a WeightSender")
        self._post("offer", layout=layout.to_json(), delta=bool(delta))
        staged = stage_for_layout(self.state.params, layout)
        engine = self._engine_view(staged) if delta else None
        self._pump.sender.offer(staged, self.step, engine=engine)
        if engine is not None:  # what the programs hold (and hash)
            staged = engine
        if self._digest_log is not None:
            from jaxflash.runtime.fleet.gen_hosts import shard_digests  # noqa: PLC0415

            os.makedirs(os.path.dirname(self._digest_log), exist_ok=True)
            line = {"version": self.step, "blocks": shard_digests(staged)}
            with open(self._digest_log, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return self.senders

    def preempted(self, step: int) -> bool:
        """True when the learner must save ``step`` and stop (every process agrees)."""
        self._post("sync_point", step=int(step))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return self._sigterm

    def save(self, meta: CheckpointMeta) -> None:
        """Checkpoint the state with ``meta`` (meta.step == step)."""
        self._post("save", meta=meta.to_json())
        self.saved_step = int(meta.step)
        if self.state.base is None:
            self.checkpointer.save(self.state, meta)
            return
        # LoRA: adapters + optimizer state only; the base is named by source + digest.
        meta = dataclasses.replace(meta, extra={**meta.extra, "lora_base": self.base_record})
        self.checkpointer.save(self.state.replace(base=None), meta)

    def close(self) -> None:
        """Wait for pending saves, stop the sender; followers exit."""
        try:
            self._post("close")
            self.checkpointer.close()
        finally:
            if self._pump is not None:
                self._pump.close()
            if self._links is not None:
                self._links.close()
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)

    # ------------------------------------------------------------ followers

    def apply(self, op: str, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> bool:
        """Run one command posted by process 0; False once it said close.

        Raises:
          ValueError: an unknown command.
        """
        if op == "train":
            self.train(TrainBatch(**arrays))
        elif op == "skip":
            self.skip()
        elif op == "offer":
            self.offer(TreeLayout.from_json(header["layout"]), delta=bool(header.get("delta")))
        elif op == "sync_point":
            if self.preempted(int(header["step"])):
                log.warning("preemption: every learner process saves step %d", header["step"])
        elif op == "save":
            self.save(CheckpointMeta.from_json(header["meta"]))
        elif op == "close":
            self.close()
            return False
        else:
            raise ValueError(f"unknown learner command {op!r}")
        return True

    def _post(self, op: str, arrays: dict[str, np.ndarray] | None = None, **fields: Any) -> None:
        if self._links is not None:
            self._links.post(op, arrays, **fields)

    @property
    def sigterm(self) -> bool:
        """One process: whether a SIGTERM arrived (the loop stops at its next wait or
        step end); with several, always False (their sync point decides at step ends)."""
        return self._sigterm

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        del signum, frame
        # os.write, not logging: the interrupted code may hold the handler's lock.
        os.write(2, b"\nSIGTERM: saving the last trained step, then stopping (again: at once)\n")
        self._sigterm = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the process
