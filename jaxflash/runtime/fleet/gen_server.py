"""One generation server: a daemon thread driving one ``SlotBatcher``.

ROLL Flash (arXiv 2510.11345) decouples rollout from training: each generation
slice runs its own loop, takes single-sample requests at any time, can abort
them, and takes new weights between two decode steps while generation goes on.

Threading model. Callers (the scheduler's thread) never touch the batcher or
the device: ``submit`` / ``abort_prompt`` / ``update_weights`` / ``stop`` put a
command in an inbox under one lock and wake the server thread. The server
thread alone owns the ``SlotBatcher``: it drains the inbox, applies the latest
weight update (with the ``partial_rollout`` policy) between two decode steps,
runs one step while it has work, and blocks on a condition variable when it has
none (no busy-wait). Finished samples go to ``on_finished`` from the server
thread.

Accounting. The set of *outstanding* request keys (submitted, neither delivered
nor aborted) lives under the lock, so ``abort_prompt`` decides atomically: a key
it removes is never delivered, even if the thread finished it in the same
instant. Every submitted request therefore ends exactly once: delivered through
``on_finished``, counted by ``abort_prompt``'s return value, or (after an error
or ``stop``) still listed by ``outstanding()``.

Errors. An exception in the loop (engine, on_finished) stops the thread and is
re-raised, chained, by the next call of ``submit``, ``abort_prompt``,
``update_weights``, ``check`` or ``stats``: a dead server is never silent.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Collection
from typing import Any

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.slot_loop import SlotBatcher
from jaxflash.generation.slot_types import IN_FLIGHT_POLICIES, check_request
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.types import GenerationRequest, PolicyVersion, RequestKey, Sample

_MAX_SPANS = 4096  # busy spans kept for the timeline between two reads
_MERGE_GAP_S = 0.005  # decode blocks closer than this form one busy span


class GenerationServerError(RuntimeError):
    """The server's loop raised; ``__cause__`` holds the original exception."""


