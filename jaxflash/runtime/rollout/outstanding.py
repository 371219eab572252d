"""The table of outstanding samples: dispatched to a generation server, not yet back.

One row per (prompt_id, sample_index): the request, the server holding it, when it
was dispatched (clock seconds), the server's policy version at dispatch and how
many deadline retries it has had. The rollout scheduler asks it which samples are
late, how loaded each server is, and which version an in-flight prompt's group
will start at. Thread-free: the scheduler serialises access.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable

from jaxflash.types import GenerationRequest, PolicyVersion, RequestKey


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outstanding:
    """One dispatched sample.

    Attributes:
      request: what was submitted.
      server: index of the server holding it.
      dispatched_at: clock time of the submit, seconds.
      version: the server's applied policy version at dispatch.
      attempts: deadline misses so far (0 on the first try).
    """

    request: GenerationRequest
    server: int
    dispatched_at: float
    version: PolicyVersion
    attempts: int = 0

    @property
    def key(self) -> RequestKey:
        return (int(self.request.prompt_id), int(self.request.sample_index))


class OutstandingTable:
    """Outstanding samples by key, plus the start versions of a prompt's finished samples.

    Indexed by prompt, by server and by dispatch time, and the per-server load is
    kept as rows come and go, so every query costs what it returns, not the
    table's size (a pod-scale run holds (α+1)·B·G rows).
    """

    def __init__(self) -> None:
        self._rows: dict[RequestKey, Outstanding] = {}
        self._by_prompt: dict[int, dict[RequestKey, None]] = {}
        self._by_server: dict[int, dict[RequestKey, None]] = {}
        self._load: collections.Counter = collections.Counter()
        # (dispatched_at, key, add number) ascending; rows popped are skipped and pruned
        self._by_time: list[tuple[float, RequestKey, int]] = []
        self._added: dict[RequestKey, int] = {}  # key -> the add number of its live row
        self._adds = 0
        self._finished_start: dict[int, PolicyVersion] = {}  # prompt -> oldest finished start

    def add(self, entry: Outstanding) -> None:
        """Record a dispatched sample.

        Raises:
          ValueError: its key is already outstanding.
        """
        key = entry.key
        if key in self._rows:
            raise ValueError(f"sample {key} is already outstanding on server {entry.server}")
        self._rows[key] = entry
        self._by_prompt.setdefault(key[0], {})[key] = None
        self._by_server.setdefault(entry.server, {})[key] = None
        self._load[entry.server] += 1
        self._adds += 1
        self._added[key] = self._adds
        bisect.insort(self._by_time, (entry.dispatched_at, key, self._adds))  # appends in order

    def pop(self, key: RequestKey) -> Outstanding | None:
        """Remove and return a sample's row (None if it is not outstanding)."""
        entry = self._rows.pop(key, None)
        if entry is None:
            return None
        del self._added[key]
        for index, group in ((self._by_prompt, key[0]), (self._by_server, entry.server)):
            del index[group][key]
            if not index[group]:
                del index[group]
        self._load[entry.server] -= 1
        if not self._load[entry.server]:
            del self._load[entry.server]
        if len(self._by_time) > 2 * len(self._rows) + 64:  # prune popped rows
            self._by_time = [t for t in self._by_time if self._live(t)]
        return entry

    def _live(self, item: tuple[float, RequestKey, int]) -> bool:
        return self._added.get(item[1]) == item[2]

    def get(self, key: RequestKey) -> Outstanding | None:
        return self._rows.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def by_prompt(self, prompt_id: int) -> list[Outstanding]:
        """Rows of one prompt, by sample index."""
        keys = sorted(self._by_prompt.get(prompt_id, ()), key=lambda k: k[1])
        return [self._rows[k] for k in keys]

    def by_server(self, server: int) -> list[Outstanding]:
        """Rows held by one server, by key."""
        return [self._rows[k] for k in sorted(self._by_server.get(server, ()))]

    def prompts(self) -> list[int]:
        """Prompt ids with at least one outstanding sample, sorted."""
        return sorted(self._by_prompt)

    def _oldest(self) -> list[tuple[float, RequestKey, int]]:
        """The time index with popped rows dropped from its front."""
        t = self._by_time
        i = 0
        while i < len(t) and not self._live(t[i]):
            i += 1
        if i:
            del t[:i]
        return t

    def late(self, now: float, deadline_s: float) -> list[RequestKey]:
        """Keys dispatched more than ``deadline_s`` seconds before ``now``, oldest first."""
        out = []
        for item in self._oldest():
            if not now - item[0] > deadline_s:
                break
            if self._live(item):
                out.append(item[1])
        return out

    def next_deadline(self, deadline_s: float) -> float | None:
        """Clock time at which the oldest row becomes late (None when the table is empty)."""
        oldest = self._oldest()
        return oldest[0][0] + deadline_s if oldest else None

    def load(self) -> collections.Counter:
        """server index -> outstanding samples it holds (by this table's count)."""
        return collections.Counter(self._load)

    # -- start versions (ROLL Flash per-sample staleness, arXiv 2510.11345) ----------

    def note_finished(self, prompt_id: int, start_version: PolicyVersion) -> None:
        """A sample of ``prompt_id`` finished having started at ``start_version``."""
        old = self._finished_start.get(prompt_id, start_version)
        self._finished_start[prompt_id] = min(old, int(start_version))

    def forget(self, prompt_id: int) -> None:
        """Drop the finished-start record of a prompt (trained, dropped or regenerated)."""
        self._finished_start.pop(prompt_id, None)

    def start_estimate(self, prompt_id: int, restarts: Callable[[int], bool]) -> float:
        """The start version the prompt's group will have: the oldest of its samples'.

        Finished samples count with their own start version. An outstanding sample
        on a server that keeps in-flight samples across weight updates (partial
        rollout continue/recompute) keeps the start it gets when it first takes a
        slot: estimated as the server's version at dispatch -- exact when it got a
        slot before the server's next update, too old by the updates it spent
        queued otherwise (so it is aborted early, never kept too long). On a server
        where ``restarts(server)`` is True a sample still running at the next
        publish restarts at the new version, so it bounds nothing.

        Returns:
          The estimate, or ``inf`` when nothing bounds it.
        """
        start = float(self._finished_start.get(prompt_id, float("inf")))
        for e in self.by_prompt(prompt_id):
            if not restarts(e.server):
                start = min(start, float(e.version))
        return start
