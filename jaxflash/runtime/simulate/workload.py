"""What the simulated servers generate: response lengths, rewards and turns.

Every draw is a pure function of (seed, prompt_id, sample_index), so every mode of
a comparison sees the same sample of the same prompt at the same length (common
random numbers: differences between modes are the modes', not the dice's).

Lengths. A ``LengthModel`` draws one response length (tokens, EOS included) given
a per-prompt scale: ``Geometric`` (a per-token stop probability p, as the
length-controlled model of ``benchmarks/async_vs_sync.py``), ``LogNormal``
(median and σ: the long tail of reasoning responses), ``Mixture`` of them, or
``Replay`` of a run's rollouts.jsonl (per prompt, so lengths stay correlated within
a group). Long-tail reasoning workloads correlate lengths within a prompt (hard
prompts are long for every sample): ``prompt_sigma`` draws a per-prompt scale
exp(σ_p·z_p), z_p ~ N(0, 1). Every length is clipped to [1, max_tokens]; one that
reaches max_tokens is truncated (finish reason LENGTH).

Rewards: each prompt has a pass rate drawn from Beta(a, b); each sample is correct
(reward 1) with that probability -- what dynamic-sampling filters act on.

Turns (agentic workloads): an episode is a list of ``Turn`` s; between two turns the
sample leaves its slot for ``env_latency_s`` (the environment runs) and comes back
with ``observation_tokens`` more context to prefill. ``SimWorkload(episode=...)``
takes any function of (workload, prompt_id, sample_index, rng) returning turns;
``multi_turn`` builds the common one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from typing import Protocol


class LengthModel(Protocol):
    def draw(self, rng: random.Random, scale: float) -> float:
        """One response length in tokens (before clipping) for a prompt of ``scale``."""
        ...


@dataclasses.dataclass(frozen=True)
class Geometric:
    """P(len = k) = (1-p)^(k-1) p: each token is EOS with probability p/scale."""

    p: float

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"Geometric.p must be in (0, 1], got {self.p}")

    def draw(self, rng: random.Random, scale: float) -> float:
        p = min(1.0, self.p / scale)
        if p >= 1.0:
            return 1.0
        return float(math.floor(math.log1p(-rng.random()) / math.log1p(-p)) + 1)  # inverse CDF


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """exp(N(ln(median·scale), σ²)) tokens."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0):
            raise ValueError(f"LogNormal needs median > 0 and sigma >= 0, got {self}")

    def draw(self, rng: random.Random, scale: float) -> float:
        return float(math.exp(math.log(self.median * scale) + self.sigma * rng.gauss(0.0, 1.0)))


@dataclasses.dataclass(frozen=True)
class Mixture:
    """A weighted mixture of length models: ((weight, model), ...)."""

    parts: tuple[tuple[float, LengthModel], ...]

    def __post_init__(self) -> None:
        if not self.parts or any(w <= 0 for w, _ in self.parts):
            raise ValueError("Mixture needs at least one part, every weight > 0")

    def draw(self, rng: random.Random, scale: float) -> float:
        (part,) = rng.choices([m for _, m in self.parts], weights=[w for w, _ in self.parts])
        return part.draw(rng, scale)


