"""The rollout's books as a run keeps them: counters that add up across restarts, and
the snapshot of the books a checkpoint of a step saves.

Every counter of a run is the checkpoint's (``restored``) plus what each part counted
since it was built: the books' own (``count``: resumes, skipped steps) and each part's
``counts()`` (the dispatcher's and the assembler's, read when asked). ``snapshot`` takes
the ledger, the counters, the source's cursor and the group buffer under the
scheduler's lock, so a checkpoint's books agree with each other; ``close_step`` keeps
the one a checkpoint of the step just ended saves (``step_books``). What the scheduler
is built from (source, ledger, buffer, the checkpoint's counters) is
``rollout.settings.RolloutBooks``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple


class BooksSnapshot(NamedTuple):
    """What ``Books.snapshot`` takes under one lock (a checkpoint's books).

    Attributes:
      ledger: ``PromptLedger.state_dict()`` (its in-flight prompts are generated again).
      counters: the run's prompts_* / samples_* / steps_* counters.
      cursor: the data source's cursor.
      buffer: ``GroupBuffer.state_dict()`` (the buffer_* counters).
    """

    ledger: dict[str, Any]
    counters: dict[str, int]
    cursor: int
    buffer: dict[str, int]


class Books:
    """The rollout's prompt books (what the step hooks, the loop and checkpoints read).

    Args:
      ledger: the ``PromptLedger`` (outcomes, prompts open).
      buffer: the ``GroupBuffer``.
      source: the prompt source (its ``cursor``).
      restored: the checkpoint's counters (they keep adding up).
      parts: each part's ``counts()`` (dispatcher, assembler): what it counted since.
      lock: the scheduler's lock (the parts are read under it).
    """

    def __init__(
        self,
        *,
        ledger: Any,
        buffer: Any,
        source: Any,
        restored: Mapping[str, int],
        parts: Sequence[Callable[[], Mapping[str, int]]],
        lock: threading.RLock,
    ) -> None:
        self._ledger, self._buffer, self._source = ledger, buffer, source
        self._restored = {k: int(v) for k, v in restored.items()}
        self._own: collections.Counter = collections.Counter()
        self._parts, self._lock = tuple(parts), lock
        self._step: BooksSnapshot | None = None

    def count(self, *names: str, n: int = 1) -> None:
        """Adds ``n`` to each of the books' own counters ``names`` (0 still lists it)."""
        with self._lock:
            for name in names:
                self._own[name] += n

    def counters(self) -> collections.Counter:
        """Every counter of the run: the checkpoint's plus each part's since (a copy)."""
        with self._lock:
            out = collections.Counter(self._restored)
            for part in (self._own, *(counts() for counts in self._parts)):
                out.update(part)
            return out

    def snapshot(self) -> BooksSnapshot:
        """The books, consistent with each other, for a checkpoint."""
        with self._lock:
            counts = {k: int(v) for k, v in sorted(self.counters().items())}
            return BooksSnapshot(
                self._ledger.state_dict(),
                counts,
                int(self._source.cursor),
                self._buffer.state_dict(),
            )

    def close_step(self) -> None:
        """Keeps the snapshot a checkpoint of the step just ended saves (``step_books``)."""
        self._step = self.snapshot()

    @property
    def step_books(self) -> BooksSnapshot | None:
        """The ``BooksSnapshot`` taken at the last ``close_step`` (None before)."""
        return self._step

    @property
    def outcomes(self) -> dict[str, Any]:
        """The ledger's outcome -> reason -> count (live)."""
        return self._ledger.outcomes

    @property
    def open_ids(self) -> Any:
        """Prompts admitted and not closed (at start: the checkpoint's in flight, generated
        again)."""
        return self._ledger.open_ids

    def ledger_metrics(self) -> dict[str, Any]:
        """The ledger's prompts_* figures."""
        with self._lock:
            return self._ledger.metrics()
