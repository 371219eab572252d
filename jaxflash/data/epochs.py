"""File datasets read in shuffled epochs, as a pure function of (seed, epoch, cursor).

``EpochShuffledRows(rows, seed)`` is an infinite row source for
``PromptSource``: cursor ``i`` reads epoch ``e = i // n`` at position
``i % n`` of that epoch's permutation, ``rng([seed, e]).permutation(n)``
(numpy's PCG64 seeded by the pair). Nothing is stored between calls, so a
resumed run (same seed, saved cursor) reads exactly the rows the interrupted
run would have read next, every row appears once per epoch, and epochs differ.
``shuffle=False`` keeps file order (the same cursor arithmetic, identity
permutation).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np


class EpochShuffledRows:
    """Callable ``cursor -> row`` over ``rows``, reshuffled every epoch.

    Args:
      rows: the training rows (dicts or ``files.RowFailure``), non-empty.
      seed: the run's seed.
      shuffle: False reads the rows in file order every epoch.

    Raises:
      ValueError: empty ``rows``.
    """

    def __init__(self, rows: Sequence[Any], seed: int, *, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("EpochShuffledRows: no rows to read")
        self._rows = rows
        self.seed = int(seed)
        self.shuffle = bool(shuffle)

    def __len__(self) -> int:
        """Rows per epoch."""
        return len(self._rows)

    @functools.lru_cache(maxsize=2)  # the current epoch and the next (epoch boundaries)  # noqa: B019
    def permutation(self, epoch: int) -> np.ndarray:
        """int64 [n]: file index of each position of ``epoch``."""
        n = len(self._rows)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def index(self, cursor: int) -> int:
        """File index (0-based row of ``rows``) read at ``cursor``."""
        if cursor < 0:
            raise ValueError(f"EpochShuffledRows: cursor must be >= 0, got {cursor}")
        epoch, position = divmod(int(cursor), len(self._rows))
        return int(self.permutation(epoch)[position])

    def __call__(self, cursor: int) -> Any:
        return self._rows[self.index(cursor)]