@dataclasses.dataclass(frozen=True)
class Replay:
    """Lengths replayed from a run: prompt p of the simulation takes recorded prompt
    ``p mod n`` and its sample i the recorded sample ``i mod m`` (scale ignored)."""

    by_prompt: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.by_prompt or any(not r for r in self.by_prompt):
            raise ValueError("Replay needs at least one prompt with at least one length")

    @classmethod
    def from_rollouts(cls, path: str, *, outcomes: Sequence[str] = ("trained",)) -> Replay:
        """Reads ``response_len`` per prompt from a run's rollouts.jsonl.

        Raises:
          ValueError: no row with one of ``outcomes`` (named, with the file).
        """
        by_pid: dict[int, list[tuple[int, int]]] = {}
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("outcome") in outcomes:
                    by_pid.setdefault(int(row["prompt_id"]), []).append(
                        (int(row["sample_index"]), int(row["response_len"]))
                    )
        if not by_pid:
            raise ValueError(f"{path}: no rollout rows with outcome in {list(outcomes)}")
        return cls(tuple(tuple(n for _, n in sorted(by_pid[p])) for p in sorted(by_pid)))

    def length(self, prompt_id: int, sample_index: int) -> int:
        row = self.by_prompt[prompt_id % len(self.by_prompt)]
        return row[sample_index % len(row)]

    def draw(self, rng: random.Random, scale: float) -> float:
        raise TypeError("Replay lengths are looked up by (prompt, sample): see SimWorkload")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of an episode: tokens generated, then the environment's latency and
    the observation tokens appended before the next turn (ignored on the last)."""

    response_tokens: int
    env_latency_s: float = 0.0
    observation_tokens: int = 0


EpisodeFn = Callable[["SimWorkload", int, int, random.Random], list[Turn]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimWorkload:
    """Response lengths, prompt lengths, rewards and turns of simulated samples.

    Attributes:
      lengths: the length model (tokens per response, or per turn with ``episode``).
      max_tokens: the response budget (max_new_tokens); reaching it truncates.
      prompt_tokens: prompt lengths, cycled by prompt id.
      prompt_sigma: σ_p of the per-prompt length scale exp(σ_p·z_p) (0 = iid).
      pass_alpha, pass_beta: Beta(a, b) of each prompt's pass rate.
      pass_length_power: k >= 0: a prompt's pass rate is divided by its length scale
        to the power k (clipped to [0, 1]): long prompts are hard ones (0 = rate and
        length independent). The staleness study's assumption, not a measurement.
      seed: of every draw.
      episode: optional function returning a sample's turns (default: one turn).
    """

    lengths: LengthModel
    max_tokens: int
    prompt_tokens: tuple[int, ...] = (64,)
    prompt_sigma: float = 0.0
    pass_alpha: float = 1.0
    pass_beta: float = 1.0
    pass_length_power: float = 0.0
    seed: int = 0
    episode: EpisodeFn | None = None
    # Draws made so far, by prompt and by (prompt, sample): each is drawn once.
    _prompts: dict[int, tuple[float, float]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _samples: dict[tuple[int, int], tuple[list[Turn], float]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise ValueError(
                f"SimWorkload needs max_tokens >= 1 and prompt_tokens >= 1, got "
                f"{self.max_tokens}, {self.prompt_tokens}"
            )
        if (
            self.prompt_sigma < 0
            or self.pass_alpha <= 0
            or self.pass_beta <= 0
            or self.pass_length_power < 0
        ):
            raise ValueError(
                "SimWorkload needs prompt_sigma, pass_length_power >= 0 and pass_alpha, "
                f"pass_beta > 0, got {self.prompt_sigma}, {self.pass_length_power}, "
                f"{self.pass_alpha}, {self.pass_beta}"
            )

    def _rng(self, stream: int, *key: int) -> random.Random:
        # One stream per purpose (1 a prompt's draws, 2 a sample's), seeded through a
        # string (hashed with SHA-512 by random.Random): the same on every run.
        return random.Random(":".join(map(str, (self.seed, stream, *key))))

    def prompt_len(self, prompt_id: int) -> int:
        return self.prompt_tokens[prompt_id % len(self.prompt_tokens)]

    def _prompt(self, prompt_id: int) -> tuple[float, float]:
        """(length scale exp(σ_p·z_p), pass rate) of a prompt."""
        got = self._prompts.get(prompt_id)
        if got is None:
            rng = self._rng(1, prompt_id)
            z, rate = rng.gauss(0.0, 1.0), rng.betavariate(self.pass_alpha, self.pass_beta)
            scale = math.exp(self.prompt_sigma * z)
            rate = min(1.0, rate / scale**self.pass_length_power)
            got = self._prompts[prompt_id] = (scale, float(rate))
        return got

    def prompt_scale(self, prompt_id: int) -> float:
        return self._prompt(prompt_id)[0]

    def pass_rate(self, prompt_id: int) -> float:
        return self._prompt(prompt_id)[1]

    def clip(self, tokens: float) -> int:
        return int(min(self.max_tokens, max(1, math.ceil(tokens))))

    def _sample(self, prompt_id: int, sample_index: int) -> tuple[list[Turn], float]:
        key = (prompt_id, sample_index)
        got = self._samples.get(key)
        if got is not None:
            return got
        rng = self._rng(2, prompt_id, sample_index)
        reward = float(rng.random() < self.pass_rate(prompt_id))
        if self.episode is not None:
            turns = self.episode(self, prompt_id, sample_index, rng)
            if not turns or any(t.response_tokens < 1 for t in turns):
                raise ValueError(f"episode of {prompt_id}/{sample_index}: empty or 0-token turn")
        elif isinstance(self.lengths, Replay):
            turns = [Turn(self.clip(self.lengths.length(prompt_id, sample_index)))]
        else:
            turns = [Turn(self.clip(self.lengths.draw(rng, self.prompt_scale(prompt_id))))]
        got = self._samples[key] = (turns, reward)
        return got

    def turns(self, prompt_id: int, sample_index: int) -> list[Turn]:
        """The sample's turns (one unless ``episode`` says otherwise)."""
        return list(self._sample(prompt_id, sample_index)[0])

    def response_len(self, prompt_id: int, sample_index: int) -> int:
        """Tokens the policy generates over all turns."""
        return sum(t.response_tokens for t in self._sample(prompt_id, sample_index)[0])

    def reward(self, prompt_id: int, sample_index: int) -> float:
        """1.0 (correct) with the prompt's pass rate, else 0.0."""
        return self._sample(prompt_id, sample_index)[1]


