"""Synchronous batch rollout of episodes: the reference driver (and benchmark mode (a)).

Every round generates one turn of every running episode in a single batch, then
steps their environments one after another, and repeats until every episode has
ended: each turn waits for the whole batch's environment steps. The runtime's
environment-level asynchronous manager replaces this loop (each episode advances
on its own, environment calls on workers); calibration and tests use it as is.
No threads: a hanging environment blocks this driver (its deadline is checked
when the call returns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxflash.envs.base import TextEnv, checked_reset, checked_step
from jaxflash.envs.episode import Episode, Trajectory
from jaxflash.types import GenerationRequest, Sample, SamplingParams

GenerateBatch = Callable[[Sequence[GenerationRequest]], Sequence[Sample]]
"""requests -> their finished Samples, in order (e.g. ``generation.slot_loop.run_requests``)."""


def run_episodes(
    envs: Sequence[TextEnv],
    episodes: Sequence[Episode],
    generate: GenerateBatch,
    sampling: SamplingParams,
    *,
    seed: int = 0,
) -> list[Trajectory]:
    """Play ``episodes[i]`` in ``envs[i]`` to the end, in lockstep rounds.

    Args:
      envs: one environment per episode (reset here with the episode's env_seed).
      episodes: new Episodes.
      generate: the policy, batched.
      sampling: sampling parameters (the turn budget replaces max_new_tokens).
      seed: sampling seed of every request.

    Returns:
      the trajectories, in episode order (failed ones included, with their failure).

    Raises:
      ValueError: lengths differ, or ``generate`` returns the wrong number of samples.
    """
    if len(envs) != len(episodes):
        raise ValueError(f"run_episodes: {len(envs)} envs for {len(episodes)} episodes")
    for env, ep in zip(envs, episodes, strict=True):
        ep.begin(checked_reset(env, ep.env_seed, deadline_s=env.config.step_timeout_s))
    while True:
        live = [i for i, ep in enumerate(episodes) if ep.awaiting == "policy"]
        if not live:
            break
        requests = [episodes[i].next_request(sampling, seed=seed) for i in live]
        samples = list(generate(requests))
        if len(samples) != len(requests):
            raise ValueError(f"run_episodes: {len(samples)} samples for {len(requests)} requests")
        for i, sample in zip(live, samples, strict=True):
            action_text = episodes[i].record_turn(sample)
            env = envs[i]
            episodes[i].record_step(
                checked_step(env, action_text, deadline_s=env.config.step_timeout_s)
            )
    return [ep.trajectory() for ep in episodes]
