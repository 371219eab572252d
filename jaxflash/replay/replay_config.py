"""Replay buffer configuration: caps and the sampling rule, validated eagerly.

The rules and the sources they follow are described in ``replay_buffer`` and
``replay_sampling``.
"""

from __future__ import annotations

import dataclasses

from jaxflash.replay.replay_sampling import BUFFER_RULES, FRESHNESS_BASES, PROMPT_STRATEGIES

SAMPLERS = (*BUFFER_RULES, "per_prompt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """What the buffer keeps and how it draws (validated eagerly).

    Attributes:
      capacity: trajectories kept; beyond it the oldest are evicted (counted).
      max_age: largest age, in policy versions, at which a trajectory may still
        be trained (>= 1: a replay happens at least one version after its fresh use).
      max_reuse: replays per trajectory after its fresh use (>= 1); then it retires.
      sampler: "uniform" | "recency" | "freshness" (buffer-wide) | "per_prompt" (RePO).
      recency_exponent: a of the recency weights (i + 1)^a; only for "recency"
        (None there means 1.0).
      freshness_tau: tau of exp(-age / tau), in versions; only for "freshness"
        (None there means 2.0).
      freshness_base: p_base for "freshness": "abs_advantage" (|A| + 1e-6; mean
        |A| over masked tokens for per-token advantages) or "uniform" (1).
      prompt_strategy: "recent" | "highest_reward" | "max_variance"; only for
        "per_prompt" (None there means "recent").
      drop_uniform_groups: do not store groups whose rewards are all equal (their
        group-relative advantages are 0), counted as ``rejected_uniform``.
      seed: seed of the buffer's own generator.

    Fields that a sampler would ignore must stay None (ValueError naming them).
    """

    capacity: int = 1024
    max_age: int = 4
    max_reuse: int = 1
    sampler: str = "uniform"
    recency_exponent: float | None = None
    freshness_tau: float | None = None
    freshness_base: str = "abs_advantage"
    prompt_strategy: str | None = None
    drop_uniform_groups: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("capacity", 1), ("max_age", 1), ("max_reuse", 1)):
            if int(getattr(self, name)) < low:
                raise ValueError(f"ReplayConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"ReplayConfig.sampler {self.sampler!r} not in {SAMPLERS}")
        if self.freshness_base not in FRESHNESS_BASES:
            raise ValueError(
                f"ReplayConfig.freshness_base {self.freshness_base!r} not in {FRESHNESS_BASES}"
            )
        owners = {
            "recency_exponent": "recency",
            "freshness_tau": "freshness",
            "prompt_strategy": "per_prompt",
        }
        ignored = [
            f for f, s in owners.items() if getattr(self, f) is not None and self.sampler != s
        ]
        if ignored:
            raise ValueError(
                f"ReplayConfig: {ignored} would be ignored by sampler={self.sampler!r}; "
                "set only the fields of the chosen sampler"
            )
        if self.recency_exponent is not None and not self.recency_exponent >= 0:
            raise ValueError(
                f"ReplayConfig.recency_exponent must be >= 0, got {self.recency_exponent}"
            )
        if self.freshness_tau is not None and not self.freshness_tau > 0:
            raise ValueError(f"ReplayConfig.freshness_tau must be > 0, got {self.freshness_tau}")
        if self.prompt_strategy is not None and self.prompt_strategy not in PROMPT_STRATEGIES:
            raise ValueError(
                f"ReplayConfig.prompt_strategy {self.prompt_strategy!r} not in {PROMPT_STRATEGIES}"
            )

    @property
    def per_prompt(self) -> bool:
        return self.sampler == "per_prompt"
