"""The sections of an experiment as frozen dataclasses, each validating its own fields.

``ExperimentConfig`` (``runtime.config.experiment``) holds one of each and checks the
combinations. Every error names the field as it is written on the command line
(``data.task``), and every name-valued field (task, reward, model preset, ...) is
checked here, before any model is loaded. The ``rollout`` section is
``runtime.config.rollout_spec``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from jaxflash.data.tasks import get_task

FILE_TASKS = ("file", "math_file", "code_file")
"""Tasks that read a JSONL/Parquet file (``data.path``)."""


class ConfigError(ValueError):
    """A setting that cannot run, found before (or while) the run is built; the message
    names the fields. The launcher prints it as one line instead of a traceback."""


def unknown_key_message(key: str, known: Iterable[str]) -> str:
    """``unknown config key 'data.pth' (did you mean 'data.path'?)``, else the known keys.

    Jax-free, so the launcher can say it before jax is imported.
    """
    section, _, name = key.rpartition(".")
    prefix = f"{section}." if section else ""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean '{prefix}{close[0]}'?" if close else f"known: {known}"
    return f"unknown config key '{key}' ({hint})"


def check(cond: bool, msg: str) -> None:
    """Raise ``ConfigError(msg)`` unless ``cond``."""
    if not cond:
        raise ConfigError(msg)


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
      generation_processes: each generation slice is its own JAX program (a
        process; ``runtime.fleet.gen_program``) reached over gRPC, instead of a thread
        on this process's devices. The learner's devices are then all of this
        program's (``mesh.learner``); weights travel by ``weight_transfer``.
      generation_addresses: with generation_processes: "host:port" of generation
        programs already running (one per slice, e.g. started on a pod's
        generation hosts by ``launch/tpu_pod.py``). Empty: this controller
        starts ``num_generation_slices`` local processes (CPU; tests, a laptop)
        and restarts any that dies.
      generation_hosts: hosts (processes) of each generation program: a slice
        larger than one host (e.g. a v5p engine of tensor = 8: two 4-chip hosts)
        is one multi-controller JAX program whose process 0 speaks for it
        (``runtime.fleet.gen_hosts``). Local programs (no addresses) start that
        many processes on loopback, ``prod(generation) / generation_hosts``
        devices each. Needs generation_processes.
      weight_transfer: how generation programs pull weights: "transfer"
        (``jax.experimental.transfer``) or "stream" (host-staged, per shard).
      generation_digests: generation programs log a SHA-256 of every installed
        weight tree (costs a host copy of the weights per update; for tests).
      delta_publish: full fine-tuning sends a generation server only the XOR of the
        engine-side weights that changed since its version, zstd-compressed and
        checked by digest (thread engines: ``sync.delta_publish``; generation programs,
        every host its own blocks: ``sync.transfer_delta``). Refused with LoRA (only
        adapters move). In the config: True, False or "auto" (the default), which
        ``ExperimentConfig.from_config_dict`` resolves to True for generation programs
        at a ``generation_addresses`` host that is not loopback, without LoRA —
        publishes that cross a network — and False otherwise (thread engines; the
        programs this controller starts; loopback addresses): exact and ~10x fewer
        bytes, but slower than the full copy where that copy is a memcpy or a loopback
        socket (docs/PERF.md).
    """

    num_cpu_devices: int = 1
    learner: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"fsdp": 1})
    generation: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"tensor": 1})
    colocated: bool = True
    num_generation_slices: int = 1
    generation_processes: bool = False
    generation_addresses: tuple[str, ...] = ()
    generation_hosts: int = 1
    weight_transfer: str = "transfer"
    generation_digests: bool = False
    delta_publish: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "generation_addresses", tuple(self.generation_addresses))
        check(
            self.weight_transfer in ("transfer", "stream"),
            f"mesh.weight_transfer must be transfer | stream, got {self.weight_transfer!r}",
        )
        if not self.generation_processes:
            ignored = [
                f"mesh.{name}={getattr(self, name)!r}"
                for name, default in (
                    ("generation_addresses", ()),
                    ("generation_hosts", 1),
                    ("weight_transfer", "transfer"),
                    ("generation_digests", False),
                )
                if getattr(self, name) != default
            ]
            check(
                not ignored,
                f"{', '.join(ignored)}: only used with mesh.generation_processes=True "
                "(generation in separate processes)",
            )
        else:
            check(
                not self.colocated,
                "mesh.generation_processes=True needs mesh.colocated=False: a generation "
                "program has its own devices, it cannot share the learner's",
            )
            n = len(self.generation_addresses)
            check(
                n in (0, self.num_generation_slices),
                f"mesh.generation_addresses lists {n} programs but "
                f"mesh.num_generation_slices={self.num_generation_slices}",
            )
            for address in self.generation_addresses:
                host, sep, port = str(address).rpartition(":")
                check(
                    bool(host) and bool(sep) and port.isdigit(),
                    f"mesh.generation_addresses: {address!r} is not host:port",
                )
        n_gen = math.prod(int(v) for v in self.generation.values())
        check(
            self.generation_hosts >= 1 and n_gen % self.generation_hosts == 0,
            f"mesh.generation_hosts={self.generation_hosts} must be >= 1 and divide the "
            f"{n_gen} devices of mesh.generation {dict(self.generation)}",
        )
        check(
            self.num_generation_slices >= 1,
            f"mesh.num_generation_slices must be >= 1, got {self.num_generation_slices}",
        )
        for name, axes in (("learner", self.learner), ("generation", self.generation)):
            for axis, size in axes.items():
                check(int(size) >= 1, f"mesh.{name}.{axis} must be >= 1, got {size}")


