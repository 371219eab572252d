"""From finished episodes to what the learner consumes: Samples and per-token advantages.

One episode becomes one training ``Sample``: ``prompt_tokens`` = the first prompt,
``response_tokens`` = everything after it (all turns and the deltas between them),
``response_mask`` = 1 on the tokens the policy sampled (the minimal extension of
``Sample`` for multi-turn; ``learner.episode_batching.pack_episode_batch`` honours
it and takes per-token advantages). Its ``reward`` is the episode return, so the
group buffer, staleness gate and ledger handle episodes like RLVR samples. An
episode its group's failure cut short is never trained; ``unfinished_sample`` gives
its tokens so far the same layout, for its rollouts.jsonl row.

Advantages come from ``algorithms.episode_advantages`` over groups of episodes that
share an environment seed, at the trajectory or the step (turn) level, and are
spread over tokens here: every sampled token of turn t gets turn t's advantage
(trajectory level: the episode's), tokens with mask 0 get 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxflash.algorithms.episode_advantages import EPISODE_ADVANTAGE_LEVELS
from jaxflash.envs.episode import EpisodeEnd, Trajectory
from jaxflash.types import FinishReason, Sample


def trajectory_to_sample(traj: Trajectory) -> Sample:
    """The training Sample of a finished episode (layout in the module docstring).

    Masked (non-policy) tokens carry behaviour logprob 0.0 and version
    ``start_version``, so the sample's start version -- its oldest stamp -- is the
    episode's. ``finish_reason`` is the last turn's: LENGTH when it was cut off at its
    token budget (so a truncation policy can mask it), else EOS. ``reward_info``
    holds the episode's end, turns, success, invalid actions, turn rewards and
    environment time.

    Raises:
      ValueError: the episode is not finished, failed (ENV_FAILURE: isolate and
        count it, never train it), or has no turn.
    """
    tag = f"episode {traj.prompt_id}/{traj.episode_index}"
    if traj.end is None:
        raise ValueError(f"trajectory_to_sample: {tag} is not finished")
    if traj.end == EpisodeEnd.ENV_FAILURE:
        raise ValueError(f"trajectory_to_sample: {tag} failed ({traj.failure}); it is not trained")
    if not traj.turns:
        raise ValueError(f"trajectory_to_sample: {tag} has no turn ({traj.end})")
    success = traj.success
    return _sample_of(
        traj,
        sample_index=traj.episode_index,
        finish_reason=traj.turns[-1].finish_reason,
        reward=traj.episode_return,
        reward_info={
            # accuracy / correctness of a run read components["correct"]: the success
            "components": {"correct": float(success), "return": traj.episode_return},
            "episode_end": traj.end.value,
            "env_seed": traj.env_seed,
            "turns": len(traj.turns),
            "success": success,
            "invalid_actions": traj.invalid_actions,
            "turn_rewards": traj.turn_rewards.tolist(),
            "env_time_s": traj.env_time_s,
            # an agent's own metrics (AgentResult.metrics, docs/AGENTS.md)
            **{
                f"agent_metric_{name}": float(value)
                for name, value in traj.turns[-1].info.get("agent_metrics", {}).items()
            },
        },
    )


def unfinished_sample(traj: Trajectory, *, sample_index: int) -> Sample:
    """What an episode cut short by its group's failure had generated: its
    rollouts.jsonl row (``outcome`` failed), never trained.

    The layout is ``trajectory_to_sample``'s over the tokens so far (none when the
    environment failed at reset; a running turn's tokens are not in it): mask 1 and
    the behaviour logprobs exactly on what the engine sampled, 0 on the template and
    observation tokens between turns. ``finish_reason`` is ABORTED and ``reward``
    None (the episode was never scored); ``reward_info["error"]`` names the
    environment's failure when this episode's environment failed.

    Args:
      traj: the episode so far (``Episode.trajectory()``; finished or not).
      sample_index: its index among the group's rows (after the finished episodes).
    """
    info: dict = {
        "episode_end": None if traj.end is None else traj.end.value,
        "env_seed": traj.env_seed,
        "episode_index": traj.episode_index,
        "turns": len(traj.turns),
    }
    if traj.failure is not None:
        f = traj.failure
        info["error"] = f"environment {f.reason} in {f.phase}: {f.detail}"
    return _sample_of(
        traj,
        sample_index=sample_index,
        finish_reason=FinishReason.ABORTED,
        reward=None,
        reward_info=info,
    )


def _sample_of(
    traj: Trajectory,
    *,
    sample_index: int,
    finish_reason: FinishReason,
    reward: float | None,
    reward_info: dict,
) -> Sample:
    """A Sample laid out as the module says: masked tokens get logprob 0 and the start version."""
    sampled = traj.loss_mask > 0
    start = int(traj.start_version)
    if sampled.any():
        start = min(start, int(traj.token_versions[sampled].min()))
    versions = np.where(sampled, traj.token_versions, start).astype(np.int32)
    logp = np.where(sampled, traj.behaviour_logprobs, 0.0).astype(np.float32)
    transcript = "\n".join(f"[{m['role']}] {m['content']}" for m in traj.messages[1:])
    return Sample(
        prompt_id=traj.prompt_id,
        sample_index=sample_index,
        prompt_tokens=traj.prompt_tokens.copy(),
        response_tokens=traj.response_tokens.copy(),
        behaviour_logprobs=logp,
        token_versions=versions,
        start_version=start,
        finish_reason=finish_reason,
        reward=reward,
        reward_info=reward_info,
        response_text=transcript,
        response_mask=traj.loss_mask.astype(np.float32).copy(),
    )


def token_advantages(
    traj: Trajectory, turn_advantages_k: Sequence[float] | np.ndarray
) -> np.ndarray:
    """Spread per-turn advantages over the episode's response tokens.

    Args:
      traj: the episode.
      turn_advantages_k: float [>= number of turns]: advantage of each turn (the same
        value for every turn at the trajectory level).

    Returns:
      float32 [R]: turn t's advantage on its sampled tokens, 0 where the mask is 0.

    Raises:
      ValueError: fewer advantages than turns, or non-finite ones.
    """
    adv_k = np.asarray(turn_advantages_k, np.float32).reshape(-1)
    if adv_k.size < len(traj.turns):
        raise ValueError(f"token_advantages: {adv_k.size} advantages for {len(traj.turns)} turns")
    if not np.all(np.isfinite(adv_k[: len(traj.turns)])):
        raise ValueError(f"token_advantages: non-finite advantages {adv_k}")
    if traj.response_tokens.size == 0:
        return np.zeros((0,), np.float32)
    return np.where(traj.loss_mask > 0, adv_k[traj.token_turn], 0.0).astype(np.float32)


def turn_reward_arrays(
    groups: Sequence[Sequence[Trajectory | None]],
) -> tuple[np.ndarray, np.ndarray]:
    """Pad the groups' turn rewards into ([B, G, K] rewards, [B, G, K] turn mask).

    ``None`` entries (missing episodes) and groups smaller than the largest get
    all-zero mask rows. K is the largest number of rewarded turns.
    """
    if not groups:
        raise ValueError("turn_reward_arrays: no groups")
    B = len(groups)
    G = max(len(g) for g in groups)
    K = max([len(t.turn_rewards) for g in groups for t in g if t is not None] + [1])
    rewards = np.zeros((B, G, K), np.float32)
    mask = np.zeros((B, G, K), np.float32)
    for b, group in enumerate(groups):
        for i, traj in enumerate(group):
            if traj is None:
                continue
            r = traj.turn_rewards
            rewards[b, i, : r.size] = r
            mask[b, i, : r.size] = 1.0
    return rewards, mask


def group_token_advantages(
    groups: Sequence[Sequence[Trajectory | None]],
    *,
    level: str = "trajectory",
    gamma: float = 1.0,
    estimator: str = "grpo",
    **estimator_kwargs,
) -> list[list[np.ndarray | None]]:
    """Per-token advantages of every episode, normalised within its group.

    Args:
      groups: B groups of episodes sharing an environment seed; ``None`` for a
        missing episode (it is excluded from the baseline).
      level: "trajectory" or "step" (``algorithms.episode_advantages``).
      gamma: discount per turn.
      estimator: ``ADVANTAGE_ESTIMATORS`` name; **estimator_kwargs passed on.

    Returns:
      the same nesting as ``groups``: float32 [R] per episode, None where missing.

    Raises:
      ValueError: unknown level, a failed or unfinished episode in a group.
    """
    if level not in EPISODE_ADVANTAGE_LEVELS:
        raise ValueError(f"unknown level {level!r}; choose from {sorted(EPISODE_ADVANTAGE_LEVELS)}")
    for group in groups:
        for traj in group:
            if traj is not None and (traj.end in (None, EpisodeEnd.ENV_FAILURE) or not traj.turns):
                raise ValueError(
                    f"group_token_advantages: episode {traj.prompt_id}/{traj.episode_index} "
                    f"ended {traj.end}; pass None for episodes that are not trained"
                )
    rewards, mask = turn_reward_arrays(groups)
    adv = np.asarray(
        EPISODE_ADVANTAGE_LEVELS[level](
            rewards, mask, gamma=gamma, estimator=estimator, **estimator_kwargs
        )
    )
    out: list[list[np.ndarray | None]] = []
    for b, group in enumerate(groups):
        row: list[np.ndarray | None] = []
        for i, traj in enumerate(group):
            if traj is None:
                row.append(None)
                continue
            per_turn = adv[b, i] if level == "step" else np.full(rewards.shape[2], adv[b, i])
            row.append(token_advantages(traj, per_turn))
        out.append(row)
    return out


def token_turns(sample: Sample) -> np.ndarray:
    """int32 [R]: the turn each response token belongs to, from ``response_mask``.

    Turn t's sampled tokens are the t-th run of mask 1 (every turn samples at least
    one token and a non-empty delta of mask 0 follows each turn but the last), so a
    token's turn is the number of mask runs that started at or before it, minus 1;
    delta tokens belong to the turn they follow (as ``Trajectory.token_turn``).

    Raises:
      ValueError: the sample has no response_mask, or its response does not start
        with a sampled token.
    """
    if sample.response_mask is None:
        raise ValueError(
            f"token_turns: sample {sample.prompt_id}/{sample.sample_index} is single-turn"
        )
    mask = np.asarray(sample.response_mask) > 0
    if mask.size == 0 or not mask[0]:
        raise ValueError(
            f"token_turns: sample {sample.prompt_id}/{sample.sample_index} does not start "
            "with a sampled token"
        )
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    return (np.cumsum(starts) - 1).astype(np.int32)


def sample_token_advantages(
    groups: Sequence[Sequence[Sample]],
    *,
    level: str = "trajectory",
    gamma: float = 1.0,
    estimator: str = "grpo",
    **estimator_kwargs,
) -> list[list[np.ndarray]]:
    """``group_token_advantages`` for episodes already turned into Samples.

    Reads each sample's per-turn rewards (``reward_info["turn_rewards"]``) and its
    turns (``token_turns``).

    Args:
      groups: B groups of episode Samples sharing an environment seed.
      level, gamma, estimator, **estimator_kwargs: as ``group_token_advantages``.

    Returns:
      per sample, float32 [R]: its turn's advantage on sampled tokens, 0 elsewhere.

    Raises:
      ValueError: unknown level, a sample without turn rewards or response mask.
    """
    if level not in EPISODE_ADVANTAGE_LEVELS:
        raise ValueError(f"unknown level {level!r}; choose from {sorted(EPISODE_ADVANTAGE_LEVELS)}")
    if not groups:
        raise ValueError("sample_token_advantages: no groups")
    turn_rewards = []
    for group in groups:
        row = []
        for s in group:
            r = (s.reward_info or {}).get("turn_rewards")
            if not r:
                raise ValueError(
                    f"sample_token_advantages: sample {s.prompt_id}/{s.sample_index} has no "
                    "turn rewards (not an episode)"
                )
            row.append(np.asarray(r, np.float32))
        turn_rewards.append(row)
    B, G = len(groups), max(len(g) for g in groups)
    K = max(r.size for row in turn_rewards for r in row)
    rewards = np.zeros((B, G, K), np.float32)
    mask = np.zeros((B, G, K), np.float32)
    for b, row in enumerate(turn_rewards):
        for i, r in enumerate(row):
            rewards[b, i, : r.size], mask[b, i, : r.size] = r, 1.0
    adv = np.asarray(
        EPISODE_ADVANTAGE_LEVELS[level](
            rewards, mask, gamma=gamma, estimator=estimator, **estimator_kwargs
        )
    )
    out = []
    for b, group in enumerate(groups):
        row = []
        for i, s in enumerate(group):
            per_turn = adv[b, i] if level == "step" else np.full(K, adv[b, i], np.float32)
            turns = token_turns(s)
            keep = np.asarray(s.response_mask) > 0
            row.append(np.where(keep, per_turn[turns], 0.0).astype(np.float32))
        out.append(row)
    return out
