"""Queue scheduling of single-sample tasks over generation servers (ROLL Flash §5.1).

    prompts ─► G single-sample requests ─► least-loaded server ─► on_finished
       ▲          (prompt replication)                               │
       │                                            reward worker (per sample)
    capacity ◄── publish(v+1) ◄── learner ◄── next_batch ◄── GroupBuffer ◄┘

* Each sample is its own task: dispatched to the least-loaded up-to-date server,
  scored the moment it finishes (``RewardPool.submit`` from the server's
  callback; no batch barrier), filed in the ``GroupBuffer`` which assembles
  groups of G.
* Async ratio α (arXiv 2510.11345): at most ``(α+1)·B`` prompts, dynamic-sampling
  extras included, are in flight or waiting (a prompt's capacity is released only when
  the weights it was trained on — or dropped before — are published, so with α
  = 0 the next prompts start at the new version, exactly like the synchronous
  loop). Batches are assembled oldest first; a group older than learner version
  − α is dropped or regenerated (``stale_policy``) and counted.
* Surplus aborted once a batch is full (ROLL Flash §5.1): when ``next_batch(v)``
  returns B groups, every in-flight prompt whose start version (oldest sample's;
  see ``_start_estimate`` for continue/recompute vs restart servers) is below
  v + 1 − α -- stale at the next step -- is aborted on its servers at once,
  discarded from the buffer and closed STALE "surplus_stale" (drop, its capacity
  freed for a fresh prompt) or resubmitted (regenerate); its late samples are
  counted ``samples_late`` and never trained. Other outstanding requests are
  aborted only at ``close()``.
* No silent hang ("No silent hang", ../shared/cases/rl_pitfalls.md): a sample
  not back within ``sample_deadline_s`` is aborted on its server and retried on
  another (``max_retries``), then its prompt fails; ``next_batch`` itself raises
  TimeoutError instead of waiting forever.

Threads: one pump thread owns dispatch, deadlines and admission; servers only put
finished samples on a queue (no lock of ours is held while calling a server
from its own callback, so the two can never deadlock).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Any

from jaxflash.data.prompts import PromptFailure
from jaxflash.replay.group_buffer import DroppedGroup, Group, GroupBuffer
from jaxflash.replay.staleness import start_version_of
from jaxflash.replay.versions import PolicyClock
from jaxflash.runtime.ledger import PromptLedger
from jaxflash.runtime.rollout import TruncationPolicy
from jaxflash.runtime.scheduler_drops import DropsAndSurplus
from jaxflash.runtime.scheduler_faults import FaultHandling
from jaxflash.types import FinishReason, GenerationRequest, Prompt, PromptOutcome, SamplingParams


@dataclasses.dataclass(kw_only=True)
class _Request:
    request: GenerationRequest
    server: int
    dispatched_at: float
    version: int = 0  # the server's version at dispatch (start estimate, see _start_estimate)
    attempts: int = 0  # timeouts so far


@dataclasses.dataclass
class Batch:
    """What ``next_batch`` hands the learner.

    Attributes:
      groups: complete fresh groups, oldest first (at most B).
      dropped: groups that left the buffer untrained (already closed in the ledger,
        or resubmitted when regenerated).
      rows: rollouts.jsonl rows of every sample in ``groups`` and ``dropped``.
      wait_s: seconds the learner waited inside ``next_batch``.
    """

    groups: list[Group]
    dropped: list[DroppedGroup]
    rows: list[dict[str, Any]]
    wait_s: float


class RolloutScheduler(DropsAndSurplus, FaultHandling):
    """Keeps the generation servers fed and turns finished samples into groups.

    Args:
      servers: GenerationServer-like objects (``submit``, ``abort_prompt``,
        ``update_weights``, ``version``), constructed with ``on_finished=self.on_finished``
        (pass them in before ``start``; see ``attach``).
      source: prompt source (``take(n)`` -> Prompt | PromptFailure).
      ledger: the run's PromptLedger (mutated only under this scheduler's lock).
      buffer: GroupBuffer of group size G.
      reward_pool: RewardPool (``submit((text, answer, item_id)) -> Future``).
      tokenizer: ``decode(ids)`` and ``eos_id``.
      batch_prompts: B groups per learner step.
      group_size: G samples per prompt.
      async_ratio: α >= 0.
      sampling, seed: of every request (the RNG is keyed per sample).
      clock: the learner's PolicyClock (version the servers hold after publish).
      stale_policy: "drop" | "regenerate".
      sample_deadline_s: per-sample deadline (queue time on the server included).
      max_retries: retries after a deadline before the prompt fails.
      truncation: what a truncated response gets.
      resume_prompts: prompts in flight at the checkpoint (still open in the
        ledger), regenerated first and counted as ``prompts_regenerated_on_resume``.
      counters: counters restored from a checkpoint (they keep adding up).
      refill_dropped: dynamic sampling -- a filtered/failed/stale-dropped prompt
        frees its capacity at once (a replacement starts now) instead of at the
        next ``publish`` (the synchronous loop's behaviour, the default).
    """

    def __init__(
        self,
        servers: list[Any],
        source: Any,
        ledger: PromptLedger,
        buffer: GroupBuffer,
        reward_pool: Any,
        *,
        tokenizer: Any,
        batch_prompts: int,
        group_size: int,
        async_ratio: int,
        sampling: SamplingParams,
        seed: int,
        clock: PolicyClock,
        stale_policy: str = "drop",
        sample_deadline_s: float = 600.0,
        max_retries: int = 1,
        truncation: TruncationPolicy | None = None,
        resume_prompts: tuple[Prompt | PromptFailure, ...] = (),
        counters: dict[str, int] | None = None,
        refill_dropped: bool = False,
    ) -> None:
        if batch_prompts < 1 or group_size < 1 or async_ratio < 0:
            raise ValueError(
                f"need batch_prompts >= 1, group_size >= 1, async_ratio >= 0; got "
                f"{batch_prompts}, {group_size}, {async_ratio}"
            )
        if stale_policy not in ("drop", "regenerate"):
            raise ValueError(f"stale_policy must be drop | regenerate, got {stale_policy!r}")
        self.servers = list(servers)
        self.source, self.ledger, self.buffer = source, ledger, buffer
        self.reward_pool, self.tokenizer = reward_pool, tokenizer
        self.B, self.G, self.alpha = batch_prompts, group_size, async_ratio
        self.capacity = (async_ratio + 1) * batch_prompts
        self.sampling, self.seed, self.clock = sampling, seed, clock
        self.stale_policy, self.deadline_s, self.max_retries = (
            stale_policy,
            sample_deadline_s,
            max_retries,
        )
        self.truncation = truncation or TruncationPolicy()
        self.refill_dropped = refill_dropped
        self.counters: collections.Counter = collections.Counter(counters or {})
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._done: queue.Queue = queue.Queue()
        self._active: dict[int, Prompt] = {}  # admitted, not yet released
        self._requeue: collections.deque = collections.deque(resume_prompts)
        self.counters["prompts_regenerated_on_resume"] += len(resume_prompts)
        self._out: dict[tuple[int, int], _Request] = {}  # dispatched, not finished
        self._scoring: dict[tuple[int, int], Any] = {}  # key -> the sample being scored
        self._min_start: dict[int, int] = {}  # prompt -> oldest start of its accepted samples
        self._regen_at_publish: list[int] = []  # surplus prompts resubmitted at release
        self._to_release: list[int] = []  # taken by the learner, released at publish
        self._suspect: set[int] = set()  # servers that let a sample time out
        self._dead: set[int] = set()  # servers whose loop raised
        self._exhausted = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the pump thread (admission, dispatch, deadlines, scoring)."""
        self._thread = threading.Thread(target=self._pump, name="rollout-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the pump and abort every outstanding request (counted as aborted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for pid in sorted({k[0] for k in self._out}):
                self._abort_prompt(pid)

    def on_finished(self, sample: Any) -> None:
        """Server callback (server thread): hand the finished sample to the pump."""
        self._done.put(("generated", sample))

    # ------------------------------------------------------------------ learner side

    def next_batch(self, learner_version: int, timeout_s: float = 3600.0) -> Batch:
        """Up to B complete fresh groups for the step at ``learner_version``, oldest first.

        Returns as soon as B groups are ready, or with fewer when nothing more can
        arrive (no sample in flight and no capacity to admit one, e.g. α = 0 with
        failed prompts -- as in the synchronous loop). Dropped groups are closed in
        the ledger (STALE / FILTERED / FAILED) or, for ``stale_policy="regenerate"``,
        resubmitted with fresh samples.

        Raises:
          TimeoutError: nothing could complete a batch within ``timeout_s``
            (naming the scheduler's counts), or the pump thread died.
        """
        t0 = time.monotonic()
        groups: list[Group] = []
        dropped: list[DroppedGroup] = []
        rows: list[dict[str, Any]] = []
        with self._changed:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"rollout scheduler failed: {self._error!r}")
                got, gone = self.buffer.take(
                    self.B - len(groups), learner_version, self.alpha, self.stale_policy
                )
                groups += got
                dropped += gone
                rows += [self._row(s, "trained") for g in got for s in g.samples]
                rows += [self._row(s, d.reason) for d in gone for s in d.samples]
                for d in gone:
                    self._resolve_dropped(d)
                self._to_release += [g.prompt_id for g in got]
                if len(groups) == self.B:
                    gone, gone_rows = self._abort_surplus(learner_version)
                    dropped += gone
                    rows += gone_rows
                    break
                if self._quiescent() and not self.buffer.num_complete():
                    break
                left = timeout_s - (time.monotonic() - t0)
                if left <= 0:
                    raise TimeoutError(
                        f"next_batch: {len(groups)}/{self.B} groups after {timeout_s}s at "
                        f"learner version {learner_version}: {self.stats()}"
                    )
                self._changed.wait(min(left, 0.5))
            self._changed.notify_all()
        return Batch(groups=groups, dropped=dropped, rows=rows, wait_s=time.monotonic() - t0)

    def mark_trained(self, groups: list[Group]) -> None:
        """Close trained prompts in the ledger (their capacity returns at ``publish``)."""
        with self._lock:
            for g in groups:
                self.ledger.close(g.prompt_id, PromptOutcome.TRAINED, "trained")
            self.ledger.check()

    def publish(self, params_by_server: list[Any], version: int) -> float:
        """Hand new weights to every server (non-blocking) and release trained capacity.

        Args:
          params_by_server: params already on each server's mesh (``sync.publish``).
          version: the new policy version (> every previous one).

        Returns:
          Seconds spent handing the weights over.
        """
        t0 = time.monotonic()
        for i, (server, params) in enumerate(zip(self.servers, params_by_server, strict=True)):
            if i in self._dead:
                continue
            try:
                server.update_weights(params, version)
            except Exception as err:  # a dead server: reroute its work, keep going
                with self._lock:
                    self._mark_dead(i, err)
        self.clock.publish(int(version))
        self.release()
        return time.monotonic() - t0

    def release(self) -> None:
        """Free the capacity of prompts taken by the learner since the last release."""
        with self._changed:
            for pid in self._to_release:
                self._active.pop(pid, None)
                self._min_start.pop(pid, None)
            self._to_release = []
            for pid in self._regen_at_publish:  # surplus prompts, fresh at this version
                if pid in self._active:
                    for i in range(self.G):
                        self._dispatch(self._request(self._active[pid], i))
            self._regen_at_publish = []
            self._changed.notify_all()

    def snapshot(self) -> tuple[dict[str, Any], dict[str, int], int]:
        """(ledger state dict, counters, data cursor), consistent, for a checkpoint."""
        with self._lock:
            counts = {k: int(v) for k, v in self.counters.items()}
            return self.ledger.state_dict(), counts, int(self.source.cursor)

    def stats(self) -> dict[str, Any]:
        """Counters plus instantaneous queue state, for metrics.jsonl."""
        with self._lock:
            out = {k: int(v) for k, v in sorted(self.counters.items())}
            out.update(
                prompts_active=len(self._active),
                samples_outstanding=len(self._out),
                samples_scoring=len(self._scoring),
                **{f"buffer_{k}": v for k, v in self.buffer.counts().items()},
                **self.ledger.metrics(),
            )
            return out

    # ------------------------------------------------------------------ pump thread

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    items = [self._done.get(timeout=0.02)]
                except queue.Empty:
                    items = []
                while True:
                    try:
                        items.append(self._done.get_nowait())
                    except queue.Empty:
                        break
                with self._changed:
                    for kind, sample, *rest in items:
                        if kind == "generated":
                            self._on_generated(sample)
                        else:
                            self._on_scored(sample, rest[0])
                    self._check_servers()
                    self._check_deadlines()
                    self._admit()
                    self._changed.notify_all()
        except BaseException as err:  # surfaced by next_batch, never swallowed
            with self._changed:
                self._error = err
                self._changed.notify_all()

    def _quiescent(self) -> bool:
        """Nothing in flight and nothing admissible: waiting cannot add a group."""
        can_admit = len(self._active) < self.capacity and not self._exhausted
        return not self._out and not self._scoring and self._done.empty() and not can_admit

    def _admit(self) -> None:
        while len(self._active) < self.capacity:
            if self._requeue:
                item = self._requeue.popleft()
            else:
                if self._exhausted:
                    return
                items = self.source.take(1)
                if not items:
                    self._exhausted = True
                    return
                item = items[0]
                self.ledger.take(item.prompt_id)
            if isinstance(item, PromptFailure):
                self._active[item.prompt_id] = item
                self.buffer.fail(item.prompt_id, item.reason)
                continue
            self._active[item.prompt_id] = item
            for i in range(self.G):
                if not self._dispatch(self._request(item, i)):
                    break

    def _request(self, prompt: Prompt, index: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_id=prompt.prompt_id,
            sample_index=index,
            prompt_tokens=prompt.prompt_tokens,
            sampling=self.sampling,
            seed=self.seed,
        )

    def _dispatch(self, request: GenerationRequest, attempts: int = 0, avoid: int = -1) -> bool:
        """Send to the least-loaded server (prefer up to date, healthy, not ``avoid``)."""
        load = collections.Counter(r.server for r in self._out.values())
        version = self.clock.version
        alive = [i for i in range(len(self.servers)) if i not in self._dead]
        if not alive:
            raise RuntimeError(f"every generation server died: {self.stats()}")

        def rank(i: int) -> tuple:
            s = self.servers[i]
            return (i == avoid, i in self._suspect, s.version < version, load[i], i)

        best = min(alive, key=rank)
        key = (request.prompt_id, request.sample_index)
        held = int(self.servers[best].version)
        try:
            self.servers[best].submit(request)
        except ValueError as err:  # e.g. a prompt the engine cannot hold
            self.counters["samples_failed"] += 1
            self.buffer.fail(request.prompt_id, f"prompt {request.prompt_id}: {err}")
            self._abort_prompt(request.prompt_id)
            return False
        except Exception as err:  # the server died: mark it, try another
            self._mark_dead(best, err)
            return self._dispatch(request, attempts, avoid)
        self._out[key] = _Request(
            request=request,
            server=best,
            dispatched_at=time.monotonic(),
            version=held,
            attempts=attempts,
        )
        return True

    def _on_generated(self, sample: Any) -> None:
        key = (int(sample.prompt_id), int(sample.sample_index))
        req = self._out.get(key)
        if req is None or sample.finish_reason == FinishReason.ABORTED:
            self.counters["samples_late"] += 1  # aborted or retried meanwhile
            return
        del self._out[key]
        self._suspect.discard(req.server)
        self.counters["samples_generated"] += 1
        start = int(start_version_of(sample))
        self._min_start[key[0]] = min(self._min_start.get(key[0], start), start)
        prompt = self._active[key[0]]
        eos = self.tokenizer.eos_id
        sample.response_text = self.tokenizer.decode(
            [int(t) for t in sample.response_tokens if int(t) != eos]
        )
        self._scoring[key] = sample
        item = (sample.response_text, prompt.answer, f"prompt {key[0]} sample {key[1]}")
        future = self.reward_pool.submit(item)
        future.add_done_callback(lambda f, s=sample: self._done.put(("scored", s, f)))

    def _on_scored(self, sample: Any, future: Any) -> None:
        key = (int(sample.prompt_id), int(sample.sample_index))
        if self._scoring.get(key) is not sample:
            self.counters["samples_late"] += 1  # its prompt was aborted as surplus meanwhile
            return
        del self._scoring[key]
        if key[0] not in self._active or key in self._out:
            self.counters["samples_late"] += 1  # prompt closed or resubmitted meanwhile
            return
        try:
            result = future.result()
            error, components, score = result.error, dict(result.components), result.score
        except Exception as err:  # the pool itself failed: count, never hang
            error, components, score = f"reward pool: {err!r}", {}, 0.0
        sample.reward_info = {"components": components, "error": error}
        sample.reward = float(score)
        if error is None and sample.truncated and self.truncation.mode == "penalty":
            sample.reward = float(self.truncation.penalty)
        self.counters["samples_scored"] += 1
        self.buffer.add(sample)
