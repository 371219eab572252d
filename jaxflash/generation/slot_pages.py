"""The slot loop's page policy over a paged engine's ``PagePool``.

``SlotPages`` decides, for ``slot_loop.SlotBatcher``, when a request may start and
which running sample gives its pages back:

- admission: a request starts when the pool has the pages of its prefilled
  sequence and of its first decode block (its prompt's full pages are mapped from
  an earlier sample of the same prompt under the same params when there is one);
  otherwise it waits at the head of the queue (FIFO: nothing overtakes it);
- growth: before every block, each running sample maps the pages the block may
  write, oldest first; when the pool has run out, the newest running sample is
  preempted (its pages return at once, it restarts from the queue's front), and
  admissions pause until a sample ends, so the preempted sample is not re-admitted
  into the pages it just gave back.

A sample feeds at most prompt + max_new_tokens - 1 positions (its last token is
never fed), so it never maps more pages than that; ``check_request`` refuses a
request whose worst case exceeds the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.page_pool import PagePool
from jaxflash.types import GenerationRequest


class SlotPages:
    """Admission and growth of samples in a paged engine's pool.

    Args:
      config: the engine's ``EngineConfig`` (``kv_cache="paged"``).
      decode_block: decode steps per block of the batcher.

    Attributes:
      pool: the ``PagePool`` (its ``table`` goes with every dispatch).
      epoch: params generation; shared prompt pages are keyed by it (``new_params``).
    """

    def __init__(self, config: EngineConfig, decode_block: int):
        self.pool = PagePool(
            config.pool_pages, config.page_size, config.max_concurrent_decodes,
            config.pages_per_slot,
        )  # fmt: skip
        self.decode_block = int(decode_block)
        self.epoch = 0
        self._hold = False  # set by a preemption, cleared when a sample ends

    def new_params(self) -> None:
        """Pages computed under older params are never shared with new samples."""
        self.epoch += 1

    def sample_ended(self) -> None:
        """A sample finished or was aborted: its pages are back, admissions resume."""
        self._hold = False

    def cover(self, request: GenerationRequest, next_feed: int) -> int:
        """Positions to map for the next block: through the block's last fed token
        (``next_feed`` = position of the next token fed), at most the last position
        the sample can feed (prompt + max_new_tokens - 1), at least ``next_feed``."""
        cap = len(request.prompt_tokens) + request.sampling.max_new_tokens - 1
        return max(next_feed, min(next_feed + self.decode_block, cap))

    def admit(
        self, slot: int, request: GenerationRequest, generated: int, *, share: bool, running: int
    ) -> int | None:
        """Map the pages a request needs to start in ``slot``.

        Args:
          generated: tokens it already holds (a recompute re-prefills them).
          share: it may map (and register) its prompt's shared full pages.
          running: samples running now (a paused admission waits only for them).

        Returns:
          Pages mapped from a shared prompt (the ``SampleStart.shared_pages``), or
          None if it has to wait (nothing mapped).
        """
        if self._hold and running:
            return None
        prompt = np.asarray(request.prompt_tokens, np.int32)
        key = (self.epoch, prompt.tobytes()) if share and not generated else None
        cover = self.cover(request, prompt.shape[0] + generated)
        pool = self.pool
        if pool.pages_for(cover) - pool.shared_pages(key) > pool.num_free:
            return None
        mapped = pool.map_prefix(slot, key)
        if not pool.grow(slot, cover):
            raise AssertionError("PagePool: pages counted free could not be mapped")
        pool.register_prefix(slot, key, prompt.shape[0] // pool.page_size)
        return mapped

    def grow(self, running: Sequence[tuple[int, int, GenerationRequest, int]]) -> list[int]:
        """Map every page the next block may write, oldest sample first.

        Args:
          running: (slot, admission order, request, tokens so far) per running sample.

        Returns:
          Slots to preempt (their pages are already released), newest first.
        """
        by_age = sorted(running, key=lambda r: r[1])
        alive = [r[0] for r in by_age]
        victims: list[int] = []
        for slot, _, request, tokens in by_age:
            if slot not in alive:
                continue
            next_feed = len(request.prompt_tokens) + tokens - 1
            while not self.pool.grow(slot, self.cover(request, next_feed)):
                victim = alive.pop()  # the newest still running
                self.pool.release(victim)
                victims.append(victim)
                if victim == slot:
                    break
        if victims:
            self._hold = True
        return victims
