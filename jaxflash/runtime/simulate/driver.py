"""The discrete-event loop: the real RolloutScheduler against simulated servers.

No threads, no real sleeping: the driver owns a ``VirtualClock`` and moves it from
one event to the next (a server step boundary or environment return, a reward
completion, the learner's train or sync end). Each round it calls the
scheduler's thread-free steps -- ``poll`` and, after anything changed,
``try_batch`` -- exactly as its pump thread and ``next_batch`` would, then jumps
to the earliest event. The learner trains a batch for the simulated learner
time, closes it (``mark_trained``), syncs weights and hands version v+1 over (``servers_changed``).

Placements (``SimConfig.placement``): "colocated" -- the servers live on the
learner's devices and make no progress while it trains or syncs (the synchronous
baseline with α = 0); "disjoint" -- the servers run on their own devices
throughout (ROLL Flash's rollout-train decoupling, α >= 0). Queue scheduling off
puts a ``RoundBarrier`` between the servers and the scheduler; prompt replication
off keeps a prompt's G samples on one server.

Determinism: same inputs, same result -- every draw is keyed by (prompt, sample),
events at equal times are taken in a fixed order (learner, servers by index,
rewards), and nothing reads real time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.groups import GroupFilter
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.clock import VirtualClock
from jaxflash.runtime.rollout.dispatch import prompt_dispatch
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.scheduler import RolloutScheduler
from jaxflash.runtime.rollout.server_pool import ServersChanged
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.runtime.simulate.barrier import RoundBarrier
from jaxflash.runtime.simulate.costs import CostModel
from jaxflash.runtime.simulate.learner import SimLearner, StepRecord
from jaxflash.runtime.simulate.metrics import SimResult, summarize
from jaxflash.runtime.simulate.scorer import SimScorer
from jaxflash.runtime.simulate.server import SimServer
from jaxflash.runtime.simulate.workload import SimWorkload
from jaxflash.types import Prompt, SamplingParams

PLACEMENTS = ("colocated", "disjoint")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run.

    Attributes:
      placement: "colocated" (generation pauses while training; α must be 0) or
        "disjoint".
      async_ratio: α >= 0.
      servers, slots_per_server: generation servers and K slots each.
      learner_devices: devices the learner trains on.
      batch_prompts, group_size: B prompts x G samples per learner step.
      steps: learner steps; warmup_steps: whole steps left out of the numbers.
      queue_scheduling: False = batch-level barrier rounds (``RoundBarrier``).
      prompt_replication: False = a prompt's G samples stay on one server.
      partial_rollout, stale_policy: as the runtime's rollout config.
      group_filter: dynamic-sampling filter (a filtered prompt is replaced at once,
        up to B per step, as ``runtime.loop.run`` does), or None.
      token_block: decode steps per simulated step (see ``SimServer``).
      replay_ratio: replayed samples trained per fresh one (learner time only).
      seed: of the scheduler's requests (the workload has its own).
    """

    placement: str
    async_ratio: int = 0
    servers: int = 1
    slots_per_server: int = 16
    learner_devices: int = 1
    batch_prompts: int = 4
    group_size: int = 4
    steps: int = 6
    warmup_steps: int = 1
    queue_scheduling: bool = True
    prompt_replication: bool = True
    partial_rollout: str = "continue"
    stale_policy: str = "drop"
    group_filter: GroupFilter | None = None
    token_block: int = 1
    replay_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"SimConfig.placement must be one of {PLACEMENTS}, got {self.placement!r}"
            )
        if self.placement == "colocated" and self.async_ratio != 0:
            raise ValueError(
                f"SimConfig: async_ratio={self.async_ratio} needs placement='disjoint' "
                "(colocated generation pauses while the learner trains: α = 0)"
            )
        small = {
            k: getattr(self, k)
            for k in (
                "servers",
                "slots_per_server",
                "learner_devices",
                "batch_prompts",
                "group_size",
                "steps",
                "token_block",
            )
            if getattr(self, k) < 1
        }
        if small or self.async_ratio < 0 or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"SimConfig: need {sorted(small) or 'counts'} >= 1, async_ratio >= 0 and "
                f"0 <= warmup_steps ({self.warmup_steps}) < steps ({self.steps})"
            )

    @property
    def slots(self) -> int:
        """K, decode slots over all servers."""
        return self.servers * self.slots_per_server


class SimPromptSource:
    """Prompts 0, 1, 2, ... with the workload's prompt lengths (``take``, ``cursor``)."""

    def __init__(self, workload: SimWorkload) -> None:
        self.workload, self.cursor = workload, 0

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            pid = self.cursor
            tokens = np.zeros(self.workload.prompt_len(pid), np.int32)
            out.append(Prompt(prompt_id=pid, text=f"p{pid}", prompt_tokens=tokens, answer=""))
            self.cursor += 1
        return out


class SimTokenizer:
    """Decodes nothing (simulated tokens carry no text); no token is EOS."""

    eos_id = -1
    stop_ids = frozenset()

    def decode(self, ids: Any) -> str:
        return ""

    def response_text(self, ids: Any) -> str:  # what the scheduler hands the reward
        return ""


