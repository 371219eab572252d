"""Base success rate of a policy on an environment's held-out seeds: mean@n with standard error.

Each seed (map, level, task) is played ``n`` times; its success rate is the share of
its episodes that reported ``info["success"]``; the result is the mean over seeds
and its standard error over seeds (std with ddof=1 / sqrt(S)), as the arithmetic
calibration reports accuracy. Episodes whose environment failed are not counted as
losses: they are excluded from their seed's rate and counted in ``env_failures``
(a seed left with no episode is excluded and counted in ``seeds_excluded``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxflash.envs.base import TextEnv
from jaxflash.envs.chat import TurnRenderer, renderer_for
from jaxflash.envs.driver import GenerateBatch, run_episodes
from jaxflash.envs.episode import Episode, EpisodeEnd, Trajectory
from jaxflash.types import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationResult:
    """mean@n success with its standard error over seeds.

    Attributes:
      success_mean, success_stderr: over the seeds kept (stderr nan with < 2 seeds).
      per_seed: float64 [S_kept] success rate of each kept seed.
      seeds: the kept seeds, in order.
      episodes: episodes played; env_failures: of them, failed environments.
      seeds_excluded: seeds whose every episode failed.
      invalid_action_rate: invalid actions / turns over the counted episodes.
      mean_turns: turns per counted episode.
    """

    success_mean: float
    success_stderr: float
    per_seed: np.ndarray
    seeds: tuple[int, ...]
    episodes: int
    env_failures: int
    seeds_excluded: int
    invalid_action_rate: float
    mean_turns: float


def calibrate_success(
    make_env: Callable[[], TextEnv],
    renderer: TurnRenderer,
    generate: GenerateBatch,
    *,
    seeds: Sequence[int],
    n: int,
    sampling: SamplingParams,
    max_context_tokens: int,
    episodes_per_batch: int = 32,
    sampling_seed: int = 0,
    progress: Callable[[int, int, int], None] | None = None,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> CalibrationResult:
    """Play every seed ``n`` times with ``generate`` and report mean@n success.

    Args:
      make_env: a fresh environment (one per episode of a batch).
      renderer: chat rendering of the policy's tokenizer.
      generate: the policy, batched (requests -> Samples).
      seeds: environment seeds to evaluate (use the eval split's).
      n: episodes per seed (>= 1); episode i of seed s is (prompt_id=s, index i).
      sampling: sampling parameters (the training temperature).
      max_context_tokens: prompt + response limit per episode.
      episodes_per_batch: episodes played in lockstep at once.
      sampling_seed: seed of every request.
      progress: called at the start and after each batch with (episodes played,
        episodes in all, tokens sampled so far).
      on_trajectory: called with every finished trajectory (failed ones included),
        e.g. to dump transcripts for inspection.

    Raises:
      ValueError: no seeds, n < 1, or episodes_per_batch < 1.
    """
    if not seeds or n < 1 or episodes_per_batch < 1:
        raise ValueError(
            f"calibrate_success: need seeds, n >= 1, episodes_per_batch >= 1; got "
            f"{len(seeds)} seeds, n={n}, episodes_per_batch={episodes_per_batch}"
        )
    jobs = [(s, i) for s in seeds for i in range(n)]
    results: dict[int, list[bool]] = {s: [] for s in seeds}
    failures = turns = invalid = counted = sampled = 0
    if progress is not None:  # the total is known now, before the first batch ends
        progress(0, len(jobs), 0)
    for start in range(0, len(jobs), episodes_per_batch):
        chunk = jobs[start : start + episodes_per_batch]
        envs = [make_env() for _ in chunk]
        episodes = [
            Episode(
                renderer_for(env, renderer),
                env.config,
                prompt_id=s,
                episode_index=i,
                env_seed=s,
                start_version=0,
                max_context_tokens=max_context_tokens,
            )
            for env, (s, i) in zip(envs, chunk, strict=True)
        ]
        for (s, _), traj in zip(
            chunk, run_episodes(envs, episodes, generate, sampling, seed=sampling_seed), strict=True
        ):
            if on_trajectory is not None:
                on_trajectory(traj)
            if traj.end == EpisodeEnd.ENV_FAILURE:
                failures += 1
                continue
            results[s].append(traj.success)
            sampled += int(traj.loss_mask.sum())
            counted += 1
            turns += len(traj.turns)
            invalid += traj.invalid_actions
        for env in envs:
            env.close()
        if progress is not None:
            progress(start + len(chunk), len(jobs), sampled)
    kept = [s for s in seeds if results[s]]
    per_seed = np.array([np.mean(results[s]) for s in kept], np.float64)
    S = len(kept)
    return CalibrationResult(
        success_mean=float(per_seed.mean()) if S else float("nan"),
        success_stderr=float(per_seed.std(ddof=1) / math.sqrt(S)) if S > 1 else float("nan"),
        per_seed=per_seed,
        seeds=tuple(kept),
        episodes=len(jobs),
        env_failures=failures,
        seeds_excluded=len(seeds) - S,
        invalid_action_rate=invalid / turns if turns else float("nan"),
        mean_turns=turns / counted if counted else float("nan"),
    )
