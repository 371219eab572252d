"""The experiment, as validated frozen dataclasses (the ConfigDict stops at the launcher).

``ExperimentConfig.from_config_dict(config)`` turns a ``configs/*.py`` ConfigDict
into these (sections in ``runtime.config.specs``); every field is checked eagerly, with
errors naming the field, and an unknown key is refused with the nearest known one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from jaxflash.algorithms.advantages import ADVANTAGE_ESTIMATORS
from jaxflash.data.tasks import task_reward
from jaxflash.learner.config import LearnerConfig
from jaxflash.models.adapters.lora import LoraConfig
from jaxflash.runtime.config.elastic_spec import check_elastic
from jaxflash.runtime.config.env_spec import EnvSpec, agentic_rollout
from jaxflash.runtime.config.replay_spec import (
    ControllerSpec,
    ReplaySpec,
    check_replay_combination,
    replay_active,
)
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.config.specs import (
    FILE_TASKS,
    CheckpointSpec,
    ConfigError,
    DataSpec,
    EvalSpec,
    MeshSpec,
    ModelSpec,
    RewardSpec,
    unknown_key_message,
)
from jaxflash.runtime.config.specs import check as _check
from jaxflash.types import SamplingParams

__all__ = [
    "FILE_TASKS",
    "GROUP_RELATIVE",
    "CheckpointSpec",
    "ConfigError",
    "DataSpec",
    "EnvSpec",
    "EvalSpec",
    "ExperimentConfig",
    "MeshSpec",
    "ModelSpec",
    "RewardSpec",
    "RolloutSpec",
    "config_keys",
    "unknown_key_message",
]

GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
"""Advantage estimators whose baseline is the prompt's own group of samples."""

TASK_VERIFIERS = ("math", "reasoning_gym", "code")
"""Built-in rewards that read a task's answer format (a task's ``task_reward``)."""


