"""What an agentic run adds around the one loop (``runtime.loop``): environments as data.

With ``env.name`` set, ``runtime.loop.run``'s workload (``runtime.workloads.workload``) is an
``EpisodeRollout`` instead of a prompt task and a reward pool:

* groups: ``EnvGroupSource`` yields group ``g`` = environment seed ``g`` of the
  train split (a ``Prompt`` placeholder whose ``meta["env_seed"]`` the environment
  manager reads; the cursor goes into the checkpoint like a data cursor), played
  by the environment manager (``dispatch``: ``runtime.rollout.episode_dispatch``);
* the learner batch: per-token advantages over each group's episodes
  (``envs.training.sample_token_advantages``, trajectory or step level), packed
  with the response mask (``learner.episode_batching.pack_episode_batch``: only
  sampled tokens carry loss);
* evaluation (``held_out``, an ``EpisodeHeldOut``): success rate on the eval split's
  seeds, mean@n with its standard error over seeds (``envs.calibration.calibrate_success``,
  lockstep rounds with the run's engine and current weights), reported as
  ``eval_accuracy``;
* per-step episode metrics (``workloads.episode_metrics``), including the bias of
  dropping stale groups.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxflash.envs.calibration import calibrate_success
from jaxflash.envs.chat import TurnRenderer, renderer_for
from jaxflash.envs.registry import env_config, make_env
from jaxflash.envs.training import sample_token_advantages
from jaxflash.learner.episode_batching import pack_episode_batch
from jaxflash.replay.groups import Group
from jaxflash.runtime.config.env_spec import EnvSpec
from jaxflash.runtime.config.prompt_limits import PromptLengths
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.config.specs import ConfigError, EvalSpec, ModelSpec
from jaxflash.runtime.model_setup import describe_source
from jaxflash.runtime.rollout.env_calls import close_env
from jaxflash.runtime.rollout.episode_dispatch import episode_dispatch
from jaxflash.runtime.rollout.episode_groups import EpisodeSettings
from jaxflash.runtime.rollout.settings import WorkloadRollout
from jaxflash.runtime.workloads.episode_metrics import episode_metrics
from jaxflash.runtime.workloads.learner_batch import LearnerBatch
from jaxflash.types import Prompt, Sample

FIRST_PROMPTS_MEASURED = 16
"""Seeds of each split whose first prompt is rendered at start to check it fits."""
AGENT_FIRST_PROMPTS = 2
"""The same for an agent (each is a session whose agent runs to its first request)."""


class EnvGroupSource:
    """Groups 0, 1, 2, ...: group g plays environment seed g (``take``, ``cursor``).

    Args:
      env_name: for the placeholder's text.
      start: the first group id (a checkpoint's cursor).
    """

    def __init__(self, env_name: str, *, start: int = 0) -> None:
        self.env_name, self.cursor = env_name, int(start)

    def group(self, group_id: int) -> Prompt:
        """The placeholder ``Prompt`` of a group (its tokens come from the environment)."""
        return Prompt(
            prompt_id=group_id,
            text=f"{self.env_name} seed {group_id}",
            prompt_tokens=np.zeros((0,), np.int32),
            answer="",
            meta={"env_seed": group_id},
        )

    def take(self, n: int) -> list[Prompt]:
        out = [self.group(self.cursor + i) for i in range(n)]
        self.cursor += n
        return out


class EpisodeRollout:
    """The environment side of an agentic experiment.

    Args:
      env: the ``env`` section, ``name`` set.
      tokenizer: the policy's tokenizer (chat template, stop ids).
      rollout: the ``rollout`` section (G, redundancy, sampling, slots, deadlines).
      eval: the ``eval`` section (episodes per held-out seed).
      advantage: the advantage estimator's name. seed: the run seed.
      model: the ``model`` section (named when its chat template cannot be extended).

    Raises:
      ConfigError: the environment cannot be built, the chat template cannot be
        extended turn by turn (``envs.chat.TurnRenderer``; names the model), or a
        first prompt (rendered for ``FIRST_PROMPTS_MEASURED`` seeds of each split)
        does not leave room for a turn in ``env.max_context_tokens`` (names the field).
    """

    def __init__(
        self, env: EnvSpec, tokenizer: Any, *, rollout: RolloutSpec, eval: EvalSpec,
        advantage: str, seed: int, model: ModelSpec,
    ) -> None:  # fmt: skip
        spec = env
        if not spec.name:
            raise ValueError("EpisodeRollout needs env.name")
        self.spec, self.tokenizer, self._rollout, self._advantage = (
            env,
            tokenizer,
            rollout,
            advantage,
        )
        self.limits = env_config(spec.name, **spec.env_options("train"))
        try:  # a template that cannot be extended turn by turn is refused here, not mid-run
            self.renderer = TurnRenderer(tokenizer, system_prompt=spec.system_prompt or None)
        except ValueError as e:
            raise ConfigError(f"model {describe_source(model)}: {e}") from None
        self._latency = spec.latency()
        self._instances = itertools.count()
        self.agents = None  # env.name="agent": the endpoint and its sessions
        if spec.name == "agent":
            from jaxflash.runtime.agents.host import AgentHost  # noqa: PLC0415

            try:
                self.agents = AgentHost(self.limits)
            except ValueError as e:  # AgentContractError too: names env.options.<field>
                raise ConfigError(f"env.name='agent': {e}") from None
        self.make_eval_env: Callable[[], Any] = self._env_maker("eval")
        self.first_prompt_lengths = self._measure_first_prompts()
        self.held_out = EpisodeHeldOut(
            make_eval_env=self.make_eval_env, renderer=self.renderer, seeds=spec.eval_seeds,
            n=eval.samples_per_prompt, sampling=rollout.sampling,
            max_context_tokens=spec.max_context_tokens, episodes_per_batch=rollout.num_slots,
            seed=seed,
        )  # fmt: skip

    def make_train_env(self) -> Any:
        """A fresh train-split environment; with ``env.latency_*`` each instance draws its
        own latencies (seeded by the instance number), so the episodes of a group (one
        map) straggle independently -- what redundancy is for."""
        if self.agents is not None:
            return self.agents.make_env("train")
        k = next(self._instances)
        latency = self._latency and dataclasses.replace(self._latency, seed=k)
        return make_env(self.spec.name, latency=latency, **self.spec.env_options("train"))

    def _env_maker(self, split: str) -> Callable[[], Any]:
        """A fresh environment of ``split`` per call (an agent session with an agent)."""
        if self.agents is not None:
            return functools.partial(self.agents.make_env, split)
        return functools.partial(make_env, self.spec.name, **self.spec.env_options(split))

    def _measure_first_prompts(self) -> list[int]:
        lengths = []
        # An agent's first prompt needs its first request: a few sessions suffice.
        seeds = range(AGENT_FIRST_PROMPTS if self.agents else FIRST_PROMPTS_MEASURED)
        for split in ("train", "eval"):
            try:  # a tool environment whose sandbox cannot start says why here
                envs = [self._env_maker(split)() for _ in seeds]
            except RuntimeError as e:
                raise ConfigError(f"env.name={self.spec.name!r}: {e}") from None
            try:
                for seed, env in zip(seeds, envs, strict=True):
                    renderer = renderer_for(env, self.renderer)
                    lengths.append(len(renderer.first_prompt(env.reset(seed))))
            except Exception as e:
                raise ConfigError(f"env.name={self.spec.name!r}: reset failed: {e!r}") from None
            finally:
                for env in envs:
                    close_env(env, collections.Counter())
        room = self.spec.max_context_tokens - max(lengths)
        if room < 2:
            raise ConfigError(
                f"env.max_context_tokens={self.spec.max_context_tokens} leaves no room for a "
                f"turn after the first prompt ({max(lengths)} tokens); raise it"
            )
        return lengths

    def prompt_lengths(self) -> PromptLengths:
        """The first prompts measured, as ``run_config.json`` records a task's."""
        lens = self.first_prompt_lengths
        return PromptLengths(
            measured=len(lens),
            every_row=False,
            shortest=min(lens),
            longest=max(lens),
            limit=self._rollout.max_prefill_length,
            derived=True,
            too_long=0,
        )

    def _batch_timeout_s(self) -> float:
        """How long the loop waits for a batch before giving up (a safety net: every
        turn and environment call has its own deadline, retried or restarted)."""
        r, limits = self._rollout, self.limits
        turn_s = r.sample_deadline_s * (r.max_retries + 1) + limits.step_timeout_s
        episode_s = limits.step_timeout_s + limits.max_turns * turn_s
        return episode_s * (self.spec.max_env_restarts + 1) * (r.async_ratio + 1)

    def describe(self) -> str:
        """One console line."""
        s, lens = self.spec, self.first_prompt_lengths
        return (
            f"environment {s.name} ({self.limits.max_turns} turns x "
            f"{self.limits.max_tokens_per_turn} tokens, step deadline "
            f"{self.limits.step_timeout_s:g} s); first prompts {min(lens)}-{max(lens)} tokens, "
            f"context limit {s.max_context_tokens} (env.max_context_tokens); "
            f"{self._rollout.group_size} + {self._rollout.group_redundancy} episodes "
            f"per group; {s.advantage_level}-level advantages"
        )

    # ------------------------------------------------------------------ the scheduler's parts

    def rollout(self, start: int, open_ids: Sequence[int]) -> WorkloadRollout:
        """Groups from ``start`` (the checkpoint's cursor), the groups in flight at the
        checkpoint (played again from scratch) and the environment manager
        (``rollout.episode_dispatch``) playing each group's episodes; no reward workers:
        the environments score them."""
        source = EnvGroupSource(self.spec.name, start=start)
        resume = tuple(source.group(g) for g in sorted(open_ids))
        dispatch = episode_dispatch(self.episode_settings())
        return WorkloadRollout(source, resume, dispatch, batch_timeout_s=self._batch_timeout_s())

    @property
    def plays_episodes(self) -> bool:
        """True: a "prompt" is a group of episodes."""
        return True

    def episode_settings(self) -> EpisodeSettings:
        """How the environment manager plays episodes (train split, redundancy)."""
        return EpisodeSettings(
            make_env=self.make_train_env,
            renderer=self.renderer,
            limits=self.limits,
            max_context_tokens=self.spec.max_context_tokens,
            redundancy=self._rollout.group_redundancy,
            max_env_restarts=self.spec.max_env_restarts,
        )

    # ------------------------------------------------------------------ learner, evaluation

    def report(self, batch: Any, tracker: Any) -> None:
        """The step's ``episodes`` section (``episode_metrics``): turns, environment
        time, success over the trained episodes, and the stale-dropped ones' bias."""
        metrics = episode_metrics(batch.groups, batch.dropped)
        if self.agents is not None:  # the endpoint's sessions, since the run began
            metrics = {**metrics, **self.agents.counts()}
        tracker.report("episodes", metrics)

    def learner_batch(
        self,
        groups: Sequence[Group],
        *,
        pad_id: int,
        max_len: int,
        num_sequences: int,
        length_multiple: int = 32,
    ) -> LearnerBatch:
        """Per-token advantages of the groups' episodes, packed with their response masks.

        Only tokens the policy sampled carry loss (``pack_episode_batch``); an episode's
        scalar entry in ``LearnerBatch.advantages`` is the mean over its sampled tokens.
        """
        if not groups:
            return LearnerBatch(None, (), np.zeros((0,), np.float32))
        per_token = sample_token_advantages(
            [g.samples for g in groups],
            level=self.spec.advantage_level,
            gamma=self.spec.gamma,
            estimator=self._advantage,
        )
        samples = tuple(s for g in groups for s in g.samples)
        advantages = [a for row in per_token for a in row]
        scalar = np.array(
            [
                a[np.asarray(s.response_mask) > 0].mean()
                for s, a in zip(samples, advantages, strict=True)
            ],
            np.float32,
        )
        batch = pack_episode_batch(
            samples,
            advantages,
            pad_id=pad_id,
            max_len=max_len,
            num_sequences=num_sequences,
            length_multiple=length_multiple,
        )
        return LearnerBatch(batch, samples, scalar)

    def close(self) -> None:
        """The agent endpoint stops (the environment manager closes the environments)."""
        if self.agents is not None:
            self.agents.close()


class EpisodeHeldOut:
    """An environment's held-out seeds (``HeldOut``): success rate, ``seeds`` eval-split
    seeds x ``n`` episodes (lockstep rounds of ``episodes_per_batch``), scored by the
    environments.

    Args:
      make_eval_env: a fresh eval-split environment. renderer: the turn renderer.
      seeds: held-out seeds (``env.eval_seeds``; 0: no evaluation). n: episodes each.
      sampling, max_context_tokens, episodes_per_batch, seed: as the run's rollout.
    """

    unit = "episodes"

    def __init__(
        self, *, make_eval_env: Callable[[], Any], renderer: Any, seeds: int, n: int,
        sampling: Any, max_context_tokens: int, episodes_per_batch: int, seed: int,
    ) -> None:  # fmt: skip
        self._make_env, self._renderer, self._seeds, self._n = make_eval_env, renderer, seeds, n
        self._sampling, self._max_context = sampling, max_context_tokens
        self._per_batch, self._seed = episodes_per_batch, seed

    @property
    def size(self) -> int:
        """Held-out seeds (``env.eval_seeds``; 0: no evaluation)."""
        return self._seeds

    def describe(self) -> str:
        """What one evaluation runs, e.g. "8 seeds x 4 episodes"."""
        return f"{self.size} seeds x {self._n} episodes"

    def evaluate(
        self, generate: Any, *, version: int,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Held-out success at ``version``, episodes generated by ``generate``."""

        def play(requests: Sequence[Any]) -> list[Sample]:
            return generate.run(list(requests), version=version)

        res = calibrate_success(
            self._make_env,
            self._renderer,
            play,
            seeds=list(range(self._seeds)),
            n=self._n,
            sampling=self._sampling,
            max_context_tokens=self._max_context,
            episodes_per_batch=self._per_batch,
            sampling_seed=self._seed,
            progress=progress,
        )
        return {
            "eval_accuracy": res.success_mean,
            "eval_accuracy_stderr": res.success_stderr,
            "eval_prompts": len(res.seeds),
            "eval_failed": res.env_failures,
            "eval_invalid_action_rate": res.invalid_action_rate,
            "eval_turns_per_episode": res.mean_turns,
        }
