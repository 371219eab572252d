"""Host-side page allocator of a paged engine (``EngineConfig.kv_cache="paged"``).

The device holds one pool of N pages of P positions per layer
(``models.paged_kv_cache``); ``PagePool`` decides which pages each slot reads and
writes: the page table int32 [B, M] that the slot loop sends with every
``start_samples`` and ``generate_block``. Pages are reference-counted:

- a sample takes pages as it grows: the slot loop maps, before each decode block,
  every page the block may write (``grow``), and returns them when the sample
  finishes, is aborted, restarted or preempted (``release``);
- the full pages of a prompt are shared: the first fresh sample of a prompt
  (under one set of params) registers them (``register_prefix``); later samples of
  that prompt map the same pages (``map_prefix``) instead of writing copies, so a
  prompt replicated G times holds its prompt once. The partial last page is never
  shared: decoding writes into it. A prefix entry lives as long as one sample
  maps it.

Page ids come from a free list, lowest first. ``num_free + pages in use == N`` at
all times; ``check`` verifies the counts (tests call it).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np


class PagePool:
    """Page table and free list of one paged engine's pool.

    Args:
      num_pages: N, pages in the pool.
      page_size: P, positions per page.
      num_slots: B, rows of the page table.
      pages_per_slot: M = ceil(S / P), entries per row.

    Attributes:
      table: int32 [B, M] page ids; N where a slot maps no page.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int):
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.table = np.full((num_slots, pages_per_slot), self.num_pages, np.int32)
        self._held = [0] * num_slots  # leading table entries mapped, per slot
        self._refs = np.zeros((self.num_pages,), np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() -> lowest id
        self._prefixes: dict[Hashable, list[int]] = {}  # key -> shared full pages
        self._slot_prefix: list[Hashable | None] = [None] * num_slots
        self.peak_in_use = 0

    # ----------------------------------------------------------------- counts

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Pages mapped by at least one slot."""
        return self.num_pages - len(self._free)

    def held(self, slot: int) -> int:
        """Pages slot ``slot`` maps (shared ones included)."""
        return self._held[slot]

    def pages_for(self, positions: int) -> int:
        """Pages that hold positions [0, positions)."""
        return -(-max(int(positions), 0) // self.page_size)

    def shared_pages(self, key: Hashable | None) -> int:
        """Pages of a registered prompt prefix ``key`` (0 if none)."""
        return len(self._prefixes.get(key, ())) if key is not None else 0

    # -------------------------------------------------------------- mapping

    def grow(self, slot: int, positions: int) -> bool:
        """Map pages so that slot ``slot`` holds positions [0, positions).

        Returns:
          False, mapping nothing, if the pool has too few free pages.

        Raises:
          ValueError: positions beyond the slot's row (M * P).
        """
        want = self.pages_for(positions)
        if want > self.table.shape[1]:
            raise ValueError(
                f"PagePool.grow: {positions} positions need {want} pages, a slot maps at "
                f"most {self.table.shape[1]}"
            )
        need = want - self._held[slot]
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for i in range(self._held[slot], want):
            page = self._free.pop()
            self._refs[page] = 1
            self.table[slot, i] = page
        self._held[slot] = want
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return True

    def map_prefix(self, slot: int, key: Hashable | None) -> int:
        """Map the registered prompt pages ``key`` as slot ``slot``'s first pages.

        The slot must map nothing yet. Returns the pages mapped (0: no such prefix).
        """
        pages = self._prefixes.get(key) if key is not None else None
        if not pages:
            return 0
        assert self._held[slot] == 0, "map_prefix: the slot already maps pages"
        self.table[slot, : len(pages)] = pages
        self._refs[pages] += 1
        self._held[slot] = len(pages)
        self._slot_prefix[slot] = key
        return len(pages)

    def register_prefix(self, slot: int, key: Hashable | None, full_pages: int) -> None:
        """Offer slot ``slot``'s first ``full_pages`` pages (whole prompt pages, never
        written after its prefill) to later samples of the same prompt as ``key``."""
        if key is None or full_pages <= 0 or key in self._prefixes:
            return
        assert self._held[slot] >= full_pages, "register_prefix: pages not mapped"
        self._prefixes[key] = self.table[slot, :full_pages].tolist()
        self._slot_prefix[slot] = key

    def release(self, slot: int) -> None:
        """Unmap every page of slot ``slot``; pages no slot maps any more are free."""
        held = self._held[slot]
        for page in self.table[slot, :held].tolist():
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        self.table[slot, :] = self.num_pages
        self._held[slot] = 0
        key, self._slot_prefix[slot] = self._slot_prefix[slot], None
        pages = self._prefixes.get(key) if key is not None else None
        if pages and self._refs[pages[0]] == 0:
            del self._prefixes[key]  # no sample maps it any more

    def check(self) -> None:
        """Raise AssertionError if the counts disagree (free list, refs, table)."""
        mapped = np.zeros_like(self._refs)
        for slot, held in enumerate(self._held):
            np.add.at(mapped, self.table[slot, :held], 1)
            assert (self.table[slot, held:] == self.num_pages).all()
        assert (mapped == self._refs).all(), "page refcounts differ from the table"
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert free == set(np.flatnonzero(self._refs == 0).tolist()), "free list != unmapped"
