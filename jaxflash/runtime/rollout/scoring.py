"""Scoring a finished sample: the reward request, its result, truncation and correctness.

Every finished sample is decoded (up to its stop token, exclusive), scored on its
own by the reward pool (no batch barrier), and given its reward here; one
definition of what a truncated response gets (``TruncationPolicy``) and of
whether an answer was correct (``correctness``) serves training metrics,
rollouts.jsonl and evaluation alike.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from jaxflash.rewards.base import RewardResult
from jaxflash.runtime.rollout.reward_pool import Scored
from jaxflash.types import FailureReason, Sample

TRUNCATION_MODES = ("penalty", "mask", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TruncationPolicy:
    """What a truncated response (it hit max_new_tokens) gets.

    mode "penalty": its reward is replaced by ``penalty``; mode "mask": it is
    scored normally but carries no loss (the learner never sees it); mode "none":
    it keeps its reward like any other response.

    Raises:
      ValueError: unknown mode.
    """

    mode: str = "penalty"
    penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in TRUNCATION_MODES:
            raise ValueError(
                f"truncation mode must be one of {TRUNCATION_MODES}, got {self.mode!r}"
            )

    def masks(self, sample: Sample) -> bool:
        """True if ``sample`` carries no loss."""
        return self.mode == "mask" and sample.truncated

    def masks_all(self, samples: Sequence[Sample]) -> bool:
        """True if no sample of a group carries loss: its prompt is FILTERED
        "all_truncated", not trained."""
        return all(self.masks(s) for s in samples)


class Scorer(Protocol):
    """Scores (response_text, answer, item_id) items (``RewardPool`` fits)."""

    def submit(self, item: tuple[str, str, Any]) -> concurrent.futures.Future: ...


def response_text(sample: Sample, tokenizer: Any) -> str:
    """The response as the reward sees it: decoded up to its first stop id, exclusive
    (``tokenizer.response_text``: any id of the stop set ends it, not only EOS)."""
    return tokenizer.response_text(sample.response_tokens)


def reward_item(sample: Sample, answer: str) -> tuple[str, str, str]:
    """The reward pool item of ``sample`` (its item id names prompt and sample)."""
    return (sample.response_text, answer, f"prompt {sample.prompt_id} sample {sample.sample_index}")


def scored_sample(
    sample: Sample, scored: Scored, truncation: TruncationPolicy
) -> tuple[Sample, FailureReason | None]:
    """``sample`` with its ``reward`` and ``reward_info`` from its score, and its failure.

    A truncated response under ``truncation.mode == "penalty"`` gets the penalty
    as its reward (unless scoring failed: then the failure decides its fate). The
    sample given is left as it was (a new ``Sample`` is returned).
    """
    result = scored.result
    reward = float(result.score)
    if scored.failure is None and sample.truncated and truncation.mode == "penalty":
        reward = float(truncation.penalty)
    info = {"components": dict(result.components), "error": result.error}
    return dataclasses.replace(sample, reward=reward, reward_info=info), scored.failure


def unavailable(err: BaseException) -> Scored:
    """The score of a sample whose reward could not even be requested."""
    return Scored(
        RewardResult(score=0.0, error=f"reward pool: {err!r}"), FailureReason.REWARD_UNAVAILABLE
    )


def correctness(sample: Sample) -> float:
    """Whether the answer was right, as the reward says it (``accuracy``, ``eval_accuracy``).

    The reward's ``correct`` component when it has one (Math-Verify, reasoning-gym);
    else the one ``<part>/correct`` component of a combined reward (the built-in
    math reward with a format bonus: ``math/correct``); else the reward itself (a
    custom reward: its score, so a reward in [0, 1] that gives 1 for a right
    answer reads as accuracy). 0.0 before scoring.
    """
    components = (sample.reward_info or {}).get("components", {})
    if "correct" in components:
        return float(components["correct"])
    parts = [k for k in components if k.endswith("/correct")]
    if len(parts) == 1:
        return float(components[parts[0]])
    return float(sample.reward) if sample.reward is not None else 0.0
