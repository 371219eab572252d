"""Host-side page allocator of a paged engine (``EngineConfig.kv_cache="paged"``).

The device holds one pool of N pages of P positions per layer
(``models.caches.paged_kv_cache``); ``PagePool`` decides which pages each slot reads and
writes: the page table int32 [B, M] that the slot loop sends with every
``start_samples`` and ``generate_block``. Pages are reference-counted:

- a sample takes pages as it grows: the slot loop maps, before each decode block,
  every page the block may write (``grow``), and returns them when the sample
  finishes, is aborted, restarted or preempted (``release``);
- the full pages of a prompt are shared: the first fresh sample of a prompt
  (under one set of params) registers them (``register_prefix``); later samples of
  that prompt map the same pages (``map_prefix``) instead of writing copies, so a
  prompt sampled n times holds its prompt once (per slot group). The partial last
  page is never shared: decoding writes into it. A prefix entry lives as long as one sample
  maps it.

Slot groups (``num_groups`` = G, ``EngineConfig.page_groups``): on a mesh the
device pool's pages and the slots split into G groups (``models.caches.paged_kv_cache``),
so slot b takes pages only from its group g = b // (B / G), ids [g N/G, (g+1) N/G),
and a prompt's pages are shared only within a group (a sample in another group
writes its own copy: ``copies``). With G = 1 nothing changes.

Page ids come from a free list per group, lowest first. ``num_free + pages in use ==
N`` at all times; ``check`` verifies the counts and the group ranges (tests call it).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np


class PagePool:
    """Page table and free lists of one paged engine's pool.

    Args:
      num_pages: N, pages in the pool.
      page_size: P, positions per page.
      num_slots: B, rows of the page table.
      pages_per_slot: M = ceil(S / P), entries per row.
      num_groups: G, slot groups (pages and slots split evenly between them).

    Attributes:
      table: int32 [B, M] page ids; N where a slot maps no page.
      peak_in_use: most pages in use at once.

    Raises:
      ValueError: G does not divide N or B (both numbers named).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_slots: int,
        pages_per_slot: int,
        num_groups: int = 1,
    ):
        self.num_pages, self.page_size, self.num_groups = int(num_pages), int(page_size), num_groups
        if num_groups < 1 or self.num_pages % num_groups or num_slots % num_groups:
            raise ValueError(
                f"PagePool: num_groups={num_groups} must divide num_pages={self.num_pages} "
                f"and num_slots={num_slots}"
            )
        self.pages_per_group = self.num_pages // num_groups
        self.slots_per_group = num_slots // num_groups
        self.table = np.full((num_slots, pages_per_slot), self.num_pages, np.int32)
        self._held = [0] * num_slots  # leading table entries mapped, per slot
        self._refs = np.zeros((self.num_pages,), np.int32)
        n = self.pages_per_group  # pop() -> lowest id of the group
        self._free = [list(range((g + 1) * n - 1, g * n - 1, -1)) for g in range(num_groups)]
        self._prefixes: dict[tuple[int, Hashable], list[int]] = {}  # (group, key) -> pages
        self._slot_prefix: list[Hashable | None] = [None] * num_slots
        self.peak_in_use = 0

    # ----------------------------------------------------------------- counts

    def group_of(self, slot: int) -> int:
        """The slot group of ``slot``: slot // (B / G)."""
        return slot // self.slots_per_group

    def group_slots(self, group: int) -> range:
        """Slots of group ``group``."""
        return range(group * self.slots_per_group, (group + 1) * self.slots_per_group)

    @property
    def num_free(self) -> int:
        """Free pages over all groups."""
        return sum(map(len, self._free))

    def free_in(self, group: int) -> int:
        """Free pages of group ``group``."""
        return len(self._free[group])

    @property
    def in_use(self) -> int:
        """Pages mapped by at least one slot."""
        return self.num_pages - self.num_free

    def held(self, slot: int) -> int:
        """Pages slot ``slot`` maps (shared ones included)."""
        return self._held[slot]

    def pages_for(self, positions: int) -> int:
        """Pages that hold positions [0, positions)."""
        return -(-max(int(positions), 0) // self.page_size)

    def shared_pages(self, key: Hashable | None, group: int = 0) -> int:
        """Pages of prompt prefix ``key`` registered in ``group`` (0 if none)."""
        return len(self._prefixes.get((group, key), ())) if key is not None else 0

    def copies(self, key: Hashable | None, group: int) -> int:
        """Pages of prefix ``key`` that another group holds and ``group`` does not:
        what a sample of it in ``group`` writes again."""
        if key is None or (group, key) in self._prefixes:
            return 0
        held = [len(p) for (g, k), p in self._prefixes.items() if k == key]
        return max(held, default=0)

    # -------------------------------------------------------------- mapping

    def grow(self, slot: int, positions: int) -> bool:
        """Map pages of the slot's group so that slot ``slot`` holds positions
        [0, positions).

        Returns:
          False, mapping nothing, if the group has too few free pages.

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
        free = self._free[self.group_of(slot)]
        if need > len(free):
            return False
        for i in range(self._held[slot], want):
            page = free.pop()
            self._refs[page] = 1
            self.table[slot, i] = page
        self._held[slot] = want
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return True

    def map_prefix(self, slot: int, key: Hashable | None) -> int:
        """Map the prompt pages ``key`` registered in the slot's group as slot ``slot``'s
        first pages.

        The slot must map nothing yet. Returns the pages mapped (0: no such prefix).
        """
        pages = self._prefixes.get((self.group_of(slot), key)) if key is not None else None
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
        written after its prefill) to later samples of the same prompt in its group."""
        group_key = (self.group_of(slot), key)
        if key is None or full_pages <= 0 or group_key in self._prefixes:
            return
        assert self._held[slot] >= full_pages, "register_prefix: pages not mapped"
        self._prefixes[group_key] = self.table[slot, :full_pages].tolist()
        self._slot_prefix[slot] = key

    def release(self, slot: int) -> None:
        """Unmap every page of slot ``slot``; pages no slot maps any more are free."""
        held, group = self._held[slot], self.group_of(slot)
        for page in self.table[slot, :held].tolist():
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[group].append(page)
        self.table[slot, :] = self.num_pages
        self._held[slot] = 0
        key, self._slot_prefix[slot] = self._slot_prefix[slot], None
        pages = self._prefixes.get((group, key)) if key is not None else None
        if pages and self._refs[pages[0]] == 0:
            del self._prefixes[(group, key)]  # no sample maps it any more

    def check(self) -> None:
        """Raise AssertionError if the counts disagree (free lists, refs, table) or a page
        lies outside its slot's or free list's group range."""
        mapped = np.zeros_like(self._refs)
        n = self.pages_per_group
        for slot, held in enumerate(self._held):
            row = self.table[slot, :held]
            np.add.at(mapped, row, 1)
            assert (self.table[slot, held:] == self.num_pages).all()
            assert (row // n == self.group_of(slot)).all(), f"slot {slot} maps another group's page"
        assert (mapped == self._refs).all(), "page refcounts differ from the table"
        free = [p for group in self._free for p in group]
        assert len(set(free)) == len(free), "a page is free twice"
        assert set(free) == set(np.flatnonzero(self._refs == 0).tolist()), "free list != unmapped"
        for g, group in enumerate(self._free):
            assert all(p // n == g for p in group), f"group {g}'s free list has another's page"
