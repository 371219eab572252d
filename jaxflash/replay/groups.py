"""What a GRPO group is and how one leaves without training: Group, DroppedGroup, GroupFilter.

A group is the G scored samples of one prompt (``Group``). ``GroupBuffer``
(``replay.group_buffer``) returns complete fresh groups as ``Group`` and reports
every other way out as a ``DroppedGroup`` (stale, failed, filtered, drained,
discarded) with a machine-readable reason. ``GroupFilter`` decides which complete,
fresh groups are not worth training on; its reasons are "zero_variance",
"mean_below_min", "mean_above_max" and "std_below_min".

References: DAPO, arXiv 2503.14476 (dynamic sampling: drop groups whose rewards
are all equal).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflash.types import FailureReason, PolicyVersion, PromptOutcome, Sample


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupFilter:
    """Which complete, fresh groups are not worth training on (checked at take time).

    Attributes:
      zero_variance: drop groups whose rewards are all equal (max - min <=
        zero_variance_atol): their group-relative advantages are all 0.
      zero_variance_atol: spread of rewards treated as zero. Rewards that are
        equal up to float rounding count as equal, so the fp32-residue case cannot
        sneak a huge normalised advantage through.
      min_mean, max_mean: drop groups whose mean reward is outside [min_mean, max_mean].
      min_std: drop groups whose population std (ddof=0) is below min_std.
    """

    zero_variance: bool = False
    zero_variance_atol: float = 1e-6
    min_mean: float | None = None
    max_mean: float | None = None
    min_std: float | None = None

    def __post_init__(self) -> None:
        if not self.zero_variance_atol >= 0:
            raise ValueError(
                f"GroupFilter.zero_variance_atol must be >= 0, got {self.zero_variance_atol}"
            )
        if self.min_std is not None and not self.min_std >= 0:
            raise ValueError(f"GroupFilter.min_std must be >= 0, got {self.min_std}")
        if self.min_mean is not None and self.max_mean is not None:
            if not self.min_mean <= self.max_mean:
                raise ValueError(
                    f"GroupFilter.min_mean ({self.min_mean}) must be <= max_mean ({self.max_mean})"
                )

    def reason(self, rewards_g: np.ndarray) -> str | None:
        """The filter reason for a group with rewards [G], or None if it passes."""
        r = np.asarray(rewards_g, np.float64)
        if self.zero_variance and float(r.max() - r.min()) <= self.zero_variance_atol:
            return "zero_variance"
        mean = float(r.mean())
        if self.min_mean is not None and mean < self.min_mean:
            return "mean_below_min"
        if self.max_mean is not None and mean > self.max_mean:
            return "mean_above_max"
        if self.min_std is not None and float(r.std()) < self.min_std:
            return "std_below_min"
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """The G scored samples of one prompt, sorted by sample_index.

    Attributes:
      prompt_id: the prompt.
      start_version: oldest start version among the samples (staleness is measured from it).
      samples: tuple of G Samples, sample_index 0..G-1.
    """

    prompt_id: int
    start_version: PolicyVersion
    samples: tuple[Sample, ...]

    @property
    def rewards_g(self) -> np.ndarray:
        """float64 [G] rewards in sample_index order."""
        return np.array([s.reward for s in self.samples], np.float64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DroppedGroup:
    """A group that left the buffer without being returned for training.

    Attributes:
      prompt_id: the prompt.
      outcome: PromptOutcome for the prompt ledger (STALE, FILTERED or FAILED).
      reason: short machine-readable reason ("stale", "zero_variance", "failed", ...).
      detail: human-readable detail (versions, the error text); never parsed.
      samples: whatever samples had arrived, sorted by sample_index.
      regenerate: True when the caller should resubmit the prompt (policy="regenerate")
        rather than close it in the ledger.
      failure: why a FAILED group failed (None for every other outcome).
      unfinished: samples the failure cut short, as the failing side reported them
        (``GroupBuffer.fail``; an agentic group's episodes still running or whose
        environment failed: their tokens so far, unscored). Not in ``samples``.
    """

    prompt_id: int
    outcome: PromptOutcome
    reason: str
    detail: str
    samples: tuple[Sample, ...]
    regenerate: bool = False
    failure: FailureReason | None = None
    unfinished: tuple[Sample, ...] = ()
