"""The simulator's cost model: what a decode step, a prefill, a learner step and a
weight sync cost, and how much slower things run when they share hardware.

Every number is in seconds and comes either from a measurement of our own engine
and learner (``benchmarks/calibrate_sim.py`` writes the JSON) or from a stated
assumption (e.g. an accelerator's roofline, ``benchmarks/sim_costs/``). The model
is deliberately linear, so each coefficient is a thing one can measure:

* decode step of one server (continuous batching, ROLL Flash arXiv 2510.11345 /
  JetStream slots): ``base_s + per_active_slot_s·n + per_slot_s·K`` for n live
  slots out of K. A jitted step of fixed shape [K] costs the same for any n
  (``per_slot_s``: our CPU engine); a memory-bound accelerator pays per live
  sequence (``per_active_slot_s``: KV reads).
* filling slots before a step: ``per_prompt_s + per_prompt_token_s·P`` per prompt
  prefilled on that server (one prefill shared by all its samples queued there,
  prefix sharing) plus ``per_sample_s`` per sample inserted.
* learner step: ``step_s + per_token_s·tokens·reference_devices/devices``, or
  interpolated between measured (tokens, seconds) ``points`` (linear data-parallel
  scaling over devices is an assumption); tokens are
  padded rows x the batch's length bucket (``padding="bucket"``, what
  ``learner.batching.pack_batch`` builds) or the real prompt+response tokens
  (``"packed"``).
* weight sync after each step: ``weight_sync_s + per_server_s·servers`` on the
  learner; generation stalls for it too when ``stalls_generation``.
* reward: ``latency_s`` per sample on ``workers`` parallel workers (FIFO).
* contention: time factors (>= 1) when components share cores, e.g. on one CPU
  machine: a decode step with g servers busy and the learner busy or not, a
  learner step with g servers busy. Missing entries mean 1.0 (disjoint devices).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

PADDING_MODES = ("bucket", "packed")


def _check_nonneg(owner: str, **values: float) -> None:
    bad = {k: v for k, v in values.items() if not (isinstance(v, int | float) and v >= 0)}
    if bad:
        raise ValueError(f"{owner}: these must be numbers >= 0: {bad}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeCost:
    """Seconds of one decode step of one server: base + per live slot + per slot."""

    base_s: float
    per_active_slot_s: float = 0.0
    per_slot_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg("DecodeCost", **dataclasses.asdict(self))
        if self.step_s(1, 1) <= 0:
            raise ValueError(f"DecodeCost: a step must take > 0 s, got {self}")

    def step_s(self, active: int, slots: int) -> float:
        """One step with ``active`` live slots out of ``slots``."""
        return self.base_s + self.per_active_slot_s * active + self.per_slot_s * slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillCost:
    """Seconds added to a step that fills slots: per prompt (+ per token) and per sample."""

    per_prompt_s: float = 0.0
    per_prompt_token_s: float = 0.0
    per_sample_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg("PrefillCost", **dataclasses.asdict(self))

    def fill_s(self, prompt_tokens: list[int], samples: int) -> float:
        """Cost of prefilling the prompts of lengths ``prompt_tokens`` and inserting
        ``samples`` samples."""
        return (
            self.per_prompt_s * len(prompt_tokens)
            + self.per_prompt_token_s * sum(prompt_tokens)
            + self.per_sample_s * samples
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerCost:
    """Seconds of one learner step on ``devices`` devices.

    Attributes:
      step_s: fixed cost per step (launch, optimizer, host-side packing).
      per_token_s: per trained token on ``reference_devices`` devices.
      padding: "bucket" (rows x bucketed max length) or "packed" (real tokens).
      bucket: length multiple of the "bucket" padding (``pack_batch``'s 32).
      reference_devices: devices ``per_token_s`` was measured or assumed on.
      points: measured ((tokens, seconds), ...) on ``reference_devices``; when given,
        a step's time is interpolated between them (linearly; beyond them along the
        nearest two) instead of ``step_s + per_token_s·tokens``.
    """

    step_s: float
    per_token_s: float
    padding: str = "packed"
    bucket: int = 32
    reference_devices: int = 1
    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_nonneg("LearnerCost", step_s=self.step_s, per_token_s=self.per_token_s)
        if self.padding not in PADDING_MODES:
            raise ValueError(
                f"LearnerCost.padding must be one of {PADDING_MODES}, got {self.padding!r}"
            )
        xs = [t for t, _ in self.points]
        if self.points and (len(xs) < 2 or xs != sorted(set(xs))):
            raise ValueError(
                f"LearnerCost.points: need >= 2 (tokens, s), tokens increasing; got {self.points}"
            )
        if self.bucket < 1 or self.reference_devices < 1:
            raise ValueError(
                f"LearnerCost: bucket and reference_devices must be >= 1, got "
                f"{self.bucket}, {self.reference_devices}"
            )

    def tokens(self, lengths: list[int], rows: int) -> int:
        """Tokens the step computes: ``lengths`` are prompt+response of each trained
        sequence, ``rows`` the padded batch rows (``num_sequences``)."""
        if not lengths:
            return 0
        if self.padding == "packed":
            return int(sum(lengths))
        longest = -(-max(lengths) // self.bucket) * self.bucket  # learner.batching.bucket_length
        return int(max(rows, len(lengths)) * longest)

    def step_time_s(self, lengths: list[int], rows: int, devices: int) -> float:
        """Seconds of one step over ``lengths`` on ``devices`` devices."""
        if devices < 1:
            raise ValueError(f"LearnerCost.step_time_s: devices must be >= 1, got {devices}")
        scale = self.reference_devices / devices
        tokens = self.tokens(lengths, rows)
        if not self.points:
            return self.step_s + self.per_token_s * tokens * scale
        pts = self.points
        i = next((k for k in range(1, len(pts) - 1) if tokens <= pts[k][0]), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return (y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)) * scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncCost:
    """Weight hand-over after each learner step: ``weight_sync_s + per_server_s`` x
    servers seconds on the learner (``colocated_s`` instead, when set, for a server
    on the learner's own devices); generation pauses for it if ``stalls_generation``."""

    weight_sync_s: float = 0.0
    per_server_s: float = 0.0
    colocated_s: float | None = None
    stalls_generation: bool = True

    def __post_init__(self) -> None:
        _check_nonneg("SyncCost", weight_sync_s=self.weight_sync_s, per_server_s=self.per_server_s)
        if self.colocated_s is not None:
            _check_nonneg("SyncCost", colocated_s=self.colocated_s)

    def seconds(self, servers: int, *, colocated: bool = False) -> float:
        if colocated and self.colocated_s is not None:
            return self.colocated_s
        return self.weight_sync_s + self.per_server_s * servers


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardCost:
    """Reward scoring: ``latency_s`` per sample on ``workers`` FIFO workers."""

    latency_s: float = 0.0
    workers: int = 1

    def __post_init__(self) -> None:
        _check_nonneg("RewardCost", latency_s=self.latency_s)
        if self.workers < 1:
            raise ValueError(f"RewardCost.workers must be >= 1, got {self.workers}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contention:
    """Time factors (>= 1) of components that share hardware.

    Attributes:
      gen: ((servers busy, learner busy 0|1, factor), ...): a decode step's factor.
      train: ((servers busy, factor), ...): a learner step's factor.
      A state not listed uses the entry with the most busy servers below it (same
      learner flag), else 1.0.
    """

    gen: tuple[tuple[int, int, float], ...] = ()
    train: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for row in (*self.gen, *self.train):
            if row[-1] < 1.0 or not math.isfinite(row[-1]) or min(row[:-1]) < 0:
                raise ValueError(f"Contention: factors must be finite and >= 1, got row {row}")

    def gen_factor(self, servers_busy: int, learner_busy: bool) -> float:
        rows = [(n, f) for n, lb, f in self.gen if lb == int(learner_busy) and n <= servers_busy]
        return max(rows)[1] if rows else 1.0

    def train_factor(self, servers_busy: int) -> float:
        rows = [(n, f) for n, f in self.train if n <= servers_busy]
        return max(rows)[1] if rows else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Everything the simulator charges time for (see the module docstring).

    Attributes:
      name: what it models (e.g. "tiny SmolLM2 shape, main's engine, this CPU").
      server_devices: devices of one generation server the decode costs hold for.
      meta: provenance: how and when it was measured, load average, assumptions.
    """

    name: str
    decode: DecodeCost
    prefill: PrefillCost
    learner: LearnerCost
    sync: SyncCost = SyncCost()
    reward: RewardCost = RewardCost()
    contention: Contention = Contention()
    server_devices: int = 1
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.server_devices < 1:
            raise ValueError(f"CostModel.server_devices must be >= 1, got {self.server_devices}")

    # -- JSON ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """Builds a CostModel from its JSON form.

        Raises:
          ValueError: unknown or missing keys (named), or values out of range.
        """
        parts = {
            "decode": DecodeCost,
            "prefill": PrefillCost,
            "learner": LearnerCost,
            "sync": SyncCost,
            "reward": RewardCost,
        }
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"cost model: unknown keys {unknown} (known: {sorted(known)})")
        missing = sorted({"name", "decode", "prefill", "learner"} - set(d))
        if missing:
            raise ValueError(f"cost model: missing keys {missing}")
        kw: dict[str, Any] = {"name": d["name"], "meta": dict(d.get("meta", {}))}
        kw["server_devices"] = int(d.get("server_devices", 1))
        for key, kind in parts.items():
            if key in d:
                kw[key] = _part(kind, key, d[key])
        if "contention" in d:
            c = d["contention"]
            extra = sorted(set(c) - {"gen", "train"})
            if extra:
                raise ValueError(f"cost model: unknown keys {extra} in contention")
            kw["contention"] = Contention(
                gen=tuple((int(n), int(lb), float(f)) for n, lb, f in c.get("gen", ())),
                train=tuple((int(n), float(f)) for n, f in c.get("train", ())),
            )
        return cls(**kw)

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _part(kind: type, key: str, values: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"cost model: unknown keys {unknown} in {key} (known: {sorted(names)})")
    if "points" in values:  # JSON lists -> tuples (the dataclass is frozen and hashable)
        values = dict(values, points=tuple((int(t), float(s)) for t, s in values["points"]))
    return kind(**values)