def simulate(
    config: SimConfig, costs: CostModel, workload: SimWorkload, *, max_events: int = 50_000_000
) -> SimResult:
    """Runs ``config`` under ``costs`` and ``workload``; returns its measurements.

    Raises:
      RuntimeError: nothing can happen while the learner waits (a stuck
        simulation, with the scheduler's stats), or more than ``max_events``.
    """
    clock, inbox, ledger = VirtualClock(), Inbox(), PromptLedger()
    barrier = None if config.queue_scheduling else RoundBarrier()
    gen_log: dict[tuple[int, int], float] = {}  # in-slot seconds of each finished sample
    servers = [
        SimServer(
            f"sim{i}",
            slots=config.slots_per_server,
            costs=costs,
            workload=workload,
            on_finished=inbox.generated,
            clock=clock,
            partial_rollout=config.partial_rollout,
            token_block=config.token_block,
            barrier=barrier,
            gen_log=gen_log,
        )
        for i in range(config.servers)
    ]
    scorer = SimScorer(workload, clock, costs.reward)
    B, G = config.batch_prompts, config.group_size
    books = RolloutBooks(
        source=SimPromptSource(workload),
        ledger=ledger,
        buffer=GroupBuffer(G, group_filter=config.group_filter),
    )
    settings = RolloutSettings(
        batch_prompts=B,
        group_size=G,
        async_ratio=config.async_ratio,
        sampling=SamplingParams(max_new_tokens=workload.max_tokens),
        seed=config.seed,
        stale_policy=config.stale_policy,
        sample_deadline_s=float("inf"),
        refill_dropped=config.group_filter is not None,
        prompt_replication=config.prompt_replication,
        slots_per_server=config.slots_per_server,
    )
    dispatch = prompt_dispatch(scorer, SimTokenizer())
    sched = RolloutScheduler(servers, inbox, books, settings, dispatch, clock=clock)
    learner = SimLearner(
        costs,
        devices=config.learner_devices,
        rows=B * G,
        clock=clock,
        servers=config.servers,
        colocated=config.placement == "colocated",
        replay_ratio=config.replay_ratio,
    )
    colocated = config.placement == "colocated"
    records: list[StepRecord] = []
    training: list[Any] = []  # the groups of the step being trained
    snapshots: dict[int, tuple[float, list[dict[str, Any]]]] = {}
    version, changed, events = 0, True, 0
    admission = ThreadFree(sched).parts.admission
    starved = 0.0  # slot-seconds with nothing to run while admission was refused
    snapshots[0] = (clock.now(), [s.stats() for s in servers], starved)
    while version < config.steps:
        if ThreadFree(sched).poll():
            changed = True
        if learner.idle and changed:
            changed = False
            batch = ThreadFree(sched).try_batch(version)
            if batch is not None:
                record = _record(batch, version, clock.now(), gen_log, workload)
                records.append(record)
                training = batch.groups
                learner.start(record, [workload.prompt_len(p) for p in _pids(batch)])
                if colocated:  # the learner takes the devices: generation waits
                    for s in servers:
                        s.suspend(learner.due() - clock.now())
        if not inbox.empty():
            continue  # reports made while polling (e.g. instant rewards): poll again first
        _set_contention(costs, servers, learner)
        server_due = [s.next_due() for s in servers]
        due = [t for t in (learner.due(), scorer.next_due(), *server_due) if t is not None]
        if not due:
            raise RuntimeError(
                f"simulation stuck at version {version}, t={clock.now():.3f}: {sched.watch.stats()}"
            )
        before, blocked = clock.now(), not admission.can_admit()
        now = clock.advance_to(max(clock.now(), min(due)))
        if blocked:
            starved += (now - before) * sum(s.starved_slots for s in servers)
        events += 1
        if events > max_events:
            raise RuntimeError(f"simulation exceeded {max_events} events at version {version}")
        phase = learner.advance()
        if phase == "train":
            ThreadFree(sched).mark_trained(training)
            snapshots[version + 1] = (now, [s.stats() for s in servers], starved)
            sync_s = learner.due() - now
            if sync_s > 0 and (colocated or costs.sync.stalls_generation):
                for s in servers:
                    s.suspend(sync_s)
        elif phase == "sync":
            version += 1
            sched.servers_changed(ServersChanged(version=version, weights=[None] * len(servers)))
            changed = True
        for s, t in zip(servers, server_due, strict=True):
            if t is not None and t <= now:  # others: next round, after the scheduler saw this
                s.deliver_due()
        scorer.deliver_due()
    taken = range(books.source.cursor)  # every prompt admitted: what was started
    started = [(p, i) for p in taken for i in range(G)]
    return summarize(
        config,
        records,
        snapshots,
        learner,
        servers,
        sched,
        ledger,
        started=(
            tuple(workload.response_len(*k) for k in started),
            tuple(workload.reward(*k) for k in started),
        ),
    )


def _pids(batch: Any) -> list[int]:
    return [int(s.prompt_id) for g in batch.groups for s in g.samples]


def _record(
    batch: Any,
    version: int,
    now: float,
    gen_log: dict[tuple[int, int], float],
    workload: SimWorkload,
) -> StepRecord:
    """What the learner trains on, with true lengths and generation times."""
    record = StepRecord(version=version, taken_at=now)
    for g in batch.groups:
        record.groups.append(int(g.prompt_id))
        for s in g.samples:
            key = (int(s.prompt_id), int(s.sample_index))
            record.lengths.append(workload.response_len(*key))
            record.rewards.append(workload.reward(*key))
            record.staleness.append(version - int(start_version_of(s)))
            record.gen_s.append(gen_log.pop(key, 0.0))
    record.trained = len(record.lengths)
    return record


def _set_contention(costs: CostModel, servers: list[SimServer], learner: SimLearner) -> None:
    """Slow-down factors of the current busy set (disjoint devices: all 1.0)."""
    c = costs.contention
    if not c.gen and not c.train:
        return
    busy = sum(s.busy for s in servers)
    training = learner.phase == "train"
    for s in servers:
        s.set_factor(c.gen_factor(busy, training))
    learner.set_factor(c.train_factor(busy) if training else 1.0)
