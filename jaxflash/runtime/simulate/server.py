"""A simulated generation server: continuous batching over K slots in virtual time.

Implements ``GenerationServerProtocol`` (the methods the real ``RolloutScheduler``
calls), so the real scheduler, admission, group buffer, staleness gate and ledger
run against it unchanged. It behaves like ``generation.slot_loop.SlotBatcher``
driven by ``runtime.gen_server.GenerationServer``:

* each step first fills free slots from the queue (prefill + insert: a fresh
  sample gets its first token at the fill; a prompt's fresh samples queued here
  share one prefill), then runs one decode step in which every live slot gains a
  token; a finished slot is refilled at the next step;
* commands (submit, abort, new weights) take effect at the next step boundary;
  in-flight samples then continue, restart or recompute (``partial_rollout``),
  and every token is stamped with the version that produced it.

Time is event-driven, not step-by-step: between two events every live slot
advances one token per step at a constant step time, so the next event is the
sample with the fewest steps left (a heap keyed by the global step count at
which each finishes). Server time is kept as *work seconds* mapped to clock
seconds by a speed factor (contention: ``set_factor``) and pauses (``suspend``:
a colocated server while its devices train), so slow-downs rescale what is left.

``token_block`` c > 1 coarsens time for pod-scale runs: a simulated step stands
for c decode steps and a Sample carries one placeholder token per c tokens; the
true lengths stay with the workload (``true_len``).
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable
from typing import Any

from jaxflash.generation.slot_types import IN_FLIGHT_POLICIES
from jaxflash.runtime.clock import VirtualClock
from jaxflash.runtime.simulate.barrier import RoundBarrier
from jaxflash.runtime.simulate.costs import CostModel
from jaxflash.runtime.simulate.requests import RequestKey, SharedPrefill, SimRequest, to_sample
from jaxflash.runtime.simulate.timebase import VersionHistory, WorkClock
from jaxflash.runtime.simulate.workload import SimWorkload
from jaxflash.types import GenerationRequest, PolicyVersion, Sample


class SimServer:
    """One simulated generation server (see the module docstring).

    Args:
      name: for stats.
      slots: K, concurrent decodes.
      costs: decode / prefill costs of one server.
      workload: lengths and turns of each (prompt, sample).
      on_finished: the scheduler's ``Inbox.generated``.
      clock: the driver's VirtualClock.
      partial_rollout: "continue" | "recompute" | "restart" at a weight update.
      policy_version: version of the initial weights.
      token_block: c >= 1 decode steps per simulated step.
      barrier: shared RoundBarrier (no queue scheduling), or None.
      gen_log: where to record each delivered sample's in-slot seconds (shared
        by the servers of one run), default a dict of its own.

    Raises:
      ValueError: slots < 1, token_block < 1, unknown partial_rollout.
    """

    def __init__(
        self,
        name: str,
        *,
        slots: int,
        costs: CostModel,
        workload: SimWorkload,
        on_finished: Callable[[Sample], None],
        clock: VirtualClock,
        partial_rollout: str = "continue",
        policy_version: PolicyVersion = 0,
        token_block: int = 1,
        barrier: RoundBarrier | None = None,
        gen_log: dict[RequestKey, float] | None = None,
    ) -> None:
        if slots < 1 or token_block < 1:
            raise ValueError(f"SimServer {name!r}: slots and token_block must be >= 1")
        if partial_rollout not in IN_FLIGHT_POLICIES:
            raise ValueError(
                f"SimServer {name!r}: partial_rollout must be one of {IN_FLIGHT_POLICIES}, "
                f"got {partial_rollout!r}"
            )
        self.name, self.K, self.costs, self.workload = name, slots, costs, workload
        self.partial_rollout, self.block, self.barrier = partial_rollout, token_block, barrier
        self._on_finished, self.clock = on_finished, clock
        self._version = self._requested = int(policy_version)
        self._pending_version: int | None = None
        self._queue: collections.OrderedDict[RequestKey, SimRequest] = collections.OrderedDict()
        self._running: dict[RequestKey, SimRequest] = {}
        self._heap: list[tuple[int, int, RequestKey]] = []  # (finish step, seq, key)
        self._env: list[tuple[float, int, SimRequest]] = []  # (ready clock time, seq, item)
        self._seq = 0
        self._outstanding: set[RequestKey] = set()
        self._aborts: set[RequestKey] = set()
        self._prefill = SharedPrefill()
        self._history = VersionHistory(self._version)
        self._steps = 0
        self._seg: tuple[float, int, float, float] | None = None  # w0, S0, pre_s, step_s
        self._wake_step: int | None = None  # a command waits for this step boundary
        self._due: float | None = None  # next_due, cached until something changes
        self._dirty = True
        self._work = WorkClock(clock.now())  # work seconds <-> clock seconds
        self._acc_t, self.live_slot_s, self.busy_s = clock.now(), 0.0, 0.0
        self.counts = collections.Counter()
        # in-slot seconds of each delivered sample (the driver pops what it trains)
        self.gen_time_s: dict[RequestKey, float] = {} if gen_log is None else gen_log
        if barrier is not None:
            barrier.subscribe(self._poke)

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> PolicyVersion:
        return self._version

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float = 60.0) -> list[RequestKey]:
        return sorted(self._outstanding)

    def check(self) -> None:
        pass

    def submit(self, request: GenerationRequest) -> None:
        key = (int(request.prompt_id), int(request.sample_index))
        if key in self._outstanding:
            raise ValueError(f"SimServer {self.name!r}: request {key} already submitted")
        item = SimRequest(request, self.workload.turns(*key))
        if self.barrier is not None:
            item.round_id = self.barrier.join(key)
        self._outstanding.add(key)
        self._queue[key] = item
        self._prefill.queued(key[0])
        self.counts["submitted"] += 1
        self._poke()

    def abort_prompt(self, prompt_id: int) -> int:
        keys = [k for k in self._outstanding if k[0] == int(prompt_id)]
        for key in keys:
            self._outstanding.discard(key)
            item = self._queue.pop(key, None)
            if item is not None and item.fresh:
                self._prefill.left_queue(key[0], filled=False)
            item = item or self._running.get(key)
            if key in self._running:
                self._aborts.add(key)  # its slot frees at the next step boundary
            waiting = [e for e in self._env if e[2].key == key]
            if waiting:
                item = waiting[0][2]
                self._env = [e for e in self._env if e[2].key != key]
                heapq.heapify(self._env)
            if self.barrier is not None and item is not None:
                self.barrier.aborted(key, item.round_id)
        self.counts["aborted"] += len(keys)
        if keys:
            self._poke()
        return len(keys)

    def update_weights(self, params: Any, version: PolicyVersion) -> None:
        del params  # nothing to compute with
        if version <= self._requested:
            raise ValueError(f"SimServer {self.name!r}: version {version} after {self._requested}")
        self._requested = self._pending_version = int(version)
        self._poke()

    def stats(self) -> dict[str, Any]:
        self._account(self.clock.now())
        return {
            "name": self.name,
            "version": self._version,
            "live_slot_s": self.live_slot_s,
            "busy_s": self.busy_s,
            "steps": self._steps * self.block,
            **{k: int(v) for k, v in self.counts.items()},
        }

    # ------------------------------------------------------------------ time

    def set_factor(self, factor: float) -> None:
        """From now on work runs ``factor`` times slower (contention; >= 1)."""
        if self._work.set_factor(self.clock.now(), factor):
            self._dirty = True

    def suspend(self, seconds: float) -> None:
        """Make no progress for the next ``seconds`` (devices lent to the learner)."""
        self._work.suspend(self.clock.now(), seconds)
        self._dirty = True

    @property
    def starved_slots(self) -> int:
        """Slots with nothing to run and nothing queued (idle for want of admissions)."""
        return max(0, self.K - len(self._running) - len(self._queue))

    @property
    def busy(self) -> bool:
        """Some slot is live (what contention counts)."""
        return self._seg is not None

    def _account(self, now: float) -> None:
        live = len(self._running) if self._seg is not None else 0
        dt = max(0.0, now - self._acc_t)
        self.live_slot_s += live * dt
        self.busy_s += dt if live else 0.0
        self._acc_t = max(self._acc_t, now)

    def _poke(self) -> None:
        """A command arrived: handle it at the end of the step in progress (now if idle)."""
        self._dirty = True
        if self._seg is None:
            self._wake_step = self._steps
            return
        w0, s0, pre, step = self._seg
        done = math.floor((self._work.work(self.clock.now()) - w0 - pre) / step + 1e-9)
        target = s0 + max(1, done + 1)
        self._wake_step = target if self._wake_step is None else min(self._wake_step, target)

    # ------------------------------------------------------------------ events

    def _boundary(self) -> tuple[int, float] | None:
        """(step count, clock time) of the next step boundary to process, if any."""
        if self._seg is None:
            if self._wake_step is None:
                return None
            return self._steps, max(self.clock.now(), self._work.t_ref)
        w0, s0, pre, step = self._seg
        target = self._next_finish_step()
        if self._wake_step is not None:
            target = min(target, self._wake_step)
        return target, self._work.time(w0 + pre + (target - s0) * step)

    def next_due(self) -> float | None:
        """Clock time of this server's next step boundary or environment return."""
        if self._dirty:
            due = [self._env[0][0]] if self._env else []
            boundary = self._boundary()
            if boundary is not None:
                due.append(boundary[1])
            self._due, self._dirty = min(due, default=None), False
        return self._due

    def _next_finish_step(self) -> int:
        while self._heap and self._stale(self._heap[0]):
            heapq.heappop(self._heap)  # aborted, restarted or resubmitted: a dead entry
        return self._heap[0][0] if self._heap else 1 << 62

    def _stale(self, entry: tuple[int, int, RequestKey]) -> bool:
        item = self._running.get(entry[2])
        return item is None or item.heap_seq != entry[1]

    def deliver_due(self) -> None:
        """Process the environment returns and the step boundary due now, if any."""
        now = self.clock.now()
        due = self.next_due()
        if due is None or due > now:
            return
        self._dirty = True
        while self._env and self._env[0][0] <= now:
            item = heapq.heappop(self._env)[2]
            if item.key in self._outstanding:
                self._queue[item.key] = item  # its next turn waits for a slot
                self._poke()
        boundary = self._boundary()
        if boundary is None or boundary[1] > now:
            return
        self._account(now)
        if self._seg is not None:
            w0, s0, pre, step = self._seg
            self._steps = boundary[0]
            w_now = w0 + pre + (self._steps - s0) * step
        else:
            w_now = self._work.work(now)
        self._wake_step = None
        self._apply_aborts()
        self._finish_due(now)
        self._apply_weights()
        pre = self._fill(now)
        self._seg = (w_now, self._steps, pre, self._step_s()) if self._running else None

    def _step_s(self) -> float:
        return self.costs.decode.step_s(len(self._running), self.K) * self.block

    def _produced(self, item: SimRequest) -> int:
        """Tokens (blocks) of its current turn made since its last fill, up to now."""
        return min(item.left, self._steps - item.fill_step + item.first_at_fill)

    def _finish_due(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= self._steps:
            entry = heapq.heappop(self._heap)
            if self._stale(entry):
                continue
            item = self._running.pop(entry[2])
            tokens = self._produced(item)
            item.versions.append(self._history.stamps(item.fill_step, tokens, item.first_at_fill))
            item.in_slot_s += now - item.filled_at
            turn = item.turns[item.turn]
            if item.turn + 1 < len(item.turns):  # the environment takes over
                item.turn, item.done = item.turn + 1, 0
                self._seq += 1
                heapq.heappush(self._env, (now + turn.env_latency_s, self._seq, item))
                continue
            self._deliver(item, now)

    def _deliver(self, item: SimRequest, now: float) -> None:
        key = item.key
        sample = to_sample(item, self.workload.prompt_len(key[0]))
        self.gen_time_s[key] = item.in_slot_s
        if self.barrier is not None:
            self.barrier.finished(key, item.round_id, self._report, sample)
        else:
            self._report(sample)

    def _report(self, sample: Sample) -> None:
        key = (sample.prompt_id, sample.sample_index)
        if key in self._outstanding:  # else aborted meanwhile: never delivered
            self._outstanding.discard(key)
            self.counts["delivered"] += 1
            self._on_finished(sample)

    def _apply_aborts(self) -> None:
        for key in self._aborts:
            self._running.pop(key, None)
        self._aborts.clear()

    def _apply_weights(self) -> None:
        if self._pending_version is None:
            return
        self._version, self._pending_version = self._pending_version, None
        self._history.apply(self._steps, self._version)
        self._prefill.invalidate()
        self.counts["weight_updates"] += 1
        if self.partial_rollout == "continue":
            return
        for key in reversed(list(self._running)):  # back to the front of the queue
            item = self._running.pop(key)
            if self.partial_rollout == "restart":
                self.counts["restarted"] += 1
                item = SimRequest(item.request, item.turns, round_id=item.round_id)
                self._prefill.queued(key[0])
            else:
                self.counts["recomputed"] += 1
                done = self._produced(item)
                item.versions.append(self._history.stamps(item.fill_step, done, item.first_at_fill))
                item.done += done
                item.in_slot_s += self.clock.now() - item.filled_at
            self._queue[key] = item
            self._queue.move_to_end(key, last=False)

    def _fill(self, now: float) -> float:
        """Fill free slots from the queue; returns the fill's seconds (work time).

        Fresh samples of a prompt share one prefill while any of them waits here
        (``SlotBatcher``'s prefix sharing); a recompute or a later turn prefills its
        whole context alone.
        """
        prompts: list[int] = []
        taken: list[RequestKey] = []
        free = self.K - len(self._running)
        for key, item in self._queue.items():
            if len(taken) >= free:
                break
            if self.barrier is None or self.barrier.may_fill(item.round_id):
                taken.append(key)
        for key in taken:
            item = self._queue.pop(key)
            pid = key[0]
            context = self.workload.prompt_len(pid)
            if not item.fresh:  # a recompute or a later turn prefills its whole context
                context += sum(
                    t.response_tokens + t.observation_tokens for t in item.turns[: item.turn]
                )
                prompts.append(context + item.done * self.block)
            elif self._prefill.left_queue(pid, filled=True):
                prompts.append(context)
            if item.start_version is None:
                item.start_version = self._version
            left = -(-item.turns[item.turn].response_tokens // self.block) - item.done
            item.first_at_fill = 1 if self.block == 1 else 0
            item.fill_step, item.filled_at, item.left = self._steps, now, left
            self._seq += 1
            item.heap_seq = self._seq
            finish = self._steps + max(1, left - item.first_at_fill)
            heapq.heappush(self._heap, (finish, self._seq, key))
            self._running[key] = item
        if taken and self.barrier is not None:
            self.barrier.started()
        self.counts["prefills"] += len(prompts)
        self.counts["fills"] += len(taken)
        return self.costs.prefill.fill_s(prompts, len(taken))