def multi_turn(
    *, turns: int, env_latency_s: float, env_sigma: float = 0.0, observation_tokens: int = 0
) -> EpisodeFn:
    """An episode of ``turns`` turns: each turn's length from the workload's length
    model (the budget split evenly), an environment latency lognormal around
    ``env_latency_s`` with σ ``env_sigma`` between turns.

    Raises:
      ValueError: turns < 1 or a negative latency.
    """
    if turns < 1 or env_latency_s < 0 or env_sigma < 0:
        raise ValueError(f"multi_turn needs turns >= 1 and latencies >= 0, got {turns}")

    def episode(w: SimWorkload, pid: int, idx: int, rng: random.Random) -> list[Turn]:
        budget = max(1, w.max_tokens // turns)
        out = []
        for _ in range(turns):
            n = int(min(budget, max(1, math.ceil(w.lengths.draw(rng, w.prompt_scale(pid))))))
            lat = (
                env_latency_s * math.exp(env_sigma * rng.gauss(0.0, 1.0))
                if env_sigma
                else env_latency_s
            )
            out.append(Turn(n, lat, observation_tokens))
        return out

    return episode


def reasoning_workload(seed: int = 0) -> SimWorkload:
    """The long-tailed RLVR reasoning workload the benchmarks simulate.

    Response lengths lognormal (median 1,500 tokens, σ = 1) under a 16,384-token
    budget, prompts of 200/350/500 tokens with a per-prompt length scale (σ_p = 0.5),
    pass rates Beta(0.6, 0.6). ROLL Flash (arXiv 2510.11345) gives only its long tail
    in the abstract; these parameters are this project's assumption of it.
    """
    return SimWorkload(
        lengths=LogNormal(median=1500, sigma=1.0),
        max_tokens=16384,
        prompt_tokens=(200, 350, 500),
        prompt_sigma=0.5,
        pass_alpha=0.6,
        pass_beta=0.6,
        seed=seed,
    )
