"""``env``: the agentic section of an experiment config, and what it changes in the rest.

``EnvSpec`` names a text environment (``envs.registry``) and how its episodes are
played and scored; ``agentic_rollout`` checks the other sections against it
(``data``/``reward`` fields it would silently ignore are refused, naming them) and
derives the engine's lengths from the episode's context and turn budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.config.specs import ConfigError, DataSpec, RewardSpec, check
from jaxflash.types import SamplingParams

ADVANTAGE_LEVELS = ("trajectory", "step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSpec:
    """Agentic RL: episodes in a text environment instead of prompts from ``data``.

    Attributes:
      name: an environment of ``envs.registry.ENVIRONMENTS`` ("" = RLVR on ``data``).
      options: fields of the environment's config (``max_turns``,
        ``max_tokens_per_turn``, ``step_timeout_s``, map size, ...; not ``split``:
        training plays the train split, evaluation the eval split).
      max_context_tokens: prompt + response limit of one episode, in tokens (each
        turn's request is the whole context so far).
      system_prompt: a system message before the first observation ("" = the
        template's default).
      advantage_level: "trajectory" (the episode return, normalised in its group)
        or "step" (each turn's return-to-go).
      gamma: discount per turn of the returns.
      max_env_restarts: episodes restarted per group after environment failures
        before the group fails (``env_failure``).
      eval_seeds: held-out seeds (eval split, seeds 0..n-1) played at each
        evaluation, ``eval.samples_per_prompt`` episodes each.
      latency_mean_s, latency_std_s: extra environment latency per step, N(μ, σ)
        truncated at 0 (``envs.latency``; benchmarks); 0 = none.
      straggler_prob, straggler_factor: an episode is a straggler with this
        probability; its latencies are multiplied by the factor.
    """

    name: str = ""
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_context_tokens: int = 1024
    system_prompt: str = ""
    advantage_level: str = "trajectory"
    gamma: float = 1.0
    max_env_restarts: int = 2
    eval_seeds: int = 32
    latency_mean_s: float = 0.0
    latency_std_s: float = 0.0
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0

    def __post_init__(self) -> None:
        from jaxflash.envs.base import EnvOptionError  # noqa: PLC0415
        from jaxflash.envs.registry import ENVIRONMENTS, env_config  # noqa: PLC0415

        if not self.name:
            changed = [
                f"env.{f.name}"
                for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) != _ENV_DEFAULTS[f.name]
            ]
            check(not changed, f"{', '.join(changed)} set without env.name: RLVR ignores it")
            return
        check(
            self.name in ENVIRONMENTS,
            f"env.name must be one of {sorted(ENVIRONMENTS)} (or '' for RLVR), got {self.name!r}",
        )
        check(isinstance(self.options, Mapping), "env.options must be a mapping")
        check(
            "split" not in self.options,
            "env.options.split: training plays the train split, "
            "evaluation the eval split; remove it",
        )
        known = sorted(f.name for f in dataclasses.fields(ENVIRONMENTS[self.name][0]))
        unknown = sorted(set(self.options) - set(known))
        check(
            not unknown,
            f"{', '.join(f'env.options.{k}' for k in unknown)}: not an option of "
            f"{self.name!r}; its options are {[k for k in known if k != 'split']}",
        )
        try:
            env_config(self.name, **self.options)
        except EnvOptionError as e:
            raise ConfigError(
                f"env.options.{e.field} must be {e.expected}, got {e.value!r}"
            ) from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"env.options: {e}") from None
        check(
            self.max_context_tokens >= 2,
            f"env.max_context_tokens must be >= 2, got {self.max_context_tokens}",
        )
        check(
            self.advantage_level in ADVANTAGE_LEVELS,
            f"env.advantage_level must be one of {ADVANTAGE_LEVELS}, got {self.advantage_level!r}",
        )
        check(0.0 <= self.gamma <= 1.0, f"env.gamma must be in [0, 1], got {self.gamma}")
        check(
            self.max_env_restarts >= 0,
            f"env.max_env_restarts must be >= 0, got {self.max_env_restarts}",
        )
        check(self.eval_seeds >= 0, f"env.eval_seeds must be >= 0, got {self.eval_seeds}")
        try:
            self.latency()
        except ValueError as e:
            raise ConfigError(f"env.latency_* / env.straggler_*: {e}") from None
        check(
            self.name != "agent" or self.latency() is None,
            "env.latency_* / env.straggler_* with env.name='agent': an agent's latency is its own",
        )

    def env_options(self, split: str = "train") -> dict[str, Any]:
        """The environment's config fields for ``split``."""
        return {**self.options, "split": split}

    def latency(self) -> Any:
        """The ``envs.latency.LatencyConfig`` asked for, or None (no extra latency)."""
        from jaxflash.envs.latency import LatencyConfig  # noqa: PLC0415

        if not (self.latency_mean_s or self.latency_std_s or self.straggler_prob):
            return None
        return LatencyConfig(
            mean_s=self.latency_mean_s,
            std_s=self.latency_std_s,
            straggler_prob=self.straggler_prob,
            straggler_factor=self.straggler_factor,
        )


_ENV_DEFAULTS = {
    f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    for f in dataclasses.fields(EnvSpec)
}


def agentic_rollout(
    env: EnvSpec, rollout: RolloutSpec, data: DataSpec, reward: RewardSpec
) -> RolloutSpec:
    """The rollout of an agentic experiment (``env.name`` set), checked and derived.

    An environment replaces the data and the reward, so any ``data.*`` / ``reward.*``
    field set is refused; the engine's prompt limit is the episode's context
    (``env.max_context_tokens`` - 1) and a turn's budget is the environment's
    ``max_tokens_per_turn``.

    Raises:
      ConfigError: a field that would be ignored or contradicts the environment
        (named in the message).
    """
    from jaxflash.envs.registry import env_config  # noqa: PLC0415

    ignored = [f"data.{k}" for k in _changed(data, DataSpec())]
    ignored += [f"reward.{k}" for k in _changed(reward, RewardSpec())]
    check(
        not ignored,
        f"{', '.join(ignored)} set with env.name={env.name!r}: episodes take their "
        "observations and rewards from the environment, which ignores them",
    )
    check(
        rollout.truncation == "none",
        f"rollout.truncation={rollout.truncation!r} with env.name: an episode ends by its "
        "environment or its turn limit; set rollout.truncation='none'",
    )
    context = env.max_context_tokens
    check(  # context - 1: already derived (a copy of a checked config)
        rollout.max_prefill_length in (0, context - 1),
        f"rollout.max_prefill_length={rollout.max_prefill_length} with env.name: it is "
        "derived from env.max_context_tokens (leave it 0)",
    )
    per_turn = env_config(env.name, **env.options).max_tokens_per_turn
    default = SamplingParams().max_new_tokens
    check(
        rollout.sampling.max_new_tokens in (default, per_turn),
        f"rollout.max_new_tokens={rollout.sampling.max_new_tokens} with env.name: a turn's "
        f"budget is env.options.max_tokens_per_turn={per_turn}; leave it unset",
    )
    check(
        per_turn < context,
        f"env.options.max_tokens_per_turn={per_turn} must be < env.max_context_tokens={context}",
    )
    return dataclasses.replace(
        rollout,
        sampling=dataclasses.replace(rollout.sampling, max_new_tokens=per_turn),
        max_prefill_length=context - 1,
    )


def _changed(spec: Any, default: Any) -> dict[str, Any]:
    """Fields of a spec that differ from its default instance."""
    return {
        f.name: getattr(spec, f.name)
        for f in dataclasses.fields(spec)
        if getattr(spec, f.name) != getattr(default, f.name)
    }
