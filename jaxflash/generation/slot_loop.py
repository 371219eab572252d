"""Continuous batching over a ``LlamaEngine``: jaxflash's own rollout loop.

RL rollouts drive the Engine API directly instead of JetStream's Driver (see
``serving.py``): params change between steps, samples can be aborted, and every
token carries its behaviour logprob and policy version.

``SlotBatcher`` owns the decode state and B slots. ``add`` queues a request,
``step`` fills every free slot (one batched prefill per prompt bucket, then one
``start_samples`` dispatch), runs one ``generate_block`` of up to ``decode_block``
decode steps for all slots and returns the samples that finished (a stop id — any
of ``stop_ids`` — gives EOS; ``max_new_tokens`` reached = LENGTH, truncated); a
finished slot is refilled at the start of the next ``step``. Everything that
changes the batch — new requests, aborts, new weights — applies between ``step``
calls, i.e. at block boundaries: with ``decode_block=1`` (the default) that is
every decode step, as before; a larger block syncs with the host once per block
(fewer dispatches and host copies) at the price of a slot that finishes mid-block
idling until the block ends. Tokens and logprobs are the same for every block size.
``set_params`` swaps weights between steps; in-flight samples then continue
(keep their KV cache), restart (regenerate from scratch) or recompute (re-prefill
prompt + generated prefix under the new weights, then continue), see
``IN_FLIGHT_POLICIES``; ``abort`` removes a queued or running sample.
``run_requests`` is a thin loop over it. Single-threaded by design: the runtime
layer owns any threads. Each sample's tokens, behaviour logprobs and versions, and
the queue's order, are ``sample_queue``'s; the slots and the engine's state are here.

Prefix sharing (``share_prefix=True``, the default): fresh requests of one prompt
share one prompt prefill (``prefill_sharing.SharedPrefills``), dropped at every
``set_params``.

Pages: the loop asks its page policy (``slot_pages.slot_pages``) where a request
starts, what each block may write and which sample gives pages back, whatever the
cache. Over a dense cache (``slot_pages.DensePages``) a request takes the lowest free
slot and nothing else happens. Over a paged one (``EngineConfig.kv_cache="paged"``,
``slot_pages.SlotPages``) pool pages are mapped to slots. A request waits for pages
at the head of the queue (``stats.page_waits``); fresh samples of one prompt map
its full prompt pages (``stats.shared_pages``) within a slot group
(``stats.copied_pages`` counts the copies other groups write); the newest running
sample is preempted (restarted, ``stats.preempted``) when its group runs out
mid-sample.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import numpy as np

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import SampleStart
from jaxflash.generation.page_pool import PagePool
from jaxflash.generation.prefill_sharing import SharedPrefills
from jaxflash.generation.sample_queue import RunningSample, SampleQueue, request_key
from jaxflash.generation.slot_pages import slot_pages
from jaxflash.generation.slot_types import (
    IN_FLIGHT_POLICIES,
    RequestKey,
    SlotStats,
    check_request,
    record_slot_event,
    resolve_stop_ids,
)
from jaxflash.types import FinishReason, GenerationRequest, PolicyVersion, Sample


class SlotBatcher:
    """Decode state + slots + a queue; the building block of rollout servers.

    Args:
      engine: the engine to drive.
      params: model params (placed on the engine's mesh here).
      policy_version: version of ``params``; stamped on every token.
      stop_ids: every token id that ends a sample (finish reason EOS; the
        token is kept in the response), e.g. ``Tokenizer.stop_ids``.
      eos_id: a single stop id, the same as ``stop_ids={eos_id}`` (give one
        of the two).
      share_prefix: fresh requests with equal prompt tokens share one prompt
        prefill (see the module docstring); False prefills every request alone.
        Either way the tokens and logprobs are bit-identical.
      decode_block: decode steps per ``step`` call (one dispatch, one host copy);
        see the module docstring. Results do not depend on it. None = the
        engine's ``EngineConfig.decode_block``.

    Raises:
      ValueError: decode_block < 1, or not exactly one of stop_ids / eos_id.
    """

    def __init__(
        self,
        engine: LlamaEngine,
        params: Any,
        *,
        policy_version: PolicyVersion,
        stop_ids: Collection[int] | None = None,
        eos_id: int | None = None,
        share_prefix: bool = True,
        decode_block: int | None = None,
    ):
        if decode_block is None:
            decode_block = engine.config.decode_block
        if decode_block < 1:
            raise ValueError(f"SlotBatcher: decode_block must be >= 1, got {decode_block}")
        self.decode_block = int(decode_block)
        self.stop_ids = resolve_stop_ids(stop_ids, eos_id)
        self.engine = engine
        self._prefills = SharedPrefills(
            engine.prefiller, share_prefix=share_prefix, capacity=engine.max_concurrent_decodes
        )
        self.stats = SlotStats()
        self._params = engine.place_params(params)
        self._version = int(policy_version)
        self._state = engine.init_decode_state()
        self._queue = SampleQueue()
        self._slots: list[RunningSample | None] = [None] * engine.max_concurrent_decodes
        # Where requests start and which pages they map (nothing to map when dense).
        self._pages = slot_pages(engine.config, self.decode_block)
        self._admissions = 0

    # ------------------------------------------------------------- interface

    @property
    def policy_version(self) -> PolicyVersion:
        return self._version

    @property
    def pages(self) -> PagePool | None:
        """The paged engine's page pool (its table, free count); None when dense."""
        return self._pages.pool

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._slots)

    def __contains__(self, key: RequestKey) -> bool:
        """Whether ``key`` is queued or running."""
        return key in self._queue or any(r and r.key == key for r in self._slots)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return not self._queue and self.num_running == 0

    def add(self, request: GenerationRequest) -> RequestKey:
        """Queue a request; it starts at the next ``step`` with a free slot.

        Raises:
          ValueError: see ``check_request``, or the key is already queued/running.
        """
        check_request(self.engine, request)
        key = request_key(request)
        if key in self:
            raise ValueError(f"SlotBatcher.add: request {key} is already queued or running")
        self._queue.add(RunningSample(request, None))
        return key

    def abort(self, key: RequestKey) -> Sample:
        """Stop a queued or running request; its slot is free at the next step.

        Returns:
          The sample so far with finish_reason ABORTED (no tokens if it was
          queued fresh; its prefix if it was waiting for a recompute).

        Raises:
          KeyError: no such request.
        """
        if key in self._queue:
            return self._finish(self._queue.pop(key), FinishReason.ABORTED)
        for slot, run in enumerate(self._slots):
            if run is not None and run.key == key:
                self._release(slot)
                return self._finish(run, FinishReason.ABORTED)
        raise KeyError(f"SlotBatcher.abort: no queued or running request {key}")

    def set_params(
        self, params: Any, policy_version: PolicyVersion, *, in_flight: str = "continue"
    ) -> None:
        """Use new weights from the next step on (no recompilation: same shapes).

        Args:
          params: new model params (same layout).
          policy_version: their version; never lower than the current one.
          in_flight: what running samples do. "continue" (partial rollout): keep
            their KV cache and tokens; later tokens carry the new version, so a
            sample's versions read e.g. [2, 2, 3, ...]. "restart": drop their
            tokens and put them back at the front of the queue; they regenerate
            from scratch (same RNG identity) under the new weights, every token
            at the new version, counted in ``stats.restarted``. "recompute"
            (AReaL's interruptible rollout, arXiv 2505.24298): go back to the
            front of the queue keeping tokens, behaviour logprobs and versions;
            at the next fill the prompt + prefix is re-prefilled under the new
            weights (rebuilding the KV cache) and sampling continues with the
            same per-sample key chain at the next token index, so versions read
            [2, 2, 3, ...] and, with unchanged weights, the tokens equal an
            uninterrupted run's. A prefix whose prompt + prefix exceeds
            max_prefill_length restarts instead (``stats.recompute_fallbacks``).

        Raises:
          ValueError: policy_version lower than the current one, or an unknown
            in_flight policy.
        """
        if policy_version < self._version:
            raise ValueError(
                f"SlotBatcher.set_params: policy_version {policy_version} < current "
                f"{self._version} (versions only go up)"
            )
        if in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(
                f"SlotBatcher.set_params: in_flight must be one of {IN_FLIGHT_POLICIES}, "
                f"got {in_flight!r}"
            )
        self._params = self.engine.place_params(params)
        self._version = int(policy_version)
        self._prefills.clear()  # a shared prefill is valid only under its params
        self._pages.new_params()  # ... and so are shared prompt pages
        if in_flight == "continue":
            return
        limit = self.engine.max_prefill_length
        running = [(s, r) for s, r in enumerate(self._slots) if r is not None]
        for slot, run in reversed(running):  # front of the queue, in slot order
            self._release(slot)
            if in_flight == "restart":
                self.stats.restarted += 1
            elif len(run.request.prompt_tokens) + len(run.tokens) > limit:
                self.stats.recompute_fallbacks += 1
            else:
                self.stats.recomputed += 1
                self._queue.add_first(run)  # keeps its prefix
                continue
            self._queue.add_first(RunningSample(run.request, None))

    def step(self, params: Any = None, policy_version: PolicyVersion | None = None) -> list[Sample]:
        """Fill free slots, run one block of decode steps, return the samples that finished.

        Args:
          params, policy_version: if given, ``set_params`` first.

        Returns:
          Finished samples (EOS or LENGTH), in the order they finished (by step,
          then slot); empty if none.
        """
        if params is not None:
            if policy_version is None:
                raise ValueError("SlotBatcher.step: params given without policy_version")
            self.set_params(params, policy_version)
        start = time.perf_counter()
        running = [
            (slot, r.admitted, r.request, len(r.tokens))
            for slot, r in enumerate(self._slots)
            if r is not None
        ]
        for slot in self._pages.grow(running):  # map the block's pages, or preempt
            self._preempt(slot)
        finished = self._fill()
        live = np.asarray([r is not None for r in self._slots])
        if live.any():
            self._state, block = self.engine.generate_block(
                self._params,
                self._state,
                steps=self.decode_block,
                live=live,
                stop_ids=sorted(self.stop_ids),
                page_table=self._pages.table,
            )
            mc = self.engine.model_config
            lk = (mc.n_layers, mc.n_experts_per_token)
            for i in range(block.steps):
                self.stats.steps += 1
                self.stats.slot_steps += len(self._slots)
                self.stats.live_slot_steps += int(block.live_n[i])
                for slot in map(int, np.flatnonzero(live)):
                    run = self._slots[slot]
                    if run is None:  # finished at an earlier step of this block
                        continue
                    if not block.emitted_nb[i, slot]:
                        # Stopped by the engine without a host-side reason: only a
                        # full cache does that (check_request prevents it).
                        reason = FinishReason.LENGTH
                    else:
                        token, logp = block.tokens_nb[i, slot], block.logps_nb[i, slot]
                        if block.routes_nbx is not None:  # the token this step fed
                            run.record_routes(block.routes_nbx[i, slot].reshape(1, *lk))
                        reason = self._append(run, int(token), float(logp))
                    if reason is not None:
                        self._release(slot)
                        finished.append(self._finish(run, reason))
            still = [s for s in np.flatnonzero(live) if self._slots[s] is not None]
            if block.steps < self.decode_block and still:
                raise RuntimeError(
                    f"SlotBatcher: the engine stopped slots {still} that are still running "
                    "(host and device stop conditions disagree)"
                )
        self.stats.busy_s += time.perf_counter() - start
        return finished

    # -------------------------------------------------------------- internals

    def _fill(self) -> list[Sample]:
        """Start queued requests in free slots until either runs out."""
        finished: list[Sample] = []
        while self._queue and None in self._slots:
            placed: list[tuple[int, RunningSample]] = []
            shared: list[int] = []  # leading pages mapped from a shared prompt
            free = [s for s, r in enumerate(self._slots) if r is None]
            while free and self._queue:
                run = self._queue.head()
                got = self._pages.admit(
                    free, run.request, len(run.tokens), share=self._prefills.share_prefix
                )
                if got is None:  # the head waits for pages (FIFO, no overtaking)
                    break
                free.remove(got.slot)
                shared.append(got.shared_pages)
                self.stats.shared_pages += got.shared_pages
                self.stats.copied_pages += got.copied_pages
                self._queue.pop_head()
                if not run.tokens:
                    run.start_version = self._version
                self._admissions += 1
                run.admitted = self._admissions
                placed.append((got.slot, run))
            if not placed:
                self.stats.page_waits += 1
                break
            prefills = self._prefills.prefills(
                self._params,
                [(run.request.prompt_tokens, run.tokens) for _, run in placed],
                self.stats,
            )
            starts = []
            for i, ((slot, run), prefill) in enumerate(zip(placed, prefills, strict=True)):
                r = run.request
                starts.append(
                    SampleStart(
                        prefill=prefill,
                        slot=slot,
                        seed=r.seed,
                        prompt_id=r.prompt_id,
                        sample_index=r.sample_index,
                        token_index=len(run.tokens),
                        budget=r.sampling.max_new_tokens - len(run.tokens) - 1,
                        shared_pages=shared[i],
                    )
                )
            # One dispatch per prefill batch, one host copy for all first tokens.
            self._state, tokens, logps = self.engine.start_samples(
                self._state, starts, self._pages.table
            )
            if self.engine.model_config.is_moe:  # prompt (+ prefix) routes of each sample
                routes = self.engine.prefill_routes(prefills)
                for (_, run), r in zip(placed, routes, strict=True):
                    run.record_routes(r)
            for (slot, run), token, logp in zip(placed, tokens, logps, strict=True):
                self._slots[slot] = run
                self.stats.fills += 1
                record_slot_event(self.stats.slot_fills, (self.stats.steps, slot, run.key))
                reason = self._append(run, int(token), float(logp))
                if reason is not None:  # done at its first token: free the slot again
                    self._release(slot)
                    finished.append(self._finish(run, reason))
        self._prefills.keep_only(self._queue.fresh_prompts())
        return finished

    def _preempt(self, slot: int) -> None:
        """Return a running sample's pages; it restarts from the front of the queue."""
        run = self._slots[slot]
        self._release(slot)
        self.stats.preempted += 1
        self._queue.add_first(RunningSample(run.request, None))

    def _release(self, slot: int) -> None:
        run = self._slots[slot]
        self._slots[slot] = None
        self._pages.release(slot)
        record_slot_event(self.stats.slot_releases, (self.stats.steps, slot, run.key))

    def _append(self, run: RunningSample, token: int, logp: float) -> FinishReason | None:
        self.stats.generated_tokens += 1
        return run.append(token, logp, self._version, self.stop_ids)

    def _finish(self, run: RunningSample, reason: FinishReason) -> Sample:
        self.stats.finished[reason] += 1
        return run.to_sample(reason, self._version)


