"""Dual replay cycle: each learner batch = fresh cycle + replay cycle (thread- and clock-free).

ReFlow (arXiv 2610.21640) mixes fresh samples from the generation servers (the
existing alpha-bounded path, each trained once) with samples replayed from a
buffer of recent trajectories. Its paper is not available; the mechanics here
follow Marin (advantages fixed at ingestion) and RePO (arXiv 2506.09340: replay
per prompt, joint or split advantage normalisation).

Per learner step the runtime calls ``compose`` once with the fresh samples it
is about to train (and their advantages) and the replay ratio rho chosen for the
step (a controller's or a fixed schedule's). In this order it:

1. draws the replay cycle from the buffer *before* ingesting, so a fresh sample
   is never replayed in the step it is trained fresh;
   - buffer-wide samplers: n_replay = round(rho * n_fresh / (1 - rho)) trajectories,
     so replayed / (fresh + replayed) = rho;
   - per-prompt (RePO): for each fresh prompt with g samples, k = round(rho * g /
     (1 - rho)) earlier samples of the same prompt;
2. sets the advantages of the two cycles (``advantages``): "fixed" keeps the fresh
   advantages as given and the stored ones for replayed samples (Marin); "split"
   keeps the fresh ones and normalises each prompt's replayed set on its own;
   "joint" renormalises each prompt's fresh + replayed samples together;
3. ingests the fresh samples with the advantages they were given;
4. returns the mixed batch with a cycle label per sample and the step's metrics.

A replayed sample keeps its stored behaviour logprobs and per-token versions,
so the learner's importance ratios (and off-policy correction chosen by name,
``algorithms.cycle_loss``) are taken against the policy that generated it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxflash.algorithms.advantages import ADVANTAGE_ESTIMATORS
from jaxflash.algorithms.cycle_advantages import cycle_advantages
from jaxflash.replay.replay_buffer import ReplayBuffer
from jaxflash.replay.replay_entry import Replayed, prompt_key
from jaxflash.types import Sample

ADVANTAGE_MODES = ("fixed", "joint", "split")
FRESH, REPLAY = 0, 1


def replay_count(n_fresh: int, replay_ratio: float) -> int:
    """Replayed samples to add to ``n_fresh`` fresh ones so that their share is rho.

    round(rho * n_fresh / (1 - rho)); rho = 0 gives 0 (plain async).

    Raises:
      ValueError: rho outside [0, 1) or n_fresh < 0.
    """
    if not 0.0 <= replay_ratio < 1.0:
        raise ValueError(f"replay_ratio must be in [0, 1), got {replay_ratio}")
    if n_fresh < 0:
        raise ValueError(f"n_fresh must be >= 0, got {n_fresh}")
    return int(round(replay_ratio * n_fresh / (1.0 - replay_ratio)))


def fresh_groups_needed(batch_groups: int, replay_ratio: float) -> int:
    """Fresh groups per step when replay fills a share rho of ``batch_groups`` (>= 1)."""
    if not 0.0 <= replay_ratio < 1.0:
        raise ValueError(f"replay_ratio must be in [0, 1), got {replay_ratio}")
    return max(1, int(round((1.0 - replay_ratio) * batch_groups)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DualCycleConfig:
    """How the two cycles' advantages are set.

    Attributes:
      advantages: "fixed" (as ingested; Marin) | "split" | "joint" (RePO; need a
        per_prompt buffer and per-sequence advantages).
      estimator: ``ADVANTAGE_ESTIMATORS`` name used by "split" / "joint" (None
        there means "grpo"); must stay None with "fixed", which recomputes nothing.
    """

    advantages: str = "fixed"
    estimator: str | None = None

    def __post_init__(self) -> None:
        if self.advantages not in ADVANTAGE_MODES:
            raise ValueError(
                f"DualCycleConfig.advantages {self.advantages!r} not in {ADVANTAGE_MODES}"
            )
        if self.advantages == "fixed" and self.estimator is not None:
            raise ValueError(
                "DualCycleConfig.estimator would be ignored with advantages='fixed' (nothing "
                "is recomputed); leave it None or choose 'joint' / 'split'"
            )
        if self.estimator is not None and self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"DualCycleConfig.estimator {self.estimator!r} not in "
                f"{sorted(ADVANTAGE_ESTIMATORS)}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedBatch:
    """One learner step's samples: the fresh cycle first, then the replay cycle.

    Attributes:
      samples: fresh samples in the order given, then replayed ones in draw order.
      advantages: per sample float32 [] or [T_resp] (what ``pack_batch`` /
        ``pack_episode_batch`` take).
      cycle_b: int8 [N], 0 = fresh, 1 = replay (rows of the packed batch).
      replayed: the Replayed records (uid, age, replay_count) of the replay cycle.
      metrics: per-step values (see ``DualCycleComposer.compose``).
    """

    samples: tuple[Sample, ...]
    advantages: tuple[np.ndarray, ...]
    cycle_b: np.ndarray
    replayed: tuple[Replayed, ...]
    metrics: dict[str, Any]


class DualCycleComposer:
    """Builds each step's mixed batch from fresh samples and a ReplayBuffer."""

    def __init__(self, buffer: ReplayBuffer, config: DualCycleConfig | None = None):
        config = config or DualCycleConfig()
        if config.advantages != "fixed" and not buffer.config.per_prompt:
            raise ValueError(
                f"DualCycleConfig.advantages={config.advantages!r} normalises each prompt's "
                f"fresh and replayed samples; it needs ReplayConfig.sampler='per_prompt', got "
                f"{buffer.config.sampler!r}"
            )
        self.buffer = buffer
        self.config = config

    def _draw(self, samples: Sequence[Sample], rho: float, v: int) -> tuple[list[Replayed], int]:
        if self.buffer.config.per_prompt:
            sizes: dict[str, int] = {}
            for s in samples:
                key = prompt_key(s.prompt_tokens)
                sizes[key] = sizes.get(key, 0) + 1
            requests = [(k, replay_count(g, rho)) for k, g in sizes.items()]
            wanted = sum(k for _, k in requests)
            return self.buffer.sample_for_prompts(requests, learner_version=v), wanted
        wanted = replay_count(len(samples), rho)
        return self.buffer.sample(wanted, learner_version=v), wanted

    def _advantages(
        self, samples: Sequence[Sample], fresh_adv: list[np.ndarray], replayed: list[Replayed]
    ) -> list[np.ndarray]:
        mode = self.config.advantages
        stored = [r.advantage for r in replayed]
        if mode == "fixed" or not replayed:
            return fresh_adv + stored
        everything = list(samples) + [r.sample for r in replayed]
        if any(a.ndim for a in fresh_adv + stored):
            raise ValueError(
                f"advantages={mode!r} recomputes per-sequence advantages from rewards; "
                "per-token (multi-turn) advantages can only be replayed with 'fixed'"
            )
        is_replay = np.array([False] * len(samples) + [True] * len(replayed))
        adv = cycle_advantages(
            [s.reward for s in everything],
            [prompt_key(s.prompt_tokens) for s in everything],
            is_replay,
            mode=mode,
            estimator=self.config.estimator or "grpo",
        )
        out = [np.asarray(a, np.float32) for a in adv]
        if mode == "split":  # the fresh set keeps the runtime's own normalisation
            out[: len(samples)] = fresh_adv
        return out

    def compose(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[Any],
        *,
        learner_version: int,
        replay_ratio: float,
    ) -> MixedBatch:
        """Mix the fresh samples of this step with a replay cycle drawn at rho.

        Args:
          samples: the fresh samples trained at ``learner_version`` (scored).
          advantages: their advantages (float or float [T_resp] each).
          learner_version: the learner version of this step.
          replay_ratio: rho in [0, 1): target share of replayed samples.

        Returns:
          MixedBatch. metrics: ``cycle_fresh_samples``, ``cycle_replay_samples``,
          ``cycle_replay_requested``, ``cycle_replay_shortfall`` (requested - drawn),
          ``cycle_replay_ratio_target``, ``cycle_replay_ratio`` (drawn share),
          ``replay_age_mean`` / ``replay_age_max`` (when any were drawn),
          ``replay_age_hist`` [max_age + 1], ``replay_reuse_hist`` [max_reuse + 1]
          (by replay count of the drawn samples), ``cycle_fresh_stored`` (stored this step),
          and the buffer's cumulative counters as ``replay_<name>``.

        Raises:
          ValueError: lengths differ, a bad rho, a bad sample or advantage, a
            learner version lower than one seen before, or per-token advantages
            with "joint" / "split".
        """
        if len(samples) != len(advantages):
            raise ValueError(f"compose: {len(samples)} samples but {len(advantages)} advantages")
        replay_count(len(samples), replay_ratio)  # validates rho
        v = int(learner_version)
        replayed, wanted = self._draw(samples, replay_ratio, v)
        fresh_adv = [np.asarray(a, np.float32) for a in advantages]
        mixed_adv = self._advantages(samples, fresh_adv, replayed)
        before = self.buffer.counters()["ingested"]
        self.buffer.ingest(samples, fresh_adv, learner_version=v)
        cfg = self.buffer.config
        ages = np.array([r.age for r in replayed], np.int64)
        uses = np.array([r.replay_count for r in replayed], np.int64)
        n = len(samples) + len(replayed)
        metrics: dict[str, Any] = {
            "cycle_fresh_samples": len(samples),
            "cycle_replay_samples": len(replayed),
            "cycle_replay_requested": wanted,
            "cycle_replay_shortfall": wanted - len(replayed),
            "cycle_replay_ratio_target": float(replay_ratio),
            "cycle_replay_ratio": len(replayed) / n if n else 0.0,
            "replay_age_hist": np.bincount(ages, minlength=cfg.max_age + 1).tolist(),
            "replay_reuse_hist": np.bincount(uses, minlength=cfg.max_reuse + 1).tolist(),
            "cycle_fresh_stored": self.buffer.counters()["ingested"] - before,
            **{f"replay_{k}": c for k, c in self.buffer.counters().items()},
        }
        if len(replayed):
            metrics["replay_age_mean"] = float(ages.mean())
            metrics["replay_age_max"] = int(ages.max())
        return MixedBatch(
            samples=tuple(samples) + tuple(r.sample for r in replayed),
            advantages=tuple(mixed_adv),
            cycle_b=np.array([FRESH] * len(samples) + [REPLAY] * len(replayed), np.int8),
            replayed=tuple(replayed),
            metrics=metrics,
        )
