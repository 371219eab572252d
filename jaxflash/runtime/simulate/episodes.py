"""The real environment manager in virtual time: environment-level async vs a batch barrier.

The agentic counterpart of ``simulate.driver``: the real ``RolloutScheduler`` with
its environment manager (``runtime.rollout.episode_dispatch``), real environments (e.g.
FrozenLake wrapped in ``envs.latency.LatencyEnv``), and two simulated parts whose
time is a ``VirtualClock``:

* ``VirtualEnvTime`` runs each environment call at once and delivers its outcome
  after the latency the environment asked to sleep (``LatencyEnv(sleep=...)``);
* ``VirtualTurnServer`` answers each turn request with a scripted reply after
  ``prefill_s_per_token * prompt + decode_s * tokens`` seconds in one of its slots.

With ``barrier=True`` both hold their results until everything they run is done:
every turn waits for the whole batch's generation and then for the whole batch's
environment steps -- the synchronous batch rollout ROLL Flash compares against
(arXiv 2510.11345: σ = 10 s, 892 s -> 362 s per step with environment-level
async). ``run_steps`` drives it with a learner that trains each batch for
``train_s`` seconds and publishes the next version. Thread-free and deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.runtime.clock import VirtualClock
from jaxflash.runtime.rollout.episode_dispatch import episode_dispatch
from jaxflash.runtime.rollout.episode_groups import EpisodeSettings
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.scheduler import RolloutScheduler
from jaxflash.runtime.rollout.server_pool import ServersChanged
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.runtime.workloads.agentic import EnvGroupSource
from jaxflash.types import FinishReason, GenerationRequest, Sample, SamplingParams

Reply = Callable[[GenerationRequest], Sequence[int]]
"""A scripted policy: the token ids a turn request is answered with (stop id excluded)."""


class VirtualEnvTime:
    """An ``env_calls.Runner`` in virtual time.

    Args:
      clock: the run's clock.
      barrier: hold every outcome until all calls handed to it are due (lockstep).
    """

    def __init__(self, clock: VirtualClock, *, barrier: bool = False) -> None:
        self.clock, self.barrier = clock, barrier
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq, self._delay = 0, 0.0

    def sleep(self, seconds: float) -> None:
        """What the environment of the running call waits (pass as ``LatencyEnv(sleep=)``)."""
        self._delay += max(0.0, float(seconds))

    def __call__(self, call: Callable[[], Any], deliver: Callable[[Any], None]) -> None:
        self._delay = 0.0
        outcome = call()
        self._seq += 1
        heapq.heappush(self._heap, (self.clock.now() + self._delay, self._seq, deliver, outcome))

    def __len__(self) -> int:
        return len(self._heap)

    def next_due(self) -> float | None:
        """Clock time of the next delivery (the last one's with a barrier), or None."""
        if not self._heap:
            return None
        return max(t for t, *_ in self._heap) if self.barrier else self._heap[0][0]

    def deliver_due(self) -> int:
        """Deliver the outcomes due now (all or none with a barrier); how many."""
        now, n = self.clock.now(), 0
        if self.barrier and (self.next_due() or 0.0) > now:
            return 0
        while self._heap and self._heap[0][0] <= now:
            _, _, deliver, outcome = heapq.heappop(self._heap)
            deliver(outcome)
            n += 1
        return n


@dataclasses.dataclass
class _Running:
    request: GenerationRequest
    tokens: list[int]
    finish: FinishReason
    ends_at: float
    version: int


class VirtualTurnServer:
    """A generation server (``GenerationServerProtocol``) answering turns with ``reply``.

    Each request holds one of ``slots`` slots for ``prefill_s_per_token`` x prompt
    tokens + ``decode_s`` x response tokens; more requests queue (FIFO). The reply is
    cut at the request's ``max_new_tokens`` (LENGTH), else ends with ``stop_id``
    (EOS). Logprobs are -1.0, versions the server's version at the start.

    Args:
      on_finished: where finished samples go (``Inbox.generated``).
      clock: the run's clock.
      reply: the scripted policy.
      stop_id: appended to a reply that fits.
      slots, decode_s, prefill_s_per_token: the cost model (seconds).
      barrier: hold finished samples until nothing runs or waits (lockstep).
    """

    partial_rollout = "continue"

    def __init__(
        self,
        on_finished: Callable[[Sample], None],
        clock: VirtualClock,
        *,
        reply: Reply,
        stop_id: int,
        slots: int = 16,
        decode_s: float = 0.01,
        prefill_s_per_token: float = 0.0,
        barrier: bool = False,
    ) -> None:
        if slots < 1 or decode_s < 0 or prefill_s_per_token < 0:
            raise ValueError(
                f"VirtualTurnServer: need slots >= 1 and non-negative costs, got slots={slots}, "
                f"decode_s={decode_s}, prefill_s_per_token={prefill_s_per_token}"
            )
        self.on_finished, self.clock, self.reply, self.stop_id = on_finished, clock, reply, stop_id
        self.slots, self.decode_s, self.prefill_s = slots, decode_s, prefill_s_per_token
        self.barrier = barrier
        self._version = 0
        self.queue: list[GenerationRequest] = []
        self.running: list[_Running] = []
        self.held: list[Sample] = []
        self.busy_s = 0.0  # slot-seconds spent generating (occupancy)

    @property
    def version(self) -> int:
        return self._version

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float = 60.0) -> list[tuple[int, int]]:
        keys = [(r.prompt_id, r.sample_index) for r in self.queue]
        keys += [(r.request.prompt_id, r.request.sample_index) for r in self.running]
        self.queue, self.running = [], []
        return sorted(keys)

    def check(self) -> None:
        pass

    def submit(self, request: GenerationRequest) -> None:
        self.queue.append(request)
        self._fill()

    def abort_prompt(self, prompt_id: int) -> int:
        before = len(self.queue) + len(self.running)
        self.queue = [r for r in self.queue if r.prompt_id != prompt_id]
        self.running = [r for r in self.running if r.request.prompt_id != prompt_id]
        self.held = [s for s in self.held if s.prompt_id != prompt_id]
        return before - len(self.queue) - len(self.running)

    def update_weights(self, params: Any, version: int) -> None:
        del params
        self._version = int(version)

    def stats(self) -> dict[str, Any]:
        return {"version": self._version, "busy_s": self.busy_s}

    def next_due(self) -> float | None:
        """Clock time of the next request to finish (None when nothing runs)."""
        return min((r.ends_at for r in self.running), default=None)

    def deliver_due(self) -> int:
        """Finish the requests due now, refill their slots; hand on (or hold) the samples."""
        now = self.clock.now()
        done = [r for r in self.running if r.ends_at <= now]
        self.running = [r for r in self.running if r.ends_at > now]
        for r in done:
            self.held.append(self._sample(r))
        self._fill()
        if self.barrier and (self.running or self.queue):
            return 0
        out, self.held = self.held, []
        for s in out:
            self.on_finished(s)
        return len(out)

    def _fill(self) -> None:
        now = self.clock.now()
        while self.queue and len(self.running) < self.slots:
            req = self.queue.pop(0)
            tokens = [int(t) for t in self.reply(req)]
            budget = req.sampling.max_new_tokens
            finish = FinishReason.EOS if len(tokens) < budget else FinishReason.LENGTH
            tokens = tokens + [self.stop_id] if finish == FinishReason.EOS else tokens[:budget]
            cost = self.prefill_s * len(req.prompt_tokens) + self.decode_s * len(tokens)
            self.busy_s += cost
            self.running.append(_Running(req, tokens, finish, now + cost, self._version))

    @staticmethod
    def _sample(r: _Running) -> Sample:
        n = len(r.tokens)
        return Sample(
            prompt_id=r.request.prompt_id,
            sample_index=r.request.sample_index,
            prompt_tokens=np.asarray(r.request.prompt_tokens, np.int32),
            response_tokens=np.asarray(r.tokens, np.int32),
            behaviour_logprobs=np.full(n, -1.0, np.float32),
            token_versions=np.full(n, r.version, np.int32),
            start_version=r.version,
            finish_reason=r.finish,
        )