def run_requests(
    engine: LlamaEngine,
    params: Any,
    requests: list[GenerationRequest],
    *,
    policy_version: PolicyVersion,
    stop_ids: Collection[int] | None = None,
    eos_id: int | None = None,
    stats: SlotStats | None = None,
    share_prefix: bool = True,
    decode_block: int = 8,
) -> list[Sample]:
    """Generate every request with continuous batching and fixed params.

    Args:
      engine: the engine (its sampling distribution must match the requests').
      params: model params, used for every token.
      requests: requests with distinct (prompt_id, sample_index).
      policy_version: stamped on every token and as each sample's start_version.
      stop_ids / eos_id: the ids that end a sample (see ``SlotBatcher``).
      stats: if given, updated in place with this run's counters (occupancy,
        tokens/s, slot fills).
      share_prefix: see ``SlotBatcher`` (same results either way; fewer prefills).
      decode_block: decode steps per dispatch (see ``SlotBatcher``; same results
        for every value).

    Returns:
      One Sample per request, in request order (finish_reason EOS or LENGTH).

    Raises:
      ValueError: if any request is invalid (see ``check_request``); raised
        before any generation, naming the request. Check requests first with
        ``check_request`` to count failures per prompt instead.
    """
    batcher = SlotBatcher(
        engine,
        params,
        policy_version=policy_version,
        stop_ids=stop_ids,
        eos_id=eos_id,
        share_prefix=share_prefix,
        decode_block=decode_block,
    )
    if stats is not None:
        batcher.stats = stats
    for request in requests:
        check_request(engine, request)
    keys = [batcher.add(r) for r in requests]
    done: dict[RequestKey, Sample] = {}
    while not batcher.idle:
        for sample in batcher.step():
            done[(sample.prompt_id, sample.sample_index)] = sample
    return [done[k] for k in keys]
