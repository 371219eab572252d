"""Request identity, admission checks and counters of the slot loop.

``check_request`` validates a ``GenerationRequest`` against an engine;
``SlotStats`` are a ``SlotBatcher``'s cumulative counters. Split out of
``slot_loop`` (which re-exports them) to keep modules small.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from jaxflash.types import GenerationRequest, RequestKey

if TYPE_CHECKING:
    from jaxflash.generation.engine.llama_engine import LlamaEngine


SLOT_EVENT_HISTORY = 4096
"""Slot fills and releases a ``SlotStats`` keeps (the newest); they serve tests and
benchmarks that look at recent scheduling, never a whole run."""


def record_slot_event(events: list[tuple[int, int, RequestKey]], event: tuple) -> None:
    """Appends ``event``, dropping the oldest half once ``SLOT_EVENT_HISTORY`` is passed
    (amortised O(1); the list never holds more than ``SLOT_EVENT_HISTORY`` + 1)."""
    events.append(event)
    if len(events) > SLOT_EVENT_HISTORY:
        del events[: len(events) - SLOT_EVENT_HISTORY // 2]


IN_FLIGHT_POLICIES = ("continue", "restart", "recompute")
"""What running samples do at ``set_params`` (``config.rollout.partial_rollout``)."""


@dataclasses.dataclass(kw_only=True)
class SlotStats:
    """Counters of a batcher (host-side, cumulative).

    Attributes:
      steps: ``generate`` calls.
      prefills: prompt forward passes (``prefill`` / ``prefill_prompt`` calls).
      shared_prefills: samples started from a prefill run for another sample of
        the same prompt (prefix sharing); prefills + shared_prefills = fills.
      generated_tokens: response tokens produced (first tokens from prefill included).
      live_slot_steps: sum over steps of slots holding a running sample.
      slot_steps: steps * B.
      busy_s: wall-clock seconds spent inside ``step`` (prefill, insert, generate,
        host copies).
      slot_fills: (steps so far, slot, key) for each insert, in order: the last
        ``SLOT_EVENT_HISTORY`` of them (older events are dropped, so a server
        that runs for days holds a bounded list; ``fills`` counts them all).
      slot_releases: (steps so far, slot, key) whenever a running sample leaves
        its slot (finished or aborted), bounded like ``slot_fills``; a slot
        refilled at once has a fill with the same step count as its release.
      fills: inserts so far (every one, unlike the bounded ``slot_fills``).
      finished: samples returned, by finish reason.
      restarted: running samples sent back to the queue by
        ``set_params(..., in_flight="restart")``.
      recomputed: running samples re-prefilled by ``in_flight="recompute"``.
      recompute_tokens: tokens run through those re-prefills (prompt + prefix +
        nothing else: the cost of recompute in prefill tokens).
      recompute_fallbacks: samples that ``recompute`` restarted instead, because
        prompt + prefix exceeded max_prefill_length (their tokens are dropped,
        as under restart; not included in ``restarted``).
      page_waits: paged cache: fills at which a queued request waited for free
        pages while a slot was free.
      preempted: paged cache: running samples restarted (tokens dropped, back to
        the queue's front) because the pool had no page for their next block.
      shared_pages: paged cache: prompt pages mapped from another sample of the
        same prompt instead of written (prefix sharing without copies).
      copied_pages: paged cache on a mesh: prompt pages a sample wrote although
        another slot group held them (pages are shared within a group only).
    """

    steps: int = 0
    prefills: int = 0
    shared_prefills: int = 0
    generated_tokens: int = 0
    live_slot_steps: int = 0
    slot_steps: int = 0
    busy_s: float = 0.0
    slot_fills: list[tuple[int, int, RequestKey]] = dataclasses.field(default_factory=list)
    slot_releases: list[tuple[int, int, RequestKey]] = dataclasses.field(default_factory=list)
    fills: int = 0
    finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    restarted: int = 0
    recomputed: int = 0
    recompute_tokens: int = 0
    recompute_fallbacks: int = 0
    page_waits: int = 0
    preempted: int = 0
    shared_pages: int = 0
    copied_pages: int = 0

    @property
    def occupancy(self) -> float:
        """Mean fraction of slots holding a running sample during ``generate``."""
        return self.live_slot_steps / self.slot_steps if self.slot_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of ``step`` time."""
        return self.generated_tokens / self.busy_s if self.busy_s > 0 else 0.0


def resolve_stop_ids(stop_ids: Collection[int] | None, eos_id: int | None) -> frozenset[int]:
    """The stop set of a batcher: ``stop_ids``, or ``{eos_id}``; exactly one given.

    An id outside the vocabulary (e.g. -1) never matches, and an empty set
    never stops: samples run to ``max_new_tokens`` (benchmarks use that).

    Raises:
      ValueError: both or neither given, or an id that is not an int.
    """
    if (stop_ids is None) == (eos_id is None):
        raise ValueError("give exactly one of stop_ids= (a set of ids) or eos_id= (one id)")
    ids = [eos_id] if stop_ids is None else list(stop_ids)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int | np.integer)]
    if bad:
        raise ValueError(f"stop ids must be ints, got {bad}")
    return frozenset(int(i) for i in ids)


def check_request(engine: LlamaEngine, request: GenerationRequest) -> None:
    """Raise if ``engine`` cannot run ``request``; call before ``add`` to count failures.

    Raises:
      ValueError: naming (prompt_id, sample_index) and the reason: prompt not a
        non-empty 1-D int array, prompt longer than max_prefill_length, prompt +
        max_new_tokens over max_target_length, a paged engine whose pool (one
        slot group's pages) could never hold the sample, or sampling parameters
        different from the engine's (temperature / top_k / top_p are static per
        engine).
    """
    who = f"request (prompt_id={request.prompt_id}, sample_index={request.sample_index})"
    tokens = np.asarray(request.prompt_tokens)
    if tokens.ndim != 1 or tokens.shape[0] == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"{who}: prompt_tokens must be a non-empty 1-D int array, got "
            f"shape {tokens.shape} dtype {tokens.dtype}"
        )
    try:
        engine.prefiller.prefill_bucket(tokens.shape[0])
    except ValueError as err:
        raise ValueError(f"{who}: {err}") from None
    total = tokens.shape[0] + request.sampling.max_new_tokens
    if total > engine.max_target_length:
        raise ValueError(
            f"{who}: prompt ({tokens.shape[0]}) + max_new_tokens "
            f"({request.sampling.max_new_tokens}) = {total} exceeds "
            f"max_target_length={engine.max_target_length}"
        )
    c = engine.config
    if c.paged:  # worst case: no page shared, every position up to the last fed token
        need = -(-(total - 1) // c.page_size)
        if need > c.pages_per_group:
            where = f"the page pool holds {c.pool_pages}"
            if c.page_groups > 1:
                where += f", {c.pages_per_group} per slot group of {c.page_groups}"
            raise ValueError(
                f"{who}: prompt + max_new_tokens needs up to {need} pages of {c.page_size} "
                f"positions, {where} (raise rollout.num_pages)"
            )
    if not c.matches(request.sampling):
        raise ValueError(
            f"{who}: sampling (T={request.sampling.temperature}, top_k={request.sampling.top_k}, "
            f"top_p={request.sampling.top_p}) differs from the engine's (T={c.temperature}, "
            f"top_k={c.top_k}, top_p={c.top_p})"
        )
