"""Advantages of a batch that mixes a fresh cycle and a replay cycle, per prompt.

RePO (arXiv 2506.09340) trains each prompt on its fresh samples plus k replayed
samples of the same prompt and compares two normalisations:

- ``split``: the fresh set and the replayed set of a prompt are normalised
  separately (each its own group for the estimator); RePO's choice.
- ``joint``: the fresh and replayed samples of a prompt form one group.

Both run a ``ADVANTAGE_ESTIMATORS`` estimator (grpo, dr_grpo, rloo, ...) on the
sets laid out as a padded [S, G_max] array with a mask, so missing entries and
all-equal sets behave as documented there (all-equal -> exactly 0).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from jaxflash.algorithms.advantages import get_advantage_estimator

CYCLE_NORMALISATIONS = ("joint", "split")


def cycle_advantages(
    rewards_n: Sequence[float] | np.ndarray,
    groups_n: Sequence[Hashable],
    replay_n: Sequence[bool] | np.ndarray,
    *,
    mode: str,
    estimator: str = "grpo",
    **estimator_kwargs: Any,
) -> np.ndarray:
    """Per-sample advantages with the two cycles normalised jointly or split.

    Args:
      rewards_n: float [N] scalar rewards.
      groups_n: [N] group key per sample (the prompt; e.g. its prompt key).
      replay_n: bool [N], True for replayed samples.
      mode: "joint" (set = group) or "split" (set = (group, cycle)).
      estimator: an ``ADVANTAGE_ESTIMATORS`` name ("reinforce_pp" normalises over
        the whole batch, so it is refused here: its sets are not per prompt).
      **estimator_kwargs: passed to the estimator (eps, residue_rtol, ...).

    Returns:
      float32 [N] in input order.

    Raises:
      ValueError: an unknown mode / estimator, or lengths that differ.

    References: RePO, arXiv 2506.09340 (joint vs split advantage estimation).
    """
    if mode not in CYCLE_NORMALISATIONS:
        raise ValueError(f"cycle_advantages: mode {mode!r} not in {CYCLE_NORMALISATIONS}")
    if estimator == "reinforce_pp":
        raise ValueError("cycle_advantages: reinforce_pp normalises over the batch, not per set")
    fn = get_advantage_estimator(estimator)
    rewards_n = np.asarray(rewards_n, np.float32)
    replay_n = np.asarray(replay_n, bool)
    if not (len(rewards_n) == len(groups_n) == len(replay_n)):
        raise ValueError(
            f"cycle_advantages: {len(rewards_n)} rewards, {len(groups_n)} groups, "
            f"{len(replay_n)} cycle flags"
        )
    n = len(rewards_n)
    if n == 0:
        return np.zeros(0, np.float32)
    keys = [
        (g, bool(r)) if mode == "split" else (g,) for g, r in zip(groups_n, replay_n, strict=True)
    ]
    set_index: dict[tuple, int] = {}
    slot = np.zeros(n, np.int64)
    sizes: list[int] = []
    row = np.zeros(n, np.int64)
    for i, k in enumerate(keys):
        if k not in set_index:
            set_index[k] = len(sizes)
            sizes.append(0)
        row[i] = set_index[k]
        slot[i] = sizes[row[i]]
        sizes[row[i]] += 1
    rewards_sg = np.zeros((len(sizes), max(sizes)), np.float32)
    mask_sg = np.zeros_like(rewards_sg)
    rewards_sg[row, slot] = rewards_n
    mask_sg[row, slot] = 1.0
    adv_sg = np.asarray(fn(rewards_sg, mask_bg=mask_sg, **estimator_kwargs), np.float32)
    return adv_sg[row, slot]
