"""From a step's groups to the learner's batch: advantages, the truncation mask, packing.

Advantages are computed per group over the samples that carry loss (a masked,
truncated sample is left out of its group's baseline as well), by the estimator
the experiment names (``algorithms.advantages``: GRPO arXiv 2402.03300, Dr. GRPO
arXiv 2503.20783, RLOO arXiv 2402.14740, REINFORCE++ arXiv 2501.03262).

Every filter and mask can leave a step with nothing to train -- every sample
truncated under ``truncation="mask"``, every group filtered, failed or stale.
Such a step is *skipped* with a counted reason (``empty_reason``); the loop still
advances the policy version (weights unchanged) so the run goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxflash.learner.batching import pack_batch
from jaxflash.replay.groups import DroppedGroup, Group
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.rollout import records
from jaxflash.runtime.rollout.scoring import TruncationPolicy
from jaxflash.runtime.workloads.episode_metrics import episode_metrics
from jaxflash.types import RunStoppedError, Sample, TrainBatch


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
) -> LearnerBatch:
    """Advantages per group, then the packed batch of the samples that carry loss.

    Args:
      groups: the step's groups (G samples each), in any order: they are packed by
        prompt_id, so the same groups give the same batch bit for bit however their
        completion order fell (float sums depend on row order).
      advantage_fn: ``(rewards_bg, *, mask_bg) -> adv_bg`` (``get_advantage_estimator``).
      truncation: masked samples carry no loss and no weight in their baseline.
      pad_id, max_len: padding token and longest allowed row (the model's max_seq_len).
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
        list(trained), advantages, pad_id=pad_id, max_len=max_len, num_sequences=num_sequences
    )
    return LearnerBatch(batch, trained, advantages)


def step_batch_metrics(
    batch: Any,
    lb: LearnerBatch,
    learner_metrics: dict[str, Any],
    staleness: np.ndarray,
) -> dict[str, Any]:
    """What a step's batch (``rollout.batches.Batch``: its groups and dropped groups) and
    ``lb`` put in its metrics row (docs/METRICS.md), in this order: the groups'
    (``records.batch_metrics``), their episodes' (``episode_metrics``), the
    update's ``learner_metrics``, the ``staleness`` of what was trained (``lb.staleness``)."""
    return {
        **records.batch_metrics(batch.groups, lb.samples),
        **episode_metrics(batch.groups, batch.dropped),
        **learner_metrics,
        **records.staleness_metrics(staleness),
    }


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