def _refuse_unknown(section: str, given: Mapping[str, Any], known: list[str]) -> None:
    for key in sorted(set(given) - set(known)):
        raise ConfigError(unknown_key_message(f"{section}.{key}" if section else key, known))


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _task_options(value: Any, field: str = "data.task_options") -> dict[str, Any]:
    """A mapping field (``data.task_options``, ``env.options``): a mapping, or its JSON
    text (as written on a command line)."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{field} is not valid JSON ({e}): {value!r}") from None
    _check(
        isinstance(value, Mapping),
        f"{field} must be a JSON object, got {type(value).__name__}",
    )
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in value.items()}


def _delta_publish(mesh: Mapping[str, Any], lora: LoraConfig | None) -> bool:
    """``mesh.delta_publish``: True / False, or "auto" (the default): on where a publish
    leaves the machine — generation programs at a ``generation_addresses`` host that is
    not loopback (a pod's generation hosts) — and the run is full fine-tuning; off for
    thread engines and local programs (loopback addresses, or the processes this
    controller starts, however many hosts each spans), where the full copy is a memcpy
    or a loopback socket and the delta's passes cost more than the bytes they save
    (docs/PERF.md).

    Raises:
      ConfigError: a value other than a bool, "auto", "true"/"on" or "false"/"off"
        (any case).
    """
    raw = mesh.get("delta_publish", "auto")
    word = str(raw).strip().lower() if isinstance(raw, str | bool) else None
    _check(
        word in ("auto", "true", "on", "false", "off"),
        f"mesh.delta_publish must be True/on, False/off or 'auto', got {raw!r}",
    )
    if word != "auto":
        return word in ("true", "on")
    remote = any(not _loopback(a) for a in _addresses(mesh.get("generation_addresses", ())))
    return bool(mesh.get("generation_processes", False)) and remote and lora is None


def _loopback(address: str) -> bool:
    """Whether ``"host:port"`` names this machine over loopback (localhost, 127/8, ::1)."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("localhost", "::1", "") or host.startswith("127.")


def _addresses(value: Any) -> tuple[str, ...]:
    """``mesh.generation_addresses``: a sequence, or comma-separated text (command line)."""
    if isinstance(value, str):
        return tuple(a.strip() for a in value.split(",") if a.strip())
    return tuple(str(a) for a in value)


def config_keys() -> dict[str, list[str]]:
    """The keys of each ConfigDict section (``configs/default.py`` sets them all).

    Each is a field of the section's dataclass, or one that builds one (``rollout``'s
    sampling keys, ``learner.advantage``); ``from_config_dict`` refuses any other key,
    naming the nearest known one. Top-level keys: ``seed``, ``total_steps`` and these
    sections.
    """
    return {
        "mesh": _fields(MeshSpec),
        "model": _fields(ModelSpec),
        "data": _fields(DataSpec),
        "rollout": [f for f in _fields(RolloutSpec) if f != "sampling"]
        + ["temperature", "top_k", "top_p", "max_new_tokens"],
        "reward": _fields(RewardSpec),
        "learner": [
            f
            for f in _fields(LearnerConfig)
            if f not in ("total_steps", "sampling", "logprob_chunk")  # lora: a dict
            and not f.startswith("replay_")  # set from replay.* (ReplaySpec.learner_fields)
        ]
        + ["advantage"],
        "eval": _fields(EvalSpec),
        "checkpoint": _fields(CheckpointSpec),
        "replay": [f for f in _fields(ReplaySpec) if f != "seed"],  # the run's seed
        "controller": _fields(ControllerSpec),
        "env": _fields(EnvSpec),
    }


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
    replay: ReplaySpec = dataclasses.field(default_factory=ReplaySpec)
    controller: ControllerSpec = dataclasses.field(default_factory=ControllerSpec)
    env: EnvSpec = dataclasses.field(default_factory=EnvSpec)

    def __post_init__(self) -> None:
        # Cross-field checks, so a bad combination fails before any model is loaded.
        _check(self.total_steps >= 0, f"total_steps must be >= 0, got {self.total_steps}")
        _check(
            self.advantage in ADVANTAGE_ESTIMATORS,
            f"learner.advantage must be one of {sorted(ADVANTAGE_ESTIMATORS)}, "
            f"got {self.advantage!r}",
        )
        if self.env.name:  # the data/reward fields it replaces are refused, lengths derived
            rollout = agentic_rollout(self.env, self.rollout, self.data, self.reward)
            object.__setattr__(self, "rollout", rollout)
        _check(  # the replay cycle re-scores RLVR samples; episodes are not wired into it
            not (self.env.name and replay_active(self.replay, self.controller)),
            f"replay.ratio / controller.kind with env.name={self.env.name!r}: the replay "
            "cycle does not take episodes yet; leave replay and controller unset",
        )
        _check(
            self.rollout.group_redundancy == 0 or bool(self.env.name),
            f"rollout.group_redundancy={self.rollout.group_redundancy} needs env.name (it "
            "launches extra episodes per group; RLVR prompts ignore it)",
        )
        # The reward defaults to the task's own verifier; a built-in verifier of another
        # task's answers would score every sample 0 (or fail it), so it is refused.
        own = task_reward(self.data.task)
        if not self.reward.fn and not self.env.name:
            object.__setattr__(self, "reward", dataclasses.replace(self.reward, fn=own))
        _check(
            self.reward.fn not in TASK_VERIFIERS or self.reward.fn == own,
            f"reward.fn={self.reward.fn!r} cannot verify data.task={self.data.task!r}, whose "
            f"answers the {own!r} reward reads; leave reward.fn unset (= the task's own)",
        )
        _check(
            self.eval.temperature == self.rollout.sampling.temperature,
            "eval.temperature must equal rollout.temperature (one engine, one compiled "
            f"distribution), got {self.eval.temperature} vs {self.rollout.sampling.temperature}",
        )
        d, r = self.data, self.rollout
        _check(
            not (d.max_prompt_tokens and r.max_prefill_length)
            or d.max_prompt_tokens <= r.max_prefill_length,
            f"data.max_prompt_tokens={d.max_prompt_tokens} exceeds "
            f"rollout.max_prefill_length={r.max_prefill_length}: prompts in "
            "between would pass the data filter and then fail in the engine "
            "(set rollout.max_prefill_length=0 to follow data.max_prompt_tokens)",
        )
        prompt = r.max_prefill_length or d.max_prompt_tokens
        if r.kv_cache == "paged" and r.num_pages and prompt and not self.env.name:
            need = -(-(prompt + r.sampling.max_new_tokens - 1) // r.page_size)
            _check(
                need <= r.num_pages,
                f"rollout.num_pages={r.num_pages} cannot hold one sample: a prompt of "
                f"{prompt} tokens + max_new_tokens={r.sampling.max_new_tokens} needs up to "
                f"{need} pages of rollout.page_size={r.page_size} positions",
            )
        _check(
            r.group_size >= 2 or self.advantage not in GROUP_RELATIVE,
            f"rollout.group_size=1 with learner.advantage={self.advantage!r}: a "
            "group-relative advantage of one sample is always 0 (use group_size >= 2)",
        )
        check_replay_combination(self.replay, self.controller, async_ratio=self.rollout.async_ratio)
        check_elastic(self.controller, self.mesh)  # devices that change role live
        # The replayed rows' loss (learner.replay_*) is derived from replay.*, never set
        # apart: a step with a replay cycle takes a loss per cycle (learner.cycles).
        if replay_active(self.replay, self.controller):
            learner = self.replay.learner_fields(self.learner)
        else:
            learner = self.learner.replace(
                replay_loss=None, replay_loss_kwargs={}, replay_ratio_against="behaviour"
            )
        object.__setattr__(self, "learner", learner)
        m = self.mesh
        learner_devices = math.prod(int(v) for v in m.learner.values())
        _check(
            not self.model.exact_numerics or learner_devices == 1,
            f"model.exact_numerics=True with a sharded learner (mesh.learner={dict(m.learner)}): "
            "the exact mode is bitwise only on a 1-device learner so far (a sharded learner's "
            "logprobs differ like the default mode's; docs/CONSISTENCY.md); set "
            "mesh.learner to one device (e.g. {'fsdp': 1})",
        )
        _check(
            not self.model.exact_numerics or not self.learner.prefix_sharing,
            "model.exact_numerics=True with learner.prefix_sharing=True: a shared prompt "
            "changes the learner's summation order (its continuations' positions do not "
            "restart, so the exact mode's row blocks do not apply); set "
            "learner.prefix_sharing=False",
        )
        # A weight-sharded engine contracts over devices (partial sums, then an
        # all-reduce): another summation order than the learner's (measured 4.8e-7 with
        # tensor=2 on the tiny model; slots over data=2 stayed bitwise; docs/CONSISTENCY.md).
        split = {a: int(n) for a, n in m.generation.items() if a != "data" and int(n) > 1}
        _check(
            not self.model.exact_numerics or not split,
            f"model.exact_numerics=True with a weight-sharded engine (mesh.generation="
            f"{dict(m.generation)}): the exact mode is bitwise with the slots split over "
            f"'data' only ({split} splits the weights; docs/CONSISTENCY.md); set those axes "
            "to 1 and spread the slots over mesh.generation.data",
        )
        _check(
            not m.delta_publish or self.learner.lora is None,
            "mesh.delta_publish=True with LoRA (learner.lora.rank > 0): a LoRA "
            "run publishes only its adapters, so there is no full tree to send as a delta",
        )
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

    def with_prompt_lengths(self, max_prompt_tokens: int) -> ExperimentConfig:
        """A copy with ``data.max_prompt_tokens`` (and a 0 ``rollout.max_prefill_length``)
        set to ``max_prompt_tokens`` (``runtime.prompt_lengths`` derives it)."""
        prefill = self.rollout.max_prefill_length or max_prompt_tokens
        return dataclasses.replace(
            self,
            data=dataclasses.replace(self.data, max_prompt_tokens=max_prompt_tokens),
            rollout=dataclasses.replace(self.rollout, max_prefill_length=prefill),
        )

    @classmethod
    def from_config_dict(cls, config: Any) -> ExperimentConfig:
        """Converts a ``configs/*.py`` ConfigDict (or nested dict).

        Raises:
          ConfigError: an invalid value or combination (naming the fields), or an
            unknown key (naming the nearest known one).
        """
        try:
            return cls._from_dict(config)
        except ConfigError:
            raise
        except ValueError as e:  # LearnerConfig / SamplingParams checks, named as config fields
            message = str(e).replace("SamplingParams.", "rollout.")
            raise ConfigError(message.replace("LearnerConfig.", "learner.")) from None

    @classmethod
    def _from_dict(cls, config: Any) -> ExperimentConfig:
        c = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        c = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in c.items()}
        sections = config_keys()
        _refuse_unknown("", c, ["seed", "total_steps", *sections])
        for name, known in sections.items():
            _refuse_unknown(name, c.get(name, {}), known)
        r = dict(c.get("rollout", {}))
        sampling = SamplingParams(
            temperature=float(r.pop("temperature", 1.0)),
            top_k=int(r.pop("top_k", 0)),
            top_p=float(r.pop("top_p", 1.0)),
            max_new_tokens=int(r.pop("max_new_tokens", 64)),
        )
        lr = dict(c.get("learner", {}))
        advantage = lr.pop("advantage", "grpo")
        lora = LoraConfig.from_mapping(lr.pop("lora", {}))
        learner = LearnerConfig(
            **{k: v for k, v in lr.items() if k != "loss_kwargs"},
            loss_kwargs=dict(lr.get("loss_kwargs", {})),
            lora=lora,
            total_steps=int(c.get("total_steps", 10)),
            sampling=sampling,
            logprob_chunk=int(c.get("model", {}).get("logits_chunk", ModelSpec.logits_chunk)),
        )
        mesh = dict(c.get("mesh", {}))
        data = dict(c.get("data", {}))
        data["task_options"] = _task_options(data.get("task_options", {}))
        env = dict(c.get("env", {}))
        env["options"] = _task_options(env.get("options", {}), "env.options")
        model = dict(c.get("model", {}))
        if "chat_template_kwargs" in model:
            model["chat_template_kwargs"] = _task_options(
                model["chat_template_kwargs"], "model.chat_template_kwargs"
            )
        return cls(
            seed=int(c.get("seed", 0)),
            total_steps=int(c.get("total_steps", 10)),
            mesh=MeshSpec(
                num_cpu_devices=int(mesh.get("num_cpu_devices", 1)),
                learner=dict(mesh.get("learner", {"fsdp": 1})),
                generation=dict(mesh.get("generation", {"tensor": 1})),
                colocated=bool(mesh.get("colocated", True)),
                num_generation_slices=int(mesh.get("num_generation_slices", 1)),
                generation_processes=bool(mesh.get("generation_processes", False)),
                generation_addresses=_addresses(mesh.get("generation_addresses", ())),
                generation_hosts=int(mesh.get("generation_hosts", 1)),
                weight_transfer=str(mesh.get("weight_transfer", "transfer")),
                generation_digests=bool(mesh.get("generation_digests", False)),
                delta_publish=_delta_publish(mesh, lora),
            ),
            model=ModelSpec(**model),
            data=DataSpec(**data),
            rollout=RolloutSpec(sampling=sampling, **r),
            reward=RewardSpec(**c.get("reward", {})),
            learner=learner,
            advantage=advantage,
            eval=EvalSpec(**c.get("eval", {})),
            checkpoint=CheckpointSpec(**c.get("checkpoint", {})),
            replay=ReplaySpec(**c.get("replay", {})),
            controller=ControllerSpec(**c.get("controller", {})),
            env=EnvSpec(**env),
        )
