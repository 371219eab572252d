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

Restart semantics (for the rollout scheduler; "Restart means restart"). When a
sample in flight is stopped (stale, weights changed) and generated again:

* partial rollout OFF -> `restart_sample(s, v, partial=False)` keeps NO tokens: the
  regenerated response is produced entirely at version v, its token_versions read
  [v, v, ...] and its start version is v. Nothing of the old attempt is trained on.
* partial rollout ON -> `restart_sample(s, v, partial=True)` keeps the old tokens,
  their behaviour logprobs and their version stamps; the continuation is stamped v.
  Aborted at version 2 with 2 tokens and continued at 3, the stamps read
  [2, 2, 3, ...] and the start version stays 2, so the staleness gate still sees
  the old prefix. `off_policy_tokens(token_versions, v)` marks the version-2 tokens
  as off-policy (their behaviour logprobs came from older weights; the loss must
  importance-weight them with the recorded behaviour logprobs, never assume
  behaviour == current policy).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from jaxflash.types import FinishReason, PolicyVersion, Sample

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


def off_policy_tokens(token_versions_t: np.ndarray, version: PolicyVersion) -> np.ndarray:
    """bool [T]: True where a token was sampled by weights older than `version`."""
    tv = np.asarray(token_versions_t)
    if tv.ndim != 1 or not np.issubdtype(tv.dtype, np.integer):
        raise ValueError(
            f"token_versions_t must be a 1-D int array, got shape {tv.shape} dtype {tv.dtype}"
        )
    return tv < int(version)


def restart_sample(sample: Sample, new_version: PolicyVersion, *, partial: bool) -> Sample:
    """The in-flight state of `sample` when it is resumed/regenerated at `new_version`.

    Args:
      sample: the stopped sample (typically finish_reason ABORTED).
      new_version: version of the weights that will generate from now on; must be
        >= every version already in the sample (versions only go up).
      partial: True keeps the generated prefix (tokens, behaviour logprobs, version
        stamps, start version); False discards it and restarts at `new_version`.

    Returns:
      a new Sample, finish_reason ABORTED (still to be continued), reward unset.
      Append the continuation with `extend_sample(..., version=new_version)`.

    Raises:
      ValueError: `new_version` is older than the sample's newest token or start.
    """
    new_version = _check_nonneg_int("new_version", new_version)
    newest = int(sample.start_version)
    tv = np.asarray(sample.token_versions)
    if tv.size:
        newest = max(newest, int(tv.max()))
    if new_version < newest:
        raise ValueError(
            f"restart of prompt {sample.prompt_id}/{sample.sample_index} at version "
            f"{new_version} is older than its newest version {newest}"
        )
    if partial and tv.size:
        keep = dict(
            response_tokens=np.asarray(sample.response_tokens, np.int32).copy(),
            behaviour_logprobs=np.asarray(sample.behaviour_logprobs, np.float32).copy(),
            token_versions=tv.astype(np.int32).copy(),
            start_version=start_version_of(sample),
        )
    else:  # partial off, or nothing generated yet: nothing old survives
        keep = dict(
            response_tokens=np.zeros((0,), np.int32),
            behaviour_logprobs=np.zeros((0,), np.float32),
            token_versions=np.zeros((0,), np.int32),
            start_version=new_version,
        )
    return Sample(
        prompt_id=sample.prompt_id,
        sample_index=sample.sample_index,
        prompt_tokens=np.asarray(sample.prompt_tokens, np.int32).copy(),
        finish_reason=FinishReason.ABORTED,
        **keep,
    )


def extend_sample(
    sample: Sample,
    tokens_t: np.ndarray,
    logprobs_t: np.ndarray,
    *,
    version: PolicyVersion,
    finish_reason: FinishReason,
) -> Sample:
    """Append tokens sampled at `version` to `sample` (pure: returns a new Sample).

    Args:
      sample: the sample to continue (e.g. from `restart_sample`).
      tokens_t: int [T_new] new response tokens.
      logprobs_t: float [T_new] their behaviour logprobs under the weights of `version`.
      version: version that sampled every new token.
      finish_reason: why the sample stopped now.

    Raises:
      ValueError: lengths differ, or `version` is older than a token already present.
    """
    version = _check_nonneg_int("version", version)
    tokens_t = np.asarray(tokens_t, np.int32).reshape(-1)
    logprobs_t = np.asarray(logprobs_t, np.float32).reshape(-1)
    if tokens_t.shape != logprobs_t.shape:
        raise ValueError(
            f"tokens_t has {tokens_t.size} entries but logprobs_t has {logprobs_t.size}"
        )
    tv = np.asarray(sample.token_versions, np.int32)
    if tv.size and version < int(tv.max()):
        raise ValueError(f"extend at version {version} is older than existing token {tv.max()}")
    return dataclasses.replace(
        sample,
        response_tokens=np.concatenate([np.asarray(sample.response_tokens, np.int32), tokens_t]),
        behaviour_logprobs=np.concatenate(
            [np.asarray(sample.behaviour_logprobs, np.float32), logprobs_t]
        ),
        token_versions=np.concatenate([tv, np.full(tokens_t.shape, version, np.int32)]),
        finish_reason=FinishReason(finish_reason),
        reward=None,
        reward_info={},
    )