def _missing_hf_files(directory: str) -> list[str]:
    """What a Hugging Face checkpoint directory lacks of what a run reads from it: the
    model's config, the tokenizer and the weights (one file, or an index of shards)."""
    has = lambda name: os.path.isfile(os.path.join(directory, name))  # noqa: E731
    missing = [name for name in ("config.json", "tokenizer.json") if not has(name)]
    if not (has("model.safetensors") or has("model.safetensors.index.json")):
        missing.append("model.safetensors (or model.safetensors.index.json)")
    return missing


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Where the weights come from. source: gguf | hf | random.

    ``chat_template``: a Jinja template that replaces the tokenizer's own ("" keeps
    it) — the documented plain prompt format of a base model without one.
    ``extra_stop_ids``: token ids that also end a response (e.g. the newline that
    ends a plain-format answer), added to the tokenizer's stop set.
    ``chat_template_kwargs``: variables every chat-template render gets (prompts,
    agentic turns, evaluation), e.g. ``{"enable_thinking": false}`` for Qwen3.
    """

    source: str = "gguf"
    path: str = ""
    preset: str = "smollm2_135m"
    compute_dtype: str = "float32"
    remat: bool = True
    # What remat keeps: "dots" (matmul outputs) | "full" (each layer's input only).
    remat_policy: str = "dots"
    logits_chunk: int = 64
    attention: str = "auto"  # ModelConfig.attention, checked there (this module imports no jax)
    # ModelConfig.exact_numerics: engine and learner logprobs bitwise equal (docs/CONSISTENCY.md)
    exact_numerics: bool = False
    chat_template: str = ""
    extra_stop_ids: tuple[int, ...] = ()
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check(
            isinstance(self.chat_template_kwargs, Mapping)
            and all(isinstance(k, str) for k in self.chat_template_kwargs),
            "model.chat_template_kwargs must be a JSON object with string keys, got "
            f"{self.chat_template_kwargs!r}",
        )
        object.__setattr__(self, "extra_stop_ids", tuple(self.extra_stop_ids))
        check(
            all(isinstance(i, int) and i >= 0 for i in self.extra_stop_ids),
            f"model.extra_stop_ids must be ids >= 0, got {self.extra_stop_ids!r}",
        )
        check(
            self.source in ("gguf", "hf", "random"),
            f"model.source must be gguf | hf | random, got {self.source!r}",
        )
        check(self.source != "hf" or bool(self.path), "model.path is required for source=hf")
        if self.source == "hf":
            check(os.path.isdir(self.path), f"model.path={self.path!r} is not a directory")
            missing = _missing_hf_files(self.path)
            check(
                not missing,
                f"model.path={self.path!r} (model.source=hf) has no {' and no '.join(missing)}: "
                "a Hugging Face checkpoint directory holds all of them",
            )
        elif self.path:  # gguf, or the tokenizer of a random model
            check(os.path.isfile(self.path), f"model.path={self.path!r} is not a file")
        if self.source == "random":
            from jaxflash.models.config.presets import get_preset  # noqa: PLC0415

            try:
                get_preset(self.preset)
            except ValueError as e:
                raise ConfigError(f"model.preset: {e}") from None
        check(
            self.compute_dtype in ("float32", "bfloat16"),
            f"model.compute_dtype must be float32 | bfloat16, got {self.compute_dtype!r}",
        )
        check(
            isinstance(self.exact_numerics, bool),
            f"model.exact_numerics must be true | false, got {self.exact_numerics!r}",
        )
        check(
            self.remat_policy in ("dots", "full"),
            f"model.remat_policy must be dots | full, got {self.remat_policy!r}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Prompts: a task by name (``jaxflash.data.tasks``) and its options.

    Attributes:
      task: a task name: arithmetic | file | math_file | countdown |
        reasoning_gym:<dataset> | humaneval | code_file.
      path: the JSONL/Parquet file of ``file`` / ``math_file`` / ``code_file``.
      shuffle: file tasks: read each epoch in a seeded shuffled order (False:
        file order).
      task_options: further keyword options of the task (reasoning-gym:
        ``config`` of the dataset, ``template``, ``eval_fraction``; math_file:
        ``instruction``).
      min_operands, max_operands, min_digits, max_digits, ops: arithmetic only.
      max_prompt_tokens: longest rendered prompt (tokens); longer ones fail as
        ``prompt_too_long``. 0 = derived from the data at start
        (``runtime.prompt_lengths``).
      eval_size: held-out prompts (file tasks: at most 10 % of the file).
      prompt_key, answer_key: file tasks: field names ("" = the task's own:
        prompt/answer for file, problem/solution for math_file, prompt/tests for
        code_file).
      answer_marker: task file: the answer follows its last occurrence (GSM8K "####").
      on_error: a malformed file row: "fail" (that prompt fails, counted) | "raise".
    """

    task: str = "arithmetic"
    path: str = ""
    shuffle: bool = True
    task_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    min_operands: int = 2
    max_operands: int = 2
    min_digits: int = 1
    max_digits: int = 1
    ops: str = "+-*"
    max_prompt_tokens: int = 0
    eval_size: int = 64
    prompt_key: str = ""
    answer_key: str = ""
    answer_marker: str = ""
    on_error: str = "fail"

    def __post_init__(self) -> None:
        try:
            get_task(self.task)
        except ValueError as e:
            raise ConfigError(f"data.task: {e}") from None
        check(
            isinstance(self.task_options, Mapping),
            f"data.task_options must be a mapping, got {type(self.task_options).__name__}",
        )
        taken = {"seed", "eval_size", "path", "shuffle", "prompt_key", "answer_key"}
        taken |= {"answer_marker", "on_error"}
        clash = sorted(set(self.task_options) & taken)
        check(not clash, f"data.task_options sets {clash}: use the data.<name> fields instead")
        check(
            self.max_prompt_tokens >= 0,
            f"data.max_prompt_tokens must be >= 0 (0 = derived from the data), "
            f"got {self.max_prompt_tokens}",
        )
        check(self.eval_size >= 0, f"data.eval_size must be >= 0, got {self.eval_size}")
        check(
            self.on_error in ("fail", "raise"),
            f"data.on_error must be fail | raise, got {self.on_error!r}",
        )
        if self.task in FILE_TASKS:
            check(bool(self.path), f"data.path is required for data.task={self.task}")
            check(os.path.isfile(self.path), f"data.path={self.path!r} is not a file")
        else:
            # File-only settings on a procedural task would be silently ignored.
            ignored = [
                f"data.{name}={getattr(self, name)!r}"
                for name in ("path", "prompt_key", "answer_key", "answer_marker")
                if getattr(self, name)
            ] + (["data.shuffle=False"] if not self.shuffle and self.task != "humaneval" else [])
            check(
                not ignored,
                f"{', '.join(ignored)}: only file tasks ({' | '.join(FILE_TASKS)}) read it, "
                f"data.task={self.task!r} ignores it (did you mean --config.data.task=file?)",
            )
        check(
            self.task != "math_file" or not self.answer_marker,
            "data.answer_marker is used by data.task=file only; math_file reads the "
            "solution's last \\boxed{}",
        )
        check(
            self.task != "code_file" or not self.answer_marker,
            "data.answer_marker is used by data.task=file only; code_file reads tests",
        )

    def task_kwargs(self) -> dict[str, Any]:
        """The options ``make_task(self.task, seed=, eval_size=, **options)`` takes."""
        if self.task == "arithmetic":
            options: dict[str, Any] = dict(
                min_operands=self.min_operands,
                max_operands=self.max_operands,
                min_digits=self.min_digits,
                max_digits=self.max_digits,
                ops=self.ops,
            )
        elif self.task in FILE_TASKS:
            # on_error="fail": a malformed row becomes a prompt failed with its
            # file:line (counted by the ledger) instead of stopping the run.
            options = dict(
                path=self.path,
                shuffle=self.shuffle,
                on_error="skip" if self.on_error == "fail" else "raise",
            )
            options.update(
                {k: getattr(self, k) for k in ("prompt_key", "answer_key") if getattr(self, k)}
            )
            if self.answer_marker:
                options["answer_marker"] = self.answer_marker
        elif self.task == "humaneval":
            options = dict(shuffle=self.shuffle)
        else:
            options = {}
        return {**options, **self.task_options}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """Reward: "" (the task's own verifier), a registered name, or "module:attr".

    ``ExperimentConfig`` replaces "" by the task's reward (``tasks.task_reward``).
    ``answer_weight`` / ``format_weight`` weigh the built-in "math" reward only.
    ``code_wall_s`` / ``code_memory_mb`` are the sandbox limits of one run of the
    "code" reward (``rewards.code_reward``); ``allow_unsandboxed`` lets it run model
    code WITHOUT isolation where bubblewrap cannot start (the code could then read
    files, use the network and kill processes); off, such a run stops at start.
    """

    fn: str = ""
    answer_weight: float = 1.0
    format_weight: float = 0.0
    num_workers: int = 2
    timeout_s: float = 10.0
    code_wall_s: float = 5.0
    code_memory_mb: int = 512
    allow_unsandboxed: bool = False

    def __post_init__(self) -> None:
        from jaxflash.rewards import REWARD_FNS  # noqa: PLC0415 (fills the registry)

        check(self.num_workers >= 1, f"reward.num_workers must be >= 1, got {self.num_workers}")
        check(self.timeout_s > 0, f"reward.timeout_s must be > 0, got {self.timeout_s}")
        module, sep, attr = self.fn.partition(":")
        check(
            not self.fn or self.fn in REWARD_FNS or bool(sep and module and attr),
            f"reward.fn must be '' (the task's own reward), a registered name "
            f"{sorted(REWARD_FNS)} or 'package.module:attr', got {self.fn!r}",
        )
        check(  # only where the code reward runs: other rewards keep any timeout_s
            self.fn != "code" or 0 < self.code_wall_s <= self.timeout_s - 1.0,
            f"reward.code_wall_s={self.code_wall_s} must be > 0 and at least 1 s under "
            f"reward.timeout_s={self.timeout_s} (the sandbox stops a program, not the pool)",
        )
        check(
            self.code_memory_mb >= 64,
            f"reward.code_memory_mb must be >= 64, got {self.code_memory_mb}",
        )
        check(
            self.fn in ("", "math") or (self.answer_weight == 1.0 and self.format_weight == 0.0),
            f"reward.answer_weight / reward.format_weight weigh the built-in math reward; "
            f"reward.fn={self.fn!r} ignores them",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """Held-out evaluation: every ``every`` steps and at the last; at step 0 (before any
    update) too unless ``at_start`` is False. No evaluation at all: ``data.eval_size=0``."""

    every: int = 5
    temperature: float = 1.0
    samples_per_prompt: int = 1
    at_start: bool = True

    def __post_init__(self) -> None:
        check(
            self.every >= 1,
            f"eval.every must be >= 1, got {self.every} (eval.at_start=False skips the "
            "evaluation before training; data.eval_size=0 turns evaluation off)",
        )
        check(
            self.samples_per_prompt >= 1,
            f"eval.samples_per_prompt must be >= 1, got {self.samples_per_prompt}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    every: int = 1
    max_to_keep: int = 2

    def __post_init__(self) -> None:
        check(self.every >= 1, f"checkpoint.every must be >= 1, got {self.every}")
