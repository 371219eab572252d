"""The slot loop's page policy: ``SlotPages`` over a paged engine's ``PagePool``,
``DensePages`` (the same face, nothing to map) over a dense cache.

``slot_pages(config, decode_block)`` picks the one for the engine's cache, so the slot
loop calls admit / grow / release / new_params / table without asking which it has.

``SlotPages`` decides, for ``slot_loop.SlotBatcher``, when a request may start,
in which slot, and which running sample gives its pages back. Pages and slots
split into slot groups (``EngineConfig.page_groups``, one on a single device): a
slot takes pages of its own group only, so every decision is per group.

- admission: the request at the head of the queue starts in a free slot whose group
  has the pages of its prefilled sequence and of its first decode block (its
  prompt's full pages are mapped from an earlier sample of the same prompt in that
  group under the same params when there is one). Free slots are tried in the
  groups that hold the prompt's pages first (sharing), then by most free pages,
  lowest slot first. If no group can take it now it waits at the head of the queue
  (FIFO: nothing overtakes it);
- growth: before every block, each running sample maps the pages the block may
  write, oldest first; when its group has run out, the newest running sample of
  that group is preempted (its pages return at once, it restarts from the queue's
  front), and admissions into that group pause until one of its samples ends, so
  the preempted sample is not re-admitted into the pages it just gave back.

A sample feeds at most prompt + max_new_tokens - 1 positions (its last token is
never fed), so it never maps more pages than that; ``check_request`` refuses a
request whose worst case exceeds a group's pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.page_pool import PagePool
from jaxflash.types import GenerationRequest


@dataclasses.dataclass(frozen=True)
class PageAdmission:
    """Where a request starts (``SlotPages.admit``).

    Attributes:
      slot: the free slot it takes.
      shared_pages: leading pages mapped from a shared prompt (``SampleStart.shared_pages``).
      copied_pages: prompt pages it writes although another slot group holds them.
    """

    slot: int
    shared_pages: int
    copied_pages: int


class SlotPages:
    """PageAdmission and growth of samples in a paged engine's pool.

    Args:
      config: the engine's ``EngineConfig`` (``kv_cache="paged"``, resolved by the
        engine: ``page_groups`` set).
      decode_block: decode steps per block of the batcher.

    Attributes:
      pool: the ``PagePool`` (its ``table`` goes with every dispatch).
      epoch: params generation; shared prompt pages are keyed by it (``new_params``).
    """

    def __init__(self, config: EngineConfig, decode_block: int):
        self.pool = PagePool(
            config.pool_pages, config.page_size, config.max_concurrent_decodes,
            config.pages_per_slot, config.page_groups,
        )  # fmt: skip
        self.decode_block = int(decode_block)
        self.epoch = 0
        self._hold = [False] * config.page_groups  # set by a preemption in the group

    @property
    def table(self) -> np.ndarray:
        """int32 [B, M]: the page table every dispatch takes (``PagePool.table``)."""
        return self.pool.table

    def new_params(self) -> None:
        """Pages computed under older params are never shared with new samples."""
        self.epoch += 1

    def release(self, slot: int) -> None:
        """Return slot ``slot``'s pages (its sample ended, was aborted or requeued); a
        group paused by a preemption admits again once one of its samples ends."""
        if self.pool.held(slot):
            self._hold[self.pool.group_of(slot)] = False
        self.pool.release(slot)

    def cover(self, request: GenerationRequest, next_feed: int) -> int:
        """Positions to map for the next block: through the block's last fed token
        (``next_feed`` = position of the next token fed), at most the last position
        the sample can feed (prompt + max_new_tokens - 1), at least ``next_feed``."""
        cap = len(request.prompt_tokens) + request.sampling.max_new_tokens - 1
        return max(next_feed, min(next_feed + self.decode_block, cap))

    def _open(self, group: int) -> bool:
        """Whether ``group`` admits: not paused, or paused with nothing running in it."""
        pool = self.pool
        return not self._hold[group] or not any(pool.held(s) for s in pool.group_slots(group))

    def admit(
        self, free: Sequence[int], request: GenerationRequest, generated: int, *, share: bool
    ) -> PageAdmission | None:
        """Pick one of the ``free`` slots for a request and map the pages it needs to start.

        Args:
          free: free slots, ascending.
          generated: tokens it already holds (a recompute re-prefills them).
          share: it may map (and register) its prompt's shared full pages.

        Returns:
          The ``PageAdmission``, or None if it has to wait (nothing mapped).
        """
        prompt = np.asarray(request.prompt_tokens, np.int32)
        key = (self.epoch, prompt.tobytes()) if share and not generated else None
        pool = self.pool
        need = pool.pages_for(self.cover(request, prompt.shape[0] + generated))

        def rank(slot):  # groups holding the prompt first, then the emptiest, lowest slot
            group = pool.group_of(slot)
            return -pool.shared_pages(key, group), -pool.free_in(group), slot

        for slot in sorted(free, key=rank):
            group = pool.group_of(slot)
            if not self._open(group) or need - pool.shared_pages(key, group) > pool.free_in(group):
                continue
            copied = pool.copies(key, group)
            mapped = pool.map_prefix(slot, key)
            if not pool.grow(slot, self.cover(request, prompt.shape[0] + generated)):
                raise AssertionError("PagePool: pages counted free could not be mapped")
            pool.register_prefix(slot, key, prompt.shape[0] // pool.page_size)
            return PageAdmission(slot, mapped, copied)
        return None

    def grow(self, running: Sequence[tuple[int, int, GenerationRequest, int]]) -> list[int]:
        """Map every page the next block may write, oldest sample first.

        Args:
          running: (slot, admission order, request, tokens so far) per running sample.

        Returns:
          Slots to preempt (their pages are already released), newest first per group.
        """
        by_age = sorted(running, key=lambda r: r[1])
        alive = [r[0] for r in by_age]
        victims: list[int] = []
        for slot, _, request, tokens in by_age:
            if slot not in alive:
                continue
            group = self.pool.group_of(slot)
            next_feed = len(request.prompt_tokens) + tokens - 1
            while not self.pool.grow(slot, self.cover(request, next_feed)):
                # The newest still running in this group (only its pages help).
                victim = next(s for s in reversed(alive) if self.pool.group_of(s) == group)
                alive.remove(victim)
                self.pool.release(victim)
                victims.append(victim)
                self._hold[group] = True
                if victim == slot:
                    break
        return victims


class DensePages:
    """The page policy of a dense cache: every slot already holds S positions.

    A request starts in the lowest free slot (never waits), nothing grows or is
    preempted, and there is no pool or page table (``SlotPages``' face, doing nothing).
    """

    pool = None  # no PagePool
    table = None  # the engine's programs take no page table

    def new_params(self) -> None:
        """Nothing is shared across params."""

    def release(self, slot: int) -> None:
        """Nothing to return."""
        del slot

    def admit(
        self, free: Sequence[int], request: GenerationRequest, generated: int, *, share: bool
    ) -> PageAdmission:
        """The lowest free slot, no pages shared or copied."""
        del request, generated, share
        return PageAdmission(slot=free[0], shared_pages=0, copied_pages=0)

    def grow(self, running: Sequence[tuple[int, int, GenerationRequest, int]]) -> list[int]:
        """No sample is ever preempted."""
        del running
        return []


def slot_pages(config: EngineConfig, decode_block: int) -> SlotPages | DensePages:
    """The page policy for the engine's cache (``config.kv_cache``): ``SlotPages`` over a
    paged pool, ``DensePages`` over a dense cache."""
    return SlotPages(config, decode_block) if config.paged else DensePages()
