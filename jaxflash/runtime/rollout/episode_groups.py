"""What the environment manager (``runtime.rollout.episode_dispatch``) plays and keeps per group.

``EpisodeSettings`` says how episodes are played (environments, rendering,
redundancy -- ROLL's ``group_size_redundancy``, arXiv 2510.11345 -- and restarts);
an ``EpisodeGroup`` is one group's episodes: those running (``EpisodeRun``) and
the start versions of those kept.

Every episode started ends exactly once (counters add up, across restarts too):

    episodes_started == episodes_finished + episodes_env_failed
                        + episodes_aborted_redundant + episodes_aborted
                        + episodes_aborted_on_resume + episodes running

(``EPISODE_ENDS`` lists the ending counters.)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from jaxflash.envs.base import EnvConfig, TextEnv
from jaxflash.envs.chat import TurnRenderer, renderer_for
from jaxflash.envs.episode import Episode
from jaxflash.runtime.rollout.env_calls import EnvCalls, Runner, close_env, thread_runner
from jaxflash.types import Prompt

EPISODE_ENDS = (
    "episodes_finished",
    "episodes_env_failed",
    "episodes_aborted_redundant",
    "episodes_aborted",
    "episodes_aborted_on_resume",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeSettings:
    """How the environment manager plays episodes.

    Attributes:
      make_env: a fresh environment of the training split (one per episode).
      renderer: chat rendering of first prompts and between-turn deltas.
      limits: the environment's ``EnvConfig`` (max_turns, max_tokens_per_turn,
        step_timeout_s: the deadline of every reset and step).
      max_context_tokens: prompt + response limit of an episode (tokens; the
        engine's max_target_length).
      redundancy: r >= 0 extra episodes per group (ROLL's group_size_redundancy).
      max_env_restarts: episodes restarted per group after environment failures
        before the group fails.
      runner: how environment calls run (``runtime.rollout.env_calls``: a daemon thread
        each; simulations and tests run them in virtual time).
    """

    make_env: Callable[[], TextEnv]
    renderer: TurnRenderer
    limits: EnvConfig
    max_context_tokens: int
    redundancy: int = 0
    max_env_restarts: int = 2
    runner: Runner = thread_runner

    def __post_init__(self) -> None:
        if self.redundancy < 0 or self.max_env_restarts < 0 or self.max_context_tokens < 2:
            raise ValueError(
                f"EpisodeSettings: need redundancy >= 0, max_env_restarts >= 0 and "
                f"max_context_tokens >= 2; got {self.redundancy}, {self.max_env_restarts}, "
                f"{self.max_context_tokens}"
            )


@dataclasses.dataclass
class EpisodeRun:
    """One episode in flight: its bookkeeping, its environment, its pending call."""

    episode: Episode
    env: TextEnv | None
    call: int | None = None

    def waits_on(self, call: int | None) -> None:
        """Its environment call now pending (None: it returned)."""
        self.call = call

    def lose_env(self) -> None:
        """Its call missed its deadline and may still run: never touch the env again."""
        self.env = None


@dataclasses.dataclass
class EpisodeGroup:
    """A group's episodes: those running and the start versions of those kept."""

    prompt: Prompt
    runs: dict[int, EpisodeRun] = dataclasses.field(default_factory=dict)
    kept: list[int] = dataclasses.field(default_factory=list)
    next_index: int = 0
    restarts: int = 0

    def restart(self) -> None:
        """One more episode restarted after an environment failure."""
        self.restarts += 1

    def start_version(self) -> float:
        """The group's start version: the oldest of its kept and running episodes'
        (exact: an episode's start version is fixed when it starts); inf if none."""
        starts = [*self.kept, *(r.episode.start_version for r in self.runs.values())]
        return float(min(starts, default=float("inf")))

    def new_run(self, settings: EpisodeSettings, start_version: int) -> tuple[int, EpisodeRun]:
        """A fresh episode of the group (next launch index, the group's env seed, a
        fresh environment), registered as running; its launch index and run."""
        index, self.next_index = self.next_index, self.next_index + 1
        env = settings.make_env()
        episode = Episode(
            renderer_for(env, settings.renderer),
            settings.limits,
            prompt_id=self.prompt.prompt_id,
            episode_index=index,
            env_seed=int(self.prompt.meta["env_seed"]),
            start_version=start_version,
            max_context_tokens=settings.max_context_tokens,
        )
        run = self.runs[index] = EpisodeRun(episode, env)
        return index, run

    def cancel(self, calls: EnvCalls, counters: collections.Counter, counter: str) -> None:
        """Stop every running episode (each counted under ``counter``): a pending
        environment call is cancelled (its environment closed when it returns), an
        idle environment closed now."""
        for run in self.runs.values():
            counters[counter] += 1
            if run.call is not None:
                calls.cancel(run.call)
            elif run.env is not None:
                close_env(run.env, counters)
        self.runs.clear()
