"""From a step's groups to the learner's batch: advantages, the truncation mask, packing.

Advantages are computed per group over the samples that carry loss (a masked,
truncated sample is left out of its group's baseline as well), by the estimator
the experiment names (``algorithms.advantages``: GRPO arXiv 2402.03300, Dr. GRPO
arXiv 2503.20783, RLOO arXiv 2402.14740, REINFORCE++ arXiv 2501.03262).

Every filter and mask can leave a step with nothing to train -- every sample
truncated under ``truncation="mask"``, every group filtered, failed or stale.
Such a step is *skipped* with a counted reason (``empty_reason``); the loop still
advances the policy version (weights unchanged) so the run goes on
(``learner_update``).

What the step's batch and update put in its record (``metrics.tracker``) is defined
here too: the groups' ``batch_metrics``, the ``staleness_metrics`` of what was
trained, the update's ``learner_metrics``; and the streak of steps whose every prompt
failed, which stops a run (``check_failing_streak``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxflash.learner.batching import pack_batch
from jaxflash.learner.cycles import drop_empty_cycles
from jaxflash.replay.groups import DroppedGroup, Group
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.rollout.scoring import TruncationPolicy, correctness
from jaxflash.types import RunStoppedError, Sample, TrainBatch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LearnerBatch:
    """What one step trains on.

    Attributes:
      batch: packed arrays [B*G, T] (None when nothing carries loss).
      samples: the samples that carry loss, in batch row order.
      advantages: float32 [len(samples)] their advantages.
    """

    batch: TrainBatch | None
    samples: tuple[Sample, ...]
    advantages: np.ndarray

    def staleness(self, learner_version: int) -> np.ndarray:
        """int64 [len(samples)]: versions between each sample's start and the learner's."""
        return np.array([learner_version - start_version_of(s) for s in self.samples], np.int64)


def learner_batch(
    groups: Sequence[Group],
    advantage_fn: Callable,
    truncation: TruncationPolicy,
    *,
    pad_id: int,
    max_len: int,
    num_sequences: int,
    length_multiple: int = 32,
) -> LearnerBatch:
    """Advantages per group, then the packed batch of the samples that carry loss.

    Args:
      groups: the step's groups (G samples each), in any order: they are packed by
        prompt_id, so the same groups give the same batch bit for bit however their
        completion order fell (float sums depend on row order).
      advantage_fn: ``(rewards_bg, *, mask_bg) -> adv_bg`` (``get_advantage_estimator``).
      truncation: masked samples carry no loss and no weight in their baseline.
      pad_id, max_len: padding token and longest allowed row (the model's max_seq_len).
      length_multiple: the batch's T is its longest row rounded up to a multiple of
        this (``LearnerConfig.length_multiple``).
      num_sequences: the loss normaliser's sequence count, B*G, fixed so that a
        step with fewer groups is not up-weighted.
    """
    if not groups:
        return LearnerBatch(None, (), np.zeros((0,), np.float32))
    groups = sorted(groups, key=lambda g: g.prompt_id)
    rewards_bg = np.stack([g.rewards_g for g in groups]).astype(np.float32)
    keep_bg = np.array([[not truncation.masks(s) for s in g.samples] for g in groups])
    adv_bg = np.asarray(advantage_fn(jnp.asarray(rewards_bg), mask_bg=jnp.asarray(keep_bg)))
    samples = [s for g in groups for s in g.samples]
    keep = keep_bg.reshape(-1)
    trained = tuple(s for s, k in zip(samples, keep, strict=True) if k)
    advantages = adv_bg.reshape(-1)[keep].astype(np.float32)
    if not trained:
        return LearnerBatch(None, (), advantages)
    batch = pack_batch(
        list(trained),
        advantages,
        pad_id=pad_id,
        max_len=max_len,
        num_sequences=num_sequences,
        length_multiple=length_multiple,
    )
    return LearnerBatch(batch, trained, advantages)


def batch_metrics(groups: Sequence[Group], trained: Sequence[Sample]) -> dict[str, Any]:
    """Sample statistics of one learner step.

    Args:
      groups: the step's groups (every sample of a trained prompt).
      trained: the samples that carried loss (masked ones excluded).

    Returns:
      num_groups, num_samples (samples with loss), samples_masked, and over every
      sample of ``groups`` (masked included: they are what the policy produced for
      the trained prompts): reward_mean, reward_std, accuracy (``correctness``),
      response_len_mean, response_len_max, truncated_frac; with a reward that reports
      ``outcome/<name>`` components (``code``: how each sandboxed run ended),
      sandbox_outcomes = {name: samples}. Only the counts when there are no groups.
    """
    samples = [s for g in groups for s in g.samples]
    out: dict[str, Any] = {
        "num_groups": len(groups),
        "num_samples": len(trained),
        "samples_masked": len(samples) - len(trained),
    }
    if not samples:
        return out
    rewards = np.array([s.reward for s in samples], np.float64)
    lens = np.array([len(s.response_tokens) for s in samples], np.float64)
    out.update(
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        accuracy=float(np.mean([correctness(s) for s in samples])),
        response_len_mean=float(lens.mean()),
        response_len_max=float(lens.max()),
        truncated_frac=float(np.mean([s.truncated for s in samples])),
    )
    outcomes = collections.Counter(
        name.removeprefix("outcome/")
        for s in samples
        for name, value in (s.reward_info or {}).get("components", {}).items()
        if name.startswith("outcome/") and value
    )
    if outcomes:
        out["sandbox_outcomes"] = dict(sorted(outcomes.items()))
    return out


def staleness_metrics(stale: np.ndarray) -> dict[str, Any]:
    """staleness_mean/max/hist over the samples with loss (learner version - start)."""
    if stale.size == 0:
        return {}
    values, counts = np.unique(stale, return_counts=True)
    return {
        "staleness_mean": float(stale.mean()),
        "staleness_max": int(stale.max()),
        "staleness_hist": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
    }


def learner_metrics(train: dict[str, float]) -> dict[str, float]:
    """The train step's metrics, with the engine-vs-learner logprob gap split in two.

    ``logprob_gap_on_policy_max``: max |log pi - log mu| over tokens sampled by the
    learner's current version (engine/learner numerical agreement: float rounding);
    ``logprob_gap_off_policy_max``: the same over tokens of older versions (policy
    change plus rounding; 0 when there are none); ``on_policy_tokens`` counts the
    former. A dual-cycle step's per-cycle ratio statistics are left out for a cycle
    that had no tokens (``learner.cycles.drop_empty_cycles``).
    """
    out = drop_empty_cycles(train)  # no ratio statistics for a cycle without tokens
    out.pop("logprob_gap_max", None)  # the max over both kinds: reported split below
    out["logprob_gap_on_policy_max"] = out.pop("logprob_gap_max_current")
    out["logprob_gap_off_policy_max"] = out.pop("logprob_gap_max_off_policy")
    out["on_policy_tokens"] = out.pop("current_tokens")
    return out


def report_batch(
    tracker: Any, groups: Sequence[Group], lb: LearnerBatch, stale: np.ndarray
) -> None:
    """Report what a step's groups and ``lb`` put in its record: the ``batch`` section
    (``batch_metrics``) and the ``staleness`` of what was trained (``lb.staleness``)."""
    tracker.report("batch", batch_metrics(groups, lb.samples))
    tracker.report("staleness", staleness_metrics(stale))


def learner_update(
    learner: Any,
    train_batch: TrainBatch | None,
    batch: Any,
    *,
    learner_version: int,
) -> dict[str, Any]:
    """Train on ``train_batch``, or skip a step with nothing to train.

    Args:
      learner: ``LearnerProgram`` (``train``, ``skip``, ``step``).
      train_batch: the step's batch (None: nothing carries loss).
      batch: the rollout's ``Batch`` (its groups and dropped groups name the reason).
      learner_version: the version the step trains at.

    Returns:
      The ``learner`` section: the update's ``learner_metrics``, or {"skipped": reason}
      (``empty_reason``; the version advances, the weights do not; the rollout counts it,
      ``RolloutScheduler.end_step(..., skipped=reason)``).
    """
    if train_batch is not None:
        return learner_metrics(learner.train(train_batch))
    skipped = empty_reason(batch.groups, batch.dropped)
    log.warning("step %d has nothing to train (%s): skipped", learner_version + 1, skipped)
    learner.skip()
    return {"skipped": skipped}


ALL_FAILED_STEPS_LIMIT = 3  # steps in a row in which every prompt failed: the run stops


def check_failing_streak(streak: int, outcomes: dict[str, dict[str, int]]) -> None:
    """Stops a run whose every prompt keeps failing (a broken reward or data).

    Args:
      streak: steps in a row skipped as "all_failed" (``empty_reason``).
      outcomes: the ledger's outcome -> reason -> count, quoted in the message.

    Raises:
      RunStoppedError: ``streak`` reached ``ALL_FAILED_STEPS_LIMIT``.
    """
    if streak >= ALL_FAILED_STEPS_LIMIT:
        reasons = dict(outcomes.get("failed", {}))
        raise RunStoppedError(
            f"{streak} steps in a row had every prompt fail (failed by reason so far: "
            f"{reasons}); check reward.fn and the data; rollouts.jsonl names each failure"
        )


def empty_reason(groups: Sequence[Group], dropped: Sequence[DroppedGroup]) -> str:
    """Why a step has nothing to train, as a counter suffix.

    "all_truncated": groups arrived but every sample was masked; "all_filtered" /
    "all_failed" / "all_stale": every prompt of the step ended that way;
    "mixed": several of those; "no_prompts": nothing arrived at all.
    """
    if groups:
        return "all_truncated"
    outcomes = {str(d.outcome) for d in dropped}
    if len(outcomes) == 1:
        return f"all_{outcomes.pop()}"
    return "mixed" if outcomes else "no_prompts"