class GenerationServer:
    """A thread that generates single-sample requests on one engine.

    Args:
      name: for errors, thread name and stats.
      engine: the engine of this generation slice (its mesh is the slice).
      params: initial weights (placed on the engine's mesh).
      policy_version: their version.
      stop_ids: every id that ends a sample (``Tokenizer.stop_ids``: eos,
        end-of-turn, generation_config's list); a stop id ends it with finish
        reason EOS and is kept as its last token.
      eos_id: a single stop id instead (``stop_ids={eos_id}``); give exactly one.
      partial_rollout: in-flight policy at a weight update, one of
        ``IN_FLIGHT_POLICIES`` ("continue" | "restart" | "recompute"), see
        ``SlotBatcher.set_params``.
      on_finished: called with each finished Sample (EOS or LENGTH) from the
        server thread; never for aborted samples. Keep it short (e.g. put the
        sample on a queue): the server does not decode while it runs. If it
        raises, the server stops with that error.
      clock: time source of the busy/idle accounting (default: real time).
      mirror: called from the server thread with each wake-up's inbox commands and
        the weights version it installs (or None), before they are applied: a
        generation program over several hosts posts them to its other processes,
        which replay them on their own batchers (``runtime.fleet.gen_hosts``) so
        every process runs the same engine programs in the same order.

    Raises:
      ValueError: unknown partial_rollout; both or neither of stop_ids / eos_id.
    """

    def __init__(
        self,
        name: str,
        engine: LlamaEngine,
        params: Any,
        *,
        policy_version: PolicyVersion,
        stop_ids: Collection[int] | None = None,
        eos_id: int | None = None,
        partial_rollout: str,
        on_finished: Callable[[Sample], None],
        clock: Clock | None = None,
        mirror: Callable[[list[tuple[str, Any]], PolicyVersion | None], None] | None = None,
    ):
        if partial_rollout not in IN_FLIGHT_POLICIES:
            raise ValueError(
                f"GenerationServer {name!r}: partial_rollout must be one of "
                f"{IN_FLIGHT_POLICIES}, got {partial_rollout!r}"
            )
        self.name = name
        self.engine = engine
        self.partial_rollout = partial_rollout
        self._on_finished = on_finished
        self._clock = clock or RealClock()
        self._mirror = mirror
        self._batcher = SlotBatcher(
            engine, params, policy_version=policy_version, stop_ids=stop_ids, eos_id=eos_id
        )
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._pending_weights: tuple[Any, PolicyVersion] | None = None
        self._requested_version = int(policy_version)
        self._outstanding: set[RequestKey] = set()
        self._stopping = False
        self._error: BaseException | None = None
        self._counts = collections.Counter()  # submitted, delivered, aborted, weight_updates
        self._busy_s = 0.0
        self._idle_s = 0.0
        # Busy intervals (clock seconds) for the run's timeline, adjacent ones merged;
        # bounded so a reader that never takes them costs a fixed few KB.
        self._busy_spans: collections.deque[list[float]] = collections.deque(maxlen=_MAX_SPANS)
        self._thread = threading.Thread(target=self._loop, name=f"gen-{name}", daemon=True)

    # ------------------------------------------------------------- interface

    def start(self) -> None:
        """Start the server thread (once)."""
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> list[RequestKey]:
        """Stop the thread and join it; unfinished work is dropped, not delivered.

        Does not raise the loop's error (shutdown must work after a failure);
        call ``check()`` for that.

        Returns:
          Keys (prompt_id, sample_index) that were submitted but neither
          delivered nor aborted: the caller decides their fate (regenerate or
          count as failed).

        Raises:
          TimeoutError: the thread did not end within timeout_s (e.g. stuck in
            on_finished).
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"GenerationServer {self.name!r}: not stopped in {timeout_s}s")
        return self.outstanding()

    def submit(self, request: GenerationRequest) -> None:
        """Queue one sample; it starts at the server's next step with a free slot.

        Raises:
          ValueError: the engine cannot run it (``check_request``: too long,
            wrong sampling) or its key is already outstanding here. Raised in
            the caller's thread; the server is unaffected.
          GenerationServerError: the loop failed earlier; RuntimeError: stopped.
        """
        check_request(self.engine, request)
        key = (int(request.prompt_id), int(request.sample_index))
        with self._cond:
            self._raise_if_down()
            if key in self._outstanding:
                raise ValueError(f"GenerationServer {self.name!r}: request {key} already submitted")
            self._outstanding.add(key)
            self._counts["submitted"] += 1
            self._inbox.append(("submit", request))
            self._cond.notify_all()

    def abort_prompt(self, prompt_id: int) -> int:
        """Abort every outstanding (queued or running) sample of ``prompt_id``.

        Returns:
          How many samples were aborted; none of them reaches on_finished.
        """
        with self._cond:
            self._raise_if_down()
            keys = [k for k in self._outstanding if k[0] == int(prompt_id)]
            self._outstanding.difference_update(keys)
            self._counts["aborted"] += len(keys)
            if keys:
                self._inbox.append(("abort", keys))
                self._cond.notify_all()
            return len(keys)

    def update_weights(self, params: Any, version: PolicyVersion) -> None:
        """Use new weights from the next decode step on (non-blocking).

        Applied by the server thread between two steps with the
        ``partial_rollout`` policy. Updates not yet applied are superseded by a
        newer one (only the latest is installed).

        Args:
          params: model params, ideally already on the engine's mesh (from
            ``sync.publish``); others are placed there by the server thread.
          version: their policy version; must exceed every version given before.

        Raises:
          ValueError: version not above the last one given ("version 1 after 57").
          LayoutMismatchError (a ValueError): params whose tree, shapes or dtypes
            differ from the engine's model (``LlamaEngine.check_params``), refused
            here in the caller's thread rather than killing the server thread.
        """
        self.engine.check_params(params)
        with self._cond:
            self._raise_if_down()
            if version <= self._requested_version:
                raise ValueError(
                    f"GenerationServer {self.name!r}: version {version} after version "
                    f"{self._requested_version} (versions only go up)"
                )
            self._requested_version = int(version)
            self._pending_weights = (params, int(version))
            self._cond.notify_all()

    @property
    def load(self) -> int:
        """Outstanding samples (queued + running): for least-loaded dispatch."""
        with self._cond:
            return len(self._outstanding)

    @property
    def version(self) -> PolicyVersion:
        """Version of the weights the server generates with now (applied)."""
        return self._batcher.policy_version

    def outstanding(self) -> list[RequestKey]:
        """Keys submitted and neither delivered nor aborted, sorted."""
        with self._cond:
            return sorted(self._outstanding)

    def check(self) -> None:
        """Re-raise the loop's error, if any.

        Raises:
          GenerationServerError: from the original exception.
        """
        with self._cond:
            if self._error is not None:
                raise GenerationServerError(
                    f"GenerationServer {self.name!r} failed: {self._error!r}"
                ) from self._error

    def stats(self) -> dict[str, Any]:
        """Counters (cumulative, host-side) for metrics.

        Keys: name, version (applied), requested_version, queued_or_running
        (= load), occupancy (mean fraction of slots live per decode step),
        live_slot_steps / slot_steps (its numerator and denominator), busy_s /
        idle_s (clock seconds working / blocked with no work), steps,
        generated_tokens (including tokens later dropped by restarts), submitted,
        delivered, aborted, weight_updates (applied), wakeups (loop passes: one
        per decode step or command batch; flat while idle), restarted, recomputed,
        recompute_tokens, recompute_fallbacks. A paged engine adds its pool's
        kv_pages_in_use, kv_pages_peak (most in use at once) and kv_pages_total, and
        the slot loop's preempted, page_waits, shared_pages and copied_pages
        (``SlotStats``).

        Raises:
          GenerationServerError: the loop failed.
        """
        self.check()
        s, pool = self._batcher.stats, self._batcher.pages
        paged = {}
        if pool is not None:
            paged = {
                "kv_pages_in_use": pool.in_use,
                "kv_pages_peak": pool.peak_in_use,
                "kv_pages_total": pool.num_pages,
                "preempted": s.preempted,
                "page_waits": s.page_waits,
                "shared_pages": s.shared_pages,
                "copied_pages": s.copied_pages,
            }
        with self._cond:
            return {
                "name": self.name,
                "version": self._batcher.policy_version,
                "requested_version": self._requested_version,
                "queued_or_running": len(self._outstanding),
                "occupancy": s.occupancy,
                "live_slot_steps": s.live_slot_steps,
                "slot_steps": s.slot_steps,
                "busy_s": self._busy_s,
                "idle_s": self._idle_s,
                "steps": s.steps,
                "generated_tokens": s.generated_tokens,
                "submitted": self._counts["submitted"],
                "delivered": self._counts["delivered"],
                "aborted": self._counts["aborted"],
                "weight_updates": self._counts["weight_updates"],
                "wakeups": self._counts["wakeups"],
                "restarted": s.restarted,
                "recomputed": s.recomputed,
                "recompute_tokens": s.recompute_tokens,
                "recompute_fallbacks": s.recompute_fallbacks,
                **paged,
            }

    def __enter__(self) -> GenerationServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ the thread

    def _raise_if_down(self) -> None:
        """Under the lock: raise the loop's error, or if stopped."""
        if self._error is not None:
            raise GenerationServerError(
                f"GenerationServer {self.name!r} failed: {self._error!r}"
            ) from self._error
        if self._stopping:
            raise RuntimeError(f"GenerationServer {self.name!r} is stopped")

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    # Block while there is nothing to do (no busy-wait).
                    waited = self._clock.now()
                    while (
                        not self._stopping
                        and not self._inbox
                        and self._pending_weights is None
                        and self._batcher.idle
                    ):
                        self._cond.wait()
                    self._idle_s += self._clock.now() - waited
                    if self._stopping:
                        return
                    commands = list(self._inbox)
                    self._inbox.clear()
                    weights, self._pending_weights = self._pending_weights, None
                self._counts["wakeups"] += 1
                start = self._clock.now()
                if self._mirror is not None:
                    self._mirror(commands, None if weights is None else weights[1])
                finished = run_commands(self._batcher, commands, weights, self.partial_rollout)
                if weights is not None:
                    self._counts["weight_updates"] += 1
                self._deliver(finished)
                end = self._clock.now()
                self._busy_s += end - start
                self._record_busy(start, end)
        except BaseException as err:  # surfaced to callers by check() and every call
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _record_busy(self, start: float, end: float) -> None:
        with self._cond:
            spans = self._busy_spans
            if spans and start - spans[-1][1] <= _MERGE_GAP_S:
                spans[-1][1] = end  # the same busy stretch, one decode block later
            else:
                spans.append([start, end])

    def take_busy_spans(self) -> list[tuple[float, float]]:
        """The (start, end) clock times the server was busy since the last call (then cleared).

        Adjacent decode blocks (gaps <= 5 ms) form one span; at most the last 4096
        spans are kept. For the run's timeline (``<workdir>/timeline.jsonl``).
        """
        with self._cond:
            spans = [(float(a), float(b)) for a, b in self._busy_spans]
            self._busy_spans.clear()
            return spans

    def _abort_queued(self, key: RequestKey) -> bool:
        """Under the lock: an abort of ``key`` waits in the inbox."""
        return any(kind == "abort" and key in keys for kind, keys in self._inbox)

    def _deliver(self, finished: list[Sample]) -> None:
        for sample in finished:
            key = (sample.prompt_id, sample.sample_index)
            with self._cond:
                if key not in self._outstanding or self._abort_queued(key):
                    # Aborted after it finished on the device (a key aborted and
                    # submitted again is outstanding, but this is the old one).
                    continue
                self._outstanding.discard(key)
                self._counts["delivered"] += 1
            self._on_finished(sample)


def run_commands(
    batcher: SlotBatcher,
    commands: list[tuple[str, Any]],
    weights: tuple[Any, PolicyVersion] | None,
    partial_rollout: str,
) -> list[Sample]:
    """One wake-up of a server's loop: inbox commands in arrival order, then the latest
    weights, then a decode step unless idle; returns the samples that finished.

    Deterministic in its inputs and the engine's outputs, so the processes of a
    generation program over several hosts replay it in step (``runtime.fleet.gen_hosts``).
    """
    for kind, payload in commands:
        if kind == "submit":
            batcher.add(payload)
        else:  # abort: keys already taken out of _outstanding by abort_prompt
            for key in payload:
                if key in batcher:
                    batcher.abort(key)
    if weights is not None:
        params, version = weights
        batcher.set_params(params, version, in_flight=partial_rollout)
    return batcher.step() if not batcher.idle else []