@dataclasses.dataclass(frozen=True)
class StepRun:
    """One learner step of ``run_steps``: the learner version it trained at, the batch,
    and when the batch was complete (clock seconds)."""

    version: int
    batch: Any
    ready_at: float


def run_steps(
    sched: Any,
    clock: VirtualClock,
    servers: Sequence[VirtualTurnServer],
    env_time: VirtualEnvTime,
    *,
    steps: int,
    train_s: float = 0.0,
    max_events: int = 1_000_000,
) -> list[StepRun]:
    """Discrete-event loop: ``steps`` learner steps of ``sched`` (a ``RolloutScheduler``).

    Each round: ``poll``; when the learner is idle, ``try_batch``; else jump to the
    earliest event (a turn finishing, an environment call returning, a deadline,
    the learner finishing). A batch is trained for ``train_s`` (generation and
    environments go on meanwhile), then ``mark_trained`` and ``servers_changed`` to v + 1.

    Raises:
      RuntimeError: nothing can happen while the learner waits (with the stats), or
        more than ``max_events`` events.
    """
    out: list[StepRun] = []
    version, training, train_done, events = 0, None, None, 0
    while version < steps:
        ThreadFree(sched).poll()
        if training is None:
            batch = ThreadFree(sched).try_batch(version)
            if batch is not None:
                out.append(StepRun(version, batch, clock.now()))
                training, train_done = batch, clock.now() + train_s
                continue
        elif clock.now() >= train_done:
            ThreadFree(sched).mark_trained(training.groups)
            version += 1
            sched.servers_changed(ServersChanged(version=version, weights=[None] * len(servers)))
            training = train_done = None
            continue
        if not ThreadFree(sched).parts.dispatcher.inbox.empty():
            continue
        due = [s.next_due() for s in servers] + [env_time.next_due(), train_done]
        deadline = ThreadFree(sched).next_deadline()
        if deadline is not None:
            due.append(deadline + 1e-9)  # deadlines fire strictly after their time
        due = [t for t in due if t is not None]
        if not due:
            raise RuntimeError(
                f"episode simulation stuck at version {version}: {sched.watch.stats()}"
            )
        events += 1
        if events > max_events:
            raise RuntimeError(f"episode simulation exceeded {max_events} events")
        clock.advance_to(max(clock.now(), min(due)))
        for s in servers:
            s.deliver_due()
        env_time.deliver_due()
    return out


