"""The group buffer's books: what was produced, returned and dropped, and why.

``GroupBuffer`` (``replay.group_buffer``) keeps one ``BufferBooks`` under its lock and
records every group that enters and leaves it here, so that at any time

    produced == returned + dropped + pending

(``pending``: groups the buffer holds now; ``counts``). The books also count the
staleness verdicts of the groups that left, the groups returned older than α under
``stale_policy="pace"`` (``overshoot``) and the samples discarded because their prompt
had already been reported (``late_discarded``). They go into a checkpoint
(``state_dict``) and come back from it (``from_state``), checked to add up. Host-side
plain integers; not thread-safe by themselves (the buffer's lock guards them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxflash.replay.staleness import StalenessCounts, Verdict

_VERDICTS = ("fresh", "stale", "anomaly")


@dataclasses.dataclass
class BufferBooks:
    """Cumulative counters of a group buffer (groups, except ``late_discarded``).

    Attributes:
      produced: groups opened (a prompt's first sample or failure; a regenerated
        prompt's new group counts again).
      returned: groups handed out for training.
      dropped: groups dropped, by reason ("stale", "failed", a filter reason, ...).
      late_discarded: samples (or failures) of a prompt already reported, discarded.
      staleness: fresh / stale / anomaly verdicts of groups that left.
      overshoot: groups returned older than α (policy "pace").
    """

    produced: int = 0
    returned: int = 0
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    late_discarded: int = 0
    staleness: StalenessCounts = dataclasses.field(default_factory=StalenessCounts)
    overshoot: int = 0

    def drop(self, reason: str) -> None:
        """One group dropped with ``reason``."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def judge(self, verdict: Verdict) -> None:
        """One group left with this staleness verdict."""
        self.staleness = self.staleness.plus(verdict)

    def counts(self, pending: int) -> dict[str, int]:
        """The counters, ``pending`` being the groups held now (``GroupBuffer.counts``)."""
        out = {
            "produced": self.produced,
            "returned": self.returned,
            "dropped": sum(self.dropped.values()),
            "pending": pending,
            "samples_late_discarded": self.late_discarded,
            **{f"staleness_{k}": getattr(self.staleness, k) for k in _VERDICTS},
            "staleness_overshoot": self.overshoot,
        }
        out.update({f"dropped_{k}": v for k, v in sorted(self.dropped.items())})
        return out

    def state_dict(self, pending: int) -> dict[str, int]:
        """The counters for a checkpoint.

        The ``pending`` groups are left out of ``produced``: a resumed run generates
        their prompts again (the ledger's in-flight prompts) and counts them produced
        then, so the identity holds on resume with none pending.
        """
        return {
            "produced": self.produced - pending,
            "returned": self.returned,
            "samples_late_discarded": self.late_discarded,
            **{f"staleness_{k}": getattr(self.staleness, k) for k in _VERDICTS},
            "staleness_overshoot": self.overshoot,
            **{f"dropped_{k}": v for k, v in sorted(self.dropped.items())},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, int]) -> BufferBooks:
        """The books a ``state_dict`` describes.

        Raises:
          ValueError: not a ``state_dict()`` (a key missing or unknown), or its books
            do not add up (produced != returned + dropped).
        """
        rest = dict(state)
        try:
            books = cls(
                produced=int(rest.pop("produced")),
                returned=int(rest.pop("returned")),
                late_discarded=int(rest.pop("samples_late_discarded")),
                staleness=StalenessCounts(
                    **{k: int(rest.pop(f"staleness_{k}")) for k in _VERDICTS}
                ),
                overshoot=int(rest.pop("staleness_overshoot", 0)),  # absent before "pace"
            )
        except KeyError as err:
            raise ValueError(f"GroupBuffer: not a state_dict() (no {err}): {dict(state)}") from None
        books.dropped = {k.removeprefix("dropped_"): int(v) for k, v in rest.items()}
        if any(not k.startswith("dropped_") for k in rest) or books.produced != (
            books.returned + sum(books.dropped.values())
        ):
            raise ValueError(
                f"GroupBuffer: not a state_dict() (or its books do not add up): {dict(state)}"
            )
        return books
