"""What held-out evaluation generates with, on either fleet (``workloads.evaluation.Generate``).

- ``EngineGenerate`` (threads): the first generation slot's engine and its published
  params, in this process, beside that slot's server (its own slots, its own cache).
- ``ProgramGenerate`` (generation programs): the requests go to the programs through
  their ``RemoteGenerationServer``s, round-robin, each finished sample routed back here
  instead of to the scheduler's inbox. A program that dies meanwhile loses its
  requests; they are submitted again on a program that is up (a restarted one
  resyncs to the published version first), so one evaluation survives a restart.

On the wire an evaluation request's prompt id is ``-1 - prompt_id`` (training ids are
>= 0), so it never shares a (prompt_id, sample_index) key with a training request in
flight on the same program; the samples come back with their own ids. The sampling
RNG is keyed by the id on the wire, so a program's evaluation draws other streams than
a thread run's: the same estimator (mean@n), not the same samples.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from collections.abc import Callable, Collection, Sequence
from typing import Any

from jaxflash.generation.engine.prefill import Prefiller
from jaxflash.generation.slot_loop import SlotBatcher, run_requests
from jaxflash.generation.slot_types import check_request
from jaxflash.runtime.fleet.remote_server import RemoteGenerationServer, RemoteServerDownError
from jaxflash.types import GenerationRequest, RequestKey, Sample

OnStep = Callable[[list[Sample], int], None]
"""``on_step(samples finished since the last call, tokens generated so far)``."""


def _key(r: GenerationRequest | Sample) -> RequestKey:
    return int(r.prompt_id), int(r.sample_index)


class EngineGenerate:
    """Generation on one engine of this process at fixed params (a thread fleet's slot)."""

    def __init__(self, engine: Any, params: Any, stop_ids: Collection[int]):
        self._engine, self._params, self._stop_ids = engine, params, stop_ids

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError if the engine cannot run ``request`` (``check_request``)."""
        check_request(self._engine, request)

    def run(
        self, requests: Sequence[GenerationRequest], *, version: int, on_step: OnStep | None = None
    ) -> list[Sample]:
        """Every request, continuously batched; one Sample each, in request order.

        Without ``on_step``: ``slot_loop.run_requests``. With it: called after every
        decode step (a console's progress).
        """
        if on_step is None:
            return run_requests(
                self._engine, self._params, list(requests), policy_version=version,
                stop_ids=self._stop_ids,
            )  # fmt: skip
        batcher = SlotBatcher(
            self._engine, self._params, policy_version=version, stop_ids=self._stop_ids
        )
        keys = [batcher.add(r) for r in requests]
        done: dict[RequestKey, Sample] = {}
        while not batcher.idle:
            finished = batcher.step()
            done.update((_key(s), s) for s in finished)
            on_step(finished, batcher.stats.generated_tokens)
        return [done[k] for k in keys]


class ProgramGenerate:
    """Generation through generation programs (module docstring).

    Args:
      servers: the fleet's ``RemoteGenerationServer``s (those up take requests).
      engine_config: the programs' ``EngineConfig`` (``check`` runs its limits here).
      timeout_s: the longest one ``run`` may take.
    """

    def __init__(
        self, servers: Sequence[RemoteGenerationServer], engine_config: Any, timeout_s: float
    ):
        self._servers = list(servers)
        self._timeout_s = float(timeout_s)
        # ``check_request`` reads only these three of an engine: the programs' limits.
        self._limits = types.SimpleNamespace(
            prefiller=Prefiller(engine_config, None, None),
            max_target_length=engine_config.max_target_length,
            config=engine_config,
        )

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError if the programs' engines cannot run ``request``."""
        check_request(self._limits, request)

    def run(
        self, requests: Sequence[GenerationRequest], *, version: int, on_step: OnStep | None = None
    ) -> list[Sample]:
        """Every request on the programs; one Sample each, in request order.

        Raises:
          TimeoutError: not every sample arrived within ``timeout_s``.
        """
        del version  # the programs generate at the version published last
        wire = {_key(r): dataclasses.replace(r, prompt_id=-1 - int(r.prompt_id)) for r in requests}
        cond, arrived = threading.Condition(), []

        def deliver(sample: Sample) -> None:  # a program's reader thread
            with cond:
                arrived.append(sample)
                cond.notify_all()

        done: dict[RequestKey, Sample] = {}
        placed: dict[RequestKey, tuple[RemoteGenerationServer, int]] = {}
        todo, turn, tokens = list(wire), 0, 0
        end = time.monotonic() + self._timeout_s
        while len(done) < len(wire):
            if time.monotonic() > end:
                raise TimeoutError(
                    f"evaluation on the generation programs: {len(done)}/{len(wire)} samples "
                    f"after {self._timeout_s:g}s"
                )
            todo, turn = self._place(todo, wire, placed, deliver, turn)
            with cond:
                if not arrived:
                    cond.wait(0.2)
                batch, arrived[:] = list(arrived), []
            finished = []
            for s in batch:
                k = (-1 - int(s.prompt_id), int(s.sample_index))
                if k in wire and k not in done:  # a late copy of a re-sent request: dropped
                    done[k] = dataclasses.replace(s, prompt_id=k[0])
                    finished.append(done[k])
                    tokens += len(s.response_tokens)
            if on_step is not None:
                on_step(finished, tokens)
            todo += [  # sent to an incarnation that died since: lost there, sent again
                k
                for k, (server, life) in placed.items()
                if k not in done and server.incarnation != life and k not in todo
            ]
        return [done[_key(r)] for r in requests]

    def _place(
        self,
        todo: list[RequestKey],
        wire: dict[RequestKey, GenerationRequest],
        placed: dict[RequestKey, tuple[RemoteGenerationServer, int]],
        deliver: Callable[[Sample], None],
        turn: int,
    ) -> tuple[list[RequestKey], int]:
        """Submit what is in ``todo`` to the programs up, round-robin; returns what is left."""
        left = []
        for k in todo:
            for _ in range(len(self._servers)):
                server = self._servers[turn % len(self._servers)]
                turn += 1
                life = server.incarnation
                if life is None:
                    continue
                try:
                    server.submit(wire[k], on_finished=deliver)
                except RemoteServerDownError:
                    continue
                placed[k] = (server, life)
                break
            else:
                left.append(k)  # no program up now: tried again at the next round
        return left, turn