def episode_scheduler(
    servers: Sequence[Any],
    inbox: Inbox,
    settings: EpisodeSettings,
    clock: VirtualClock,
    *,
    batch_groups: int,
    group_size: int,
    sampling: SamplingParams,
    async_ratio: int = 0,
    seed: int = 0,
    sample_deadline_s: float = float("inf"),
    ledger: PromptLedger | None = None,
    start_group: int = 0,
    resume_groups: Sequence[int] = (),
    counters: dict[str, int] | None = None,
) -> RolloutScheduler:
    """A ``RolloutScheduler`` playing groups of episodes (group g = environment seed g).

    ``resume_groups`` and ``counters`` restart a scheduler from a checkpoint's books
    (groups in flight then are played again from scratch).
    """
    source = EnvGroupSource("sim", start=start_group)
    books = RolloutBooks(
        source=source,
        ledger=ledger or PromptLedger(),
        buffer=GroupBuffer(group_size),
        resume_prompts=tuple(source.group(g) for g in resume_groups),
        counters=dict(counters or {}),
    )
    rollout = RolloutSettings(
        batch_prompts=batch_groups,
        group_size=group_size,
        async_ratio=async_ratio,
        sampling=sampling,
        seed=seed,
        sample_deadline_s=sample_deadline_s,
        refill_dropped=True,  # a failed group is replaced at once, as runtime.loop does
    )
    return RolloutScheduler(servers, inbox, books, rollout, episode_dispatch(settings), clock=clock)
