"""Per-step episode metrics of an agentic run (docs/METRICS.md); {} for RLVR samples.

Read from the samples alone (``reward_info``, ``response_mask``), without the
environments (``jaxflash.envs``); only the agentic workload reports them
(``EpisodeRollout.report``, the step record's ``episodes`` section): an RLVR run
never computes them. The stale bias follows tinker-cookbook PR #822 and prime-rl PR
#2960 (hard, slow problems are the ones that go stale).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxflash.replay.groups import DroppedGroup, Group
from jaxflash.types import PromptOutcome, Sample

STALE_REASONS = ("stale", "surplus_stale")
AGENT_METRIC = "agent_metric_"  # reward_info keys of AgentResult.metrics


def episode_metrics(groups: Sequence[Group], dropped: Sequence[DroppedGroup]) -> dict[str, Any]:
    """Per-step episode metrics (docs/METRICS.md); {} for RLVR samples.

    Over the step's groups: ``turns_per_episode``, ``env_time_per_turn_s``,
    ``success_rate``, ``invalid_action_rate``, ``sampled_tokens_mean``. The stale
    bias, over groups dropped as stale this step (``stale``, ``surplus_stale``; a
    surplus group counts only its episodes that had finished, the fast ones, so the
    gap is understated): ``stale_dropped_episodes`` and their ``stale_dropped_``
    ``turns_mean``, ``success_rate``, ``sampled_tokens_mean``, ``reward_mean``, next to
    the trained values above and ``reward_mean``.
    """
    trained = [s for g in groups for s in g.samples if _is_episode(s)]
    stale = [
        s
        for d in dropped
        if d.outcome == PromptOutcome.STALE and d.reason in STALE_REASONS
        for s in d.samples
        if _is_episode(s)
    ]
    if not trained and not stale:
        return {}
    out: dict[str, Any] = {}
    if trained:
        turns = sum(s.reward_info["turns"] for s in trained)
        out.update(
            turns_per_episode=turns / len(trained),
            env_time_per_turn_s=sum(s.reward_info["env_time_s"] for s in trained) / turns,
            success_rate=float(np.mean([s.reward_info["success"] for s in trained])),
            invalid_action_rate=sum(s.reward_info["invalid_actions"] for s in trained) / turns,
            sampled_tokens_mean=float(np.mean([np.sum(s.response_mask) for s in trained])),
        )
        # an agent's own metrics: each name's mean over the trained episodes that report it
        named: dict[str, list[float]] = {}
        for s in trained:
            for key, value in s.reward_info.items():
                if key.startswith(AGENT_METRIC):
                    named.setdefault(key, []).append(float(value))
        out.update({key: float(np.mean(values)) for key, values in sorted(named.items())})
    out["stale_dropped_episodes"] = len(stale)
    if stale:
        out.update(
            stale_dropped_turns_mean=float(np.mean([s.reward_info["turns"] for s in stale])),
            stale_dropped_success_rate=float(np.mean([s.reward_info["success"] for s in stale])),
            stale_dropped_sampled_tokens_mean=float(
                np.mean([np.sum(s.response_mask) for s in stale])
            ),
            stale_dropped_reward_mean=float(np.mean([s.reward for s in stale])),
        )
    return out


def _is_episode(sample: Sample) -> bool:
    return sample.response_mask is not None and "turns" in (sample.reward_info or {})
