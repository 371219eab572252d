"""``launch/tpu_pod.py --dry_run``: size an experiment's programs before paying for a pod.

Compiles the experiment's learner step (on ``mesh.learner``) and one generation
slice's engine prefill and decode step (on ``mesh.generation``) ahead of time,
against abstract arrays (``jax.jit(...).lower(...).compile()``: nothing is
allocated, no weights are read), and returns XLA's per-device memory plan
(``jaxflash.sizing.dry_run``). On a laptop the devices are fake CPU devices, so
temporaries are XLA:CPU's; arguments and outputs have the target's shapes and
shardings. On a TPU VM (``JAX_PLATFORMS`` unset) it compiles for the real chips.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from jaxflash.models.config import ModelConfig, get_preset
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.specs import ConfigError
from jaxflash.runtime.model_setup import engine_config

ASSUMED_PROMPT_TOKENS = 256
"""Prompt length assumed when the config derives it from the data at run time."""


def devices_needed(exp: ExperimentConfig) -> int:
    """Devices the dry run needs: the larger of the learner mesh and one generation slice."""
    n_learner = math.prod(int(v) for v in exp.mesh.learner.values())
    return max(n_learner, math.prod(int(v) for v in exp.mesh.generation.values()))


def _model(exp: ExperimentConfig, max_seq_len: int) -> tuple[ModelConfig, str]:
    spec = exp.model
    if spec.source == "hf":
        raise ConfigError(
            "--dry_run with model.source=hf: the shapes come from a preset; pass "
            "--config.model.source=random --config.model.preset=<the checkpoint's family>"
        )
    # A GGUF source is the SmolLM2-135M file: the smollm2_135m preset has its shapes.
    config = get_preset(spec.preset)
    config = config.replace(
        compute_dtype=spec.compute_dtype,
        remat=spec.remat,
        logits_chunk=spec.logits_chunk,
        max_seq_len=max(config.max_seq_len, max_seq_len),
    )
    return config, f"{spec.preset} ({spec.source})"


def dry_run_report(exp: ExperimentConfig) -> str:
    """The memory report of ``exp``'s learner step and generation engine, per device.

    Raises:
      ConfigError: model.source=hf (no shapes without reading the checkpoint), or
        fewer devices than the meshes need (naming both numbers).
    """
    from jaxflash.sharding.mesh import make_mesh  # noqa: PLC0415
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES  # noqa: PLC0415
    from jaxflash.sizing.dry_run import dry_run, format_report  # noqa: PLC0415

    r = exp.rollout
    prompt = r.max_prefill_length or exp.data.max_prompt_tokens
    note = ""
    if not prompt:
        prompt = ASSUMED_PROMPT_TOKENS
        note = (
            f"\n(the run derives the prompt length from the data; this plan assumes "
            f"{prompt} tokens: set --config.data.max_prompt_tokens to size another)"
        )
    exp = exp.with_prompt_lengths(prompt)
    seq_len = exp.rollout.max_prefill_length + r.sampling.max_new_tokens
    model, what = _model(exp, seq_len)
    need, have = devices_needed(exp), jax.device_count()
    if have < need:
        raise ConfigError(f"--dry_run: the meshes need {need} devices, this host has {have}")
    devices = jax.devices()
    lmesh = make_mesh(devices[: math.prod(exp.mesh.learner.values())], dict(exp.mesh.learner))
    gmesh = make_mesh(devices[: math.prod(exp.mesh.generation.values())], dict(exp.mesh.generation))
    batch = r.prompts_per_step * r.group_size
    reports: list[Any] = dry_run(
        model, exp.learner, engine_config(exp),
        learner_mesh=lmesh, learner_rules=LEARNER_RULES,
        generation_mesh=gmesh, generation_rules=GENERATOR_RULES,
        batch_size=batch, seq_len=seq_len,
    )  # fmt: skip
    title = (
        f"{what}, {model.param_dtype} params, {model.compute_dtype} compute, on "
        f"{devices[0].platform}: learner {dict(lmesh.shape)} batch [{batch}, {seq_len}] "
        f"micro {exp.learner.micro_batch_size}; one generation slice {dict(gmesh.shape)} "
        f"{r.num_slots} slots, prefill {exp.rollout.max_prefill_length}, cache {seq_len}"
    )
    return format_report(reports, title=title) + note
