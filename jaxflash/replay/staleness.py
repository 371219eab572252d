"""Per-sample staleness and the async-ratio gate (pure functions, host numpy).

Definitions (ROLL Flash, arXiv 2510.11345, the per-sample async ratio alpha):

    start version s  = the OLDEST policy version among a sample's tokens (and its
                       recorded `start_version`, whichever is older)
    staleness        = learner_version - s
    fresh            <=>  0 <= staleness <= async_ratio

* Measured from the START, not the end: a sample whose tokens span versions {3, 4}
  has s = 3. With async_ratio k = 0 it is rejected at learner version 4; {4} is
  accepted. With k = 1, {3, 4} is accepted and {3, 4, 5} is rejected at learner 5.
* Queue time counts: the gate runs when the sample is about to be TRAINED, with the
  learner version of that step. A sample finished at version 4 but trained at 6
  has staleness 2 and is rejected with k = 1.
* A negative staleness means a sample claims weights newer than the learner has
  published -- a bug (versions went backwards, or a stamp is wrong). It is never
  fresh: `classify` returns ANOMALY, which callers treat as stale and count apart.

Restart semantics ("Restart means restart") live where samples are generated:
``generation.slot_loop.SlotBatcher.set_params(in_flight=...)`` restarts a running
sample with no old tokens ("restart"), or keeps its prefix with the prefix's own
version stamps ("continue" / "recompute"), so its start version -- and this gate
-- still sees the older prefix, and the learner treats those tokens as off-policy.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from jaxflash.types import PolicyVersion, Sample

VersionsLike = int | np.integer | Sequence[int] | np.ndarray | Sample


class Verdict(enum.StrEnum):
    """Outcome of the staleness gate for one sample or group."""

    FRESH = "fresh"  # 0 <= staleness <= async_ratio: may be trained on
    STALE = "stale"  # staleness > async_ratio: drop or regenerate
    ANOMALY = "anomaly"  # staleness < 0: newer than the learner (a bug); treated as stale


def _check_nonneg_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def start_version_of(versions: VersionsLike) -> PolicyVersion:
    """The version a sample started at: the oldest among its token stamps.

    Args:
      versions: a start version (int); the per-token versions of a sample (int
        sequence or int array [T_resp], non-empty); or a `Sample`, for which the
        older of `start_version` and min(token_versions) is used (so an
        inconsistent stamp can only make a sample look older, never fresher).

    Returns:
      int start version (may be negative only if the input is).

    Raises:
      ValueError: an empty version list (no tokens and no start version).
      TypeError: versions are not integers.
    """
    if isinstance(versions, Sample):
        start = int(versions.start_version)
        tv = np.asarray(versions.token_versions)
        if tv.size:
            start = min(start, _min_version("Sample.token_versions", tv))
        return start
    if isinstance(versions, bool):
        raise TypeError(f"versions must be ints, got {versions!r}")
    if isinstance(versions, int | np.integer):
        return int(versions)
    return _min_version("versions", np.asarray(versions))


def _min_version(name: str, arr: np.ndarray) -> int:
    if arr.size == 0:
        raise ValueError(f"{name} is empty: a sample with no tokens needs a start version")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    return int(arr.min())


def staleness(versions: VersionsLike, learner_version: PolicyVersion) -> int:
    """learner_version - start version (see module docstring).

    Args:
      versions: start version, token versions [T_resp], or a Sample.
      learner_version: the version of the learner step that would train on it.

    Returns:
      int staleness in policy versions. Negative means the sample is newer than
      the learner (a bug); use `classify`/`is_fresh`, which never call that fresh.
    """
    learner_version = _check_nonneg_int("learner_version", learner_version)
    return learner_version - start_version_of(versions)


def classify(versions: VersionsLike, learner_version: PolicyVersion, async_ratio: int) -> Verdict:
    """FRESH if 0 <= staleness <= async_ratio, STALE if larger, ANOMALY if negative.

    Args:
      versions: start version, token versions [T_resp], or a Sample.
      learner_version: version of the learner step that would train on it.
      async_ratio: alpha >= 0, the largest staleness allowed (0 = synchronous).

    Raises:
      ValueError / TypeError: async_ratio or learner_version not a non-negative int.
    """
    async_ratio = _check_nonneg_int("async_ratio", async_ratio)
    s = staleness(versions, learner_version)
    if s < 0:
        return Verdict.ANOMALY
    return Verdict.FRESH if s <= async_ratio else Verdict.STALE


def is_fresh(versions: VersionsLike, learner_version: PolicyVersion, async_ratio: int) -> bool:
    """True iff `classify(...)` is FRESH (a negative staleness is never fresh)."""
    return classify(versions, learner_version, async_ratio) is Verdict.FRESH


@dataclasses.dataclass(frozen=True, kw_only=True)
class StalenessCounts:
    """How many samples/groups the gate judged fresh, stale and anomalous.

    Immutable: `plus` returns an updated copy, so a snapshot can be logged safely.
    """

    fresh: int = 0
    stale: int = 0
    anomaly: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_nonneg_int(f"StalenessCounts.{f.name}", getattr(self, f.name))

    def plus(self, verdict: Verdict, n: int = 1) -> StalenessCounts:
        field = Verdict(verdict).value
        return dataclasses.replace(self, **{field: getattr(self, field) + n})

    @property
    def total(self) -> int:
        return self.fresh + self.stale + self.anomaly
