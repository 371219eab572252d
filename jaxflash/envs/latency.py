"""Environment latency drawn from a distribution, for benchmarks of environment-level async.

``LatencyEnv(env, LatencyConfig(mean_s=mu, std_s=sigma))`` makes every ``step``
(and optionally ``reset``) of ``env`` wait a time drawn from N(mu, sigma)
truncated at 0 (conditioned on >= 0: negative draws are redrawn, so the time is
never 0 by clipping). ROLL Flash (arXiv 2510.11345) measures its environment-level
async with such latencies (sigma = 10 s: 892 s -> 362 s per step).

Stragglers: with ``straggler_prob`` an episode is a straggler (decided at reset);
its every latency is multiplied by ``straggler_factor`` -- the case redundant
environments are for.

The draws are a pure function of ``(config.seed, episode seed, call number)``, so
the synchronous and asynchronous runs of a benchmark see identical latencies. The
wait is a blocking ``sleep`` (it releases the GIL, so other episodes' threads run);
the drawn value is also reported in ``info["latency_s"]`` for callers that prefer
to wait themselves (pass ``sleep=lambda s: None``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from jaxflash.envs.base import EnvConfig, StepResult, TextEnv


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatencyConfig:
    """Latency distribution.

    Attributes:
      mean_s, std_s: mu and sigma of the normal before truncation at 0 (seconds).
      on_reset: also delay ``reset``.
      straggler_prob: probability that an episode is a straggler, in [0, 1].
      straggler_factor: latency multiplier of a straggler episode (>= 1).
      seed: base seed of the draws.
    """

    mean_s: float = 0.0
    std_s: float = 0.0
    on_reset: bool = False
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean_s) and math.isfinite(self.std_s) and self.std_s >= 0):
            raise ValueError(
                f"LatencyConfig: mean_s must be finite and std_s finite and >= 0, got "
                f"mean_s={self.mean_s}, std_s={self.std_s}"
            )
        if self.std_s == 0 and self.mean_s < 0:
            raise ValueError(f"LatencyConfig: mean_s={self.mean_s} < 0 with std_s=0")
        if self.mean_s < 0 and -self.mean_s / max(self.std_s, 1e-300) > 5:
            raise ValueError(  # P(draw >= 0) < 3e-7: redrawing would practically never end
                f"LatencyConfig: mean_s={self.mean_s} is more than 5 std_s below 0"
            )
        if not 0.0 <= self.straggler_prob <= 1.0:
            raise ValueError(
                f"LatencyConfig.straggler_prob must be in [0, 1], got {self.straggler_prob}"
            )
        if not self.straggler_factor >= 1.0:
            raise ValueError(
                f"LatencyConfig.straggler_factor must be >= 1, got {self.straggler_factor}"
            )


def truncated_normal(rng: np.random.Generator, mean: float, std: float) -> float:
    """One draw of N(mean, std) conditioned on >= 0 (rejection sampling)."""
    if std == 0:
        return max(mean, 0.0)
    while True:
        x = float(rng.normal(mean, std))
        if x >= 0:
            return x


class LatencyEnv:
    """Wraps a TextEnv; each call waits a drawn latency before delegating.

    Args:
      env: the wrapped environment (its ``config`` is exposed as this one's).
      latency: the distribution.
      sleep: how to wait (``time.sleep``; tests pass a recorder).
    """

    def __init__(
        self,
        env: TextEnv,
        latency: LatencyConfig,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.env = env
        self.latency = latency
        self._sleep = sleep
        self._rng = np.random.default_rng([latency.seed, 0])
        self._scale = 1.0

    @property
    def config(self) -> EnvConfig:
        return self.env.config

    @property
    def is_straggler(self) -> bool:
        """Whether the current episode was drawn as a straggler."""
        return self._scale > 1.0

    def _wait(self) -> float:
        cfg = self.latency
        delay = truncated_normal(self._rng, cfg.mean_s, cfg.std_s) * self._scale
        if delay > 0:
            self._sleep(delay)
        return delay

    def reset(self, seed: int) -> str:
        cfg = self.latency
        # Non-negative entropy words for the seed sequence: the episode seed may be any int.
        self._rng = np.random.default_rng(
            [cfg.seed, 1, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF]
        )
        straggler = cfg.straggler_prob > 0 and self._rng.random() < cfg.straggler_prob
        self._scale = cfg.straggler_factor if straggler else 1.0
        if cfg.on_reset:
            self._wait()
        return self.env.reset(seed)

    def step(self, action_text: str) -> StepResult:
        delay = self._wait()
        result = self.env.step(action_text)
        if isinstance(result, tuple) and len(result) == 5 and isinstance(result[4], dict):
            result[4]["latency_s"] = delay  # a malformed result is left for checked_step
        return result

    def close(self) -> None:
        self.env.close()
