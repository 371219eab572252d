"""The experiment, as validated frozen dataclasses (the ConfigDict stops at the launcher).

``ExperimentConfig.from_config_dict(config)`` turns a ``configs/*.py`` ConfigDict
into these; every field is checked eagerly, with errors naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from jaxflash.learner.config import LearnerConfig
from jaxflash.types import SamplingParams

GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
"""Advantage estimators whose baseline is the prompt's own group of samples."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """Devices: a learner mesh and (unless colocated) generation slices.

    Attributes:
      num_cpu_devices: fake CPU devices (CPU only; set before jax is imported).
      learner: learner mesh axis sizes, e.g. {"fsdp": 4, "tensor": 2}.
      generation: axis sizes of each generation slice, e.g. {"tensor": 1}.
      colocated: one generation server on the learner's own devices, idle while the
        learner trains (α = 0 only: the synchronous baseline).
      num_generation_slices: disjoint generation slices after the learner's devices
        (colocated False), one generation server each; 1 when colocated.
    """

    num_cpu_devices: int = 1
    learner: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"fsdp": 1})
    generation: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"tensor": 1})
    colocated: bool = True
    num_generation_slices: int = 1

    def __post_init__(self) -> None:
        _check(
            self.num_generation_slices >= 1,
            f"mesh.num_generation_slices must be >= 1, got {self.num_generation_slices}",
        )
        for name, axes in (("learner", self.learner), ("generation", self.generation)):
            for axis, size in axes.items():
                _check(int(size) >= 1, f"mesh.{name}.{axis} must be >= 1, got {size}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Where the weights come from. source: gguf | hf | random."""

    source: str = "gguf"
    path: str = ""
    preset: str = "smollm2_135m"
    compute_dtype: str = "float32"
    remat: bool = True
    logits_chunk: int = 64

    def __post_init__(self) -> None:
        _check(
            self.source in ("gguf", "hf", "random"),
            f"model.source must be gguf | hf | random, got {self.source!r}",
        )
        _check(self.source != "hf" or bool(self.path), "model.path is required for source=hf")
        _check(
            self.compute_dtype in ("float32", "bfloat16"),
            f"model.compute_dtype must be float32 | bfloat16, got {self.compute_dtype!r}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Prompts: the procedural arithmetic task or a JSONL/Parquet file."""

    task: str = "arithmetic"
    path: str = ""
    min_operands: int = 2
    max_operands: int = 2
    min_digits: int = 1
    max_digits: int = 1
    ops: str = "+-*"
    max_prompt_tokens: int = 64
    eval_size: int = 64
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    answer_marker: str = ""
    on_error: str = "fail"

    def __post_init__(self) -> None:
        _check(
            self.task in ("arithmetic", "file"),
            f"data.task must be arithmetic | file, got {self.task!r}",
        )
        _check(self.task != "file" or bool(self.path), "data.path is required for data.task=file")
        _check(
            self.max_prompt_tokens >= 1,
            f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}",
        )
        _check(self.eval_size >= 0, f"data.eval_size must be >= 0, got {self.eval_size}")
        _check(
            self.on_error in ("fail", "raise"),
            f"data.on_error must be fail | raise, got {self.on_error!r}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """Generation: B prompts x G samples per step, sampling, slots, staleness bound."""

    prompts_per_step: int = 8
    group_size: int = 4
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    num_slots: int = 32
    max_prefill_length: int = 64
    async_ratio: int = 0
    truncation: str = "penalty"
    truncation_penalty: float = 0.0
    filter_zero_variance: bool = False
    filter_min_mean: float | None = None  # drop groups with mean reward below
    filter_max_mean: float | None = None  # drop groups with mean reward above
    filter_min_std: float | None = None  # drop groups with reward std below
    # In-flight samples at a weight update; only with async_ratio > 0 (disjoint slices).
    partial_rollout: str = "continue"  # continue | recompute | restart
    stale_policy: str = "drop"  # drop | regenerate a sample older than alpha allows (alpha > 0)
    sample_deadline_s: float = 600.0  # a sample not back by then is aborted and retried
    max_retries: int = 1  # retries of a timed-out sample before its prompt fails

    def __post_init__(self) -> None:
        _check(
            self.prompts_per_step >= 1,
            f"rollout.prompts_per_step must be >= 1, got {self.prompts_per_step}",
        )
        _check(self.group_size >= 1, f"rollout.group_size must be >= 1, got {self.group_size}")
        _check(self.num_slots >= 1, f"rollout.num_slots must be >= 1, got {self.num_slots}")
        _check(self.async_ratio >= 0, f"rollout.async_ratio must be >= 0, got {self.async_ratio}")
        _check(
            self.truncation in ("penalty", "mask", "none"),
            f"rollout.truncation must be penalty | mask | none, got {self.truncation!r}",
        )
        _check(
            self.partial_rollout in ("continue", "recompute", "restart"),
            "rollout.partial_rollout must be continue | recompute | restart, "
            f"got {self.partial_rollout!r}",
        )
        _check(
            self.stale_policy in ("drop", "regenerate"),
            f"rollout.stale_policy must be drop | regenerate, got {self.stale_policy!r}",
        )
        _check(
            self.sample_deadline_s > 0,
            f"rollout.sample_deadline_s must be > 0, got {self.sample_deadline_s}",
        )
        _check(self.max_retries >= 0, f"rollout.max_retries must be >= 0, got {self.max_retries}")
        # Settings that would be silently ignored are refused, naming the fields.
        if self.async_ratio == 0:
            for name, value, default in (
                ("partial_rollout", self.partial_rollout, "continue"),
                ("stale_policy", self.stale_policy, "drop"),
            ):
                _check(
                    value == default,
                    f"rollout.{name}={value!r} needs rollout.async_ratio > 0: with "
                    "async_ratio=0 no sample is in flight at a weight update and none is stale",
                )
        _check(
            self.truncation == "penalty" or self.truncation_penalty == 0.0,
            f"rollout.truncation_penalty={self.truncation_penalty} is used only with "
            f"rollout.truncation='penalty', got {self.truncation!r}",
        )
        _check(
            self.filter_min_std is None or self.filter_min_std > 0,
            f"rollout.filter_min_std={self.filter_min_std} filters nothing (a std is >= 0); "
            "use a positive threshold or None",
        )
        lo, hi = self.filter_min_mean, self.filter_max_mean
        _check(
            lo is None or hi is None or lo <= hi,
            f"rollout.filter_min_mean={lo} > rollout.filter_max_mean={hi} filters every group",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """Reward: Math-Verify answer (+ format), or any picklable "module:attr" callable."""

    fn: str = "math"
    answer_weight: float = 1.0
    format_weight: float = 0.0
    num_workers: int = 2
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check(self.num_workers >= 1, f"reward.num_workers must be >= 1, got {self.num_workers}")
        _check(self.timeout_s > 0, f"reward.timeout_s must be > 0, got {self.timeout_s}")
        _check(
            self.fn == "math" or (self.answer_weight == 1.0 and self.format_weight == 0.0),
            f"reward.answer_weight / reward.format_weight weigh the built-in math reward; "
            f"reward.fn={self.fn!r} ignores them",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSpec:
    every: int = 5
    temperature: float = 1.0
    samples_per_prompt: int = 1

    def __post_init__(self) -> None:
        _check(self.every >= 1, f"eval.every must be >= 1, got {self.every}")
        _check(
            self.samples_per_prompt >= 1,
            f"eval.samples_per_prompt must be >= 1, got {self.samples_per_prompt}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    every: int = 1
    max_to_keep: int = 2

    def __post_init__(self) -> None:
        _check(self.every >= 1, f"checkpoint.every must be >= 1, got {self.every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A whole run. Built by ``from_config_dict``; library code reads only this."""

    seed: int = 0
    total_steps: int = 10
    mesh: MeshSpec = dataclasses.field(default_factory=MeshSpec)
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    data: DataSpec = dataclasses.field(default_factory=DataSpec)
    rollout: RolloutSpec = dataclasses.field(default_factory=RolloutSpec)
    reward: RewardSpec = dataclasses.field(default_factory=RewardSpec)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    advantage: str = "grpo"
    eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = dataclasses.field(default_factory=CheckpointSpec)

    def __post_init__(self) -> None:
        # Cross-field checks, so a bad combination fails before any model is loaded.
        _check(self.total_steps >= 0, f"total_steps must be >= 0, got {self.total_steps}")
        _check(
            self.eval.temperature == self.rollout.sampling.temperature,
            "eval.temperature must equal rollout.temperature (one engine, one compiled "
            f"distribution), got {self.eval.temperature} vs {self.rollout.sampling.temperature}",
        )
        _check(
            self.data.max_prompt_tokens <= self.rollout.max_prefill_length,
            f"data.max_prompt_tokens={self.data.max_prompt_tokens} exceeds "
            f"rollout.max_prefill_length={self.rollout.max_prefill_length}: prompts in "
            "between would pass the data filter and then fail in the engine",
        )
        _check(
            self.rollout.group_size >= 2 or self.advantage not in GROUP_RELATIVE,
            f"rollout.group_size=1 with learner.advantage={self.advantage!r}: a "
            "group-relative advantage of one sample is always 0 (use group_size >= 2)",
        )
        _check(
            self.data.task != "file" or os.path.isfile(self.data.path),
            f"data.path={self.data.path!r} is not a file",
        )
        m, r = self.mesh, self.rollout
        if m.colocated:
            _check(
                r.async_ratio == 0,
                f"rollout.async_ratio={r.async_ratio} needs disjoint generation slices "
                "(mesh.colocated=False): a colocated generation server is idle while the "
                "learner trains, so nothing could run ahead of it",
            )
            _check(
                m.num_generation_slices == 1,
                f"mesh.num_generation_slices={m.num_generation_slices} with "
                "mesh.colocated=True: a colocated placement runs one generation server",
            )
            n_gen, n_learner = math.prod(m.generation.values()), math.prod(m.learner.values())
            _check(
                n_gen <= n_learner,
                f"mesh.generation {dict(m.generation)} needs {n_gen} devices but with "
                f"mesh.colocated=True it runs on the learner's {n_learner} (mesh.learner)",
            )

    @classmethod
    def from_config_dict(cls, config: Any) -> ExperimentConfig:
        """Converts a ``configs/*.py`` ConfigDict (or nested dict); unknown keys raise."""
        c = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        c = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in c.items()}
        r = dict(c.get("rollout", {}))
        sampling = SamplingParams(
            temperature=float(r.pop("temperature", 1.0)),
            top_k=int(r.pop("top_k", 0)),
            top_p=float(r.pop("top_p", 1.0)),
            max_new_tokens=int(r.pop("max_new_tokens", 64)),
        )
        lr = dict(c.get("learner", {}))
        advantage = lr.pop("advantage", "grpo")
        learner = LearnerConfig(
            **{k: v for k, v in lr.items() if k != "loss_kwargs"},
            loss_kwargs=dict(lr.get("loss_kwargs", {})),
            total_steps=int(c.get("total_steps", 10)),
            sampling=sampling,
            logprob_chunk=int(c.get("model", {}).get("logits_chunk", 256)),
        )
        known = {
            "seed",
            "total_steps",
            "mesh",
            "model",
            "data",
            "rollout",
            "reward",
            "learner",
            "eval",
            "checkpoint",
        }
        unknown = set(c) - known
        _check(not unknown, f"unknown top-level config keys: {sorted(unknown)}")
        mesh = dict(c.get("mesh", {}))
        return cls(
            seed=int(c.get("seed", 0)),
            total_steps=int(c.get("total_steps", 10)),
            mesh=MeshSpec(
                num_cpu_devices=int(mesh.get("num_cpu_devices", 1)),
                learner=dict(mesh.get("learner", {"fsdp": 1})),
                generation=dict(mesh.get("generation", {"tensor": 1})),
                colocated=bool(mesh.get("colocated", True)),
                num_generation_slices=int(mesh.get("num_generation_slices", 1)),
            ),
            model=ModelSpec(**c.get("model", {})),
            data=DataSpec(**c.get("data", {})),
            rollout=RolloutSpec(sampling=sampling, **r),
            reward=RewardSpec(**c.get("reward", {})),
            learner=learner,
            advantage=advantage,
            eval=EvalSpec(**c.get("eval", {})),
            checkpoint=CheckpointSpec(**c.get("checkpoint", {})),
        )
