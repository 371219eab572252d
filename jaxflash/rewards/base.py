"""The reward interface: results, the name registry and weighted combinations.

A reward function sees the *response text only* (never the prompt) and the
reference answer, and returns a `RewardResult`. The same function scores
training samples and evaluation samples, so a number on a dashboard means the
same thing in both places.

Reward functions here are plain, synchronous and free of timeouts: deadlines
are enforced by `jaxflash.runtime.rollout.reward_pool`, which runs them in worker
processes and kills a worker that hangs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardResult:
    """The score of one response.

    Attributes:
      score: the scalar reward (float, finite); 0.0 when scoring failed.
      components: named sub-scores (floats), e.g. {"correct": 1.0, "format": 0.0}.
      error: None when scoring ran to completion; otherwise why it did not
        (exception, timeout, unparsable reference). A wrong answer is not an error.
    """

    score: float
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.score, bool) or not isinstance(self.score, int | float):
            raise TypeError(f"RewardResult.score must be a float, got {type(self.score).__name__}")
        if not math.isfinite(self.score):
            raise ValueError(f"RewardResult.score must be finite, got {self.score}")
        for name, value in self.components.items():
            if not isinstance(name, str) or isinstance(value, bool):
                raise TypeError(f"RewardResult.components[{name!r}] must map str -> float")
            if not isinstance(value, int | float):
                raise TypeError(
                    f"RewardResult.components[{name!r}] must be a float, got {type(value).__name__}"
                )
        if self.error is not None and not isinstance(self.error, str):
            raise TypeError(f"RewardResult.error must be str or None, got {type(self.error)}")


RewardFn = Callable[[str, str], RewardResult]
"""(response_text, reference_answer) -> RewardResult. Must be picklable to run in
the reward pool: a module-level function or an instance of a module-level class."""

REWARD_FNS: dict[str, RewardFn] = {}
"""Reward functions by name. Filled by `register` in `rewards.math_reward` and
`rewards.format` (imported by `jaxflash.rewards`, so the registry is complete
whenever any `jaxflash.rewards` module is imported)."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to `REWARD_FNS` under `name`.

    Raises:
      ValueError: `name` is already registered.
    """

    def add(fn: RewardFn) -> RewardFn:
        if name in REWARD_FNS:
            raise ValueError(f"reward function {name!r} is already registered")
        REWARD_FNS[name] = fn
        return fn

    return add


def get_reward_fn(name: str) -> RewardFn:
    """Look up a reward function by name.

    Raises:
      KeyError: unknown name (the message lists the known names).
    """
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise KeyError(f"unknown reward function {name!r}; known: {sorted(REWARD_FNS)}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CombinedReward:
    """Weighted sum of registered reward functions: score = sum_i w_i * score_i.

    A class rather than a closure so that it pickles into reward-pool workers
    (functions are looked up by name in the worker).

    Components hold each part's score under its name, plus its own components
    as "<name>/<component>". If any part reports an error the combined error
    lists them all ("<name>: <error>"); the parts that did score still count.

    Attributes:
      weights: {registered name: weight}; non-empty, finite weights.
    """

    weights: Mapping[str, float]

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("CombinedReward.weights must not be empty")
        for name, weight in self.weights.items():
            get_reward_fn(name)  # raises KeyError naming the unknown function
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise TypeError(f"CombinedReward.weights[{name!r}] must be a float, got {weight!r}")
            if not math.isfinite(weight):
                raise ValueError(f"CombinedReward.weights[{name!r}] must be finite, got {weight}")
        # Freeze a private copy so later edits of the caller's dict change nothing.
        object.__setattr__(self, "weights", dict(self.weights))

    def __call__(self, response_text: str, answer: str) -> RewardResult:
        score = 0.0
        components: dict[str, float] = {}
        errors: list[str] = []
        for name, weight in self.weights.items():
            part = get_reward_fn(name)(response_text, answer)
            score += float(weight) * part.score
            components[name] = part.score
            for sub, value in part.components.items():
                components[f"{name}/{sub}"] = value
            if part.error is not None:
                errors.append(f"{name}: {part.error}")
        return RewardResult(
            score=score, components=components, error="; ".join(errors) if errors else None
        )


def combined(weights: Mapping[str, float]) -> CombinedReward:
    """Build a reward that is a weighted sum of registered rewards.

    Example: ``combined({"math": 1.0, "format_boxed": 0.1})`` gives 1.1 for a
    correct boxed answer, 1.0 for a correct unboxed one, 0.1 for a wrong boxed one.

    Raises:
      KeyError: a name is not in `REWARD_FNS`.
      ValueError / TypeError: empty weights or a non-finite / non-numeric weight.
    """
    return CombinedReward(weights=weights)


def as_reward_fn(spec: str | RewardFn | Mapping[str, float] | Any) -> RewardFn:
    """Resolve a reward given by name, by weights ({name: weight}) or as a callable.

    Raises:
      KeyError: unknown name.
      TypeError: `spec` is none of the above.
    """
    if isinstance(spec, str):
        return get_reward_fn(spec)
    if isinstance(spec, Mapping):
        return combined(spec)
    if callable(spec):
        return spec
    raise TypeError(f"reward must be a name, a {{name: weight}} dict or a callable, got {spec!r}")
