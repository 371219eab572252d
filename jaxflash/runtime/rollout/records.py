"""What a run writes: one definition of each rollouts.jsonl field and per-step metric.

Both placements (colocated and disjoint slices) write exactly these; the README's
tables document every name here (the generation servers' ``gen*`` metrics come from
``server_metrics``). Host-side numpy only.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxflash.learner.cycles import drop_empty_cycles
from jaxflash.replay.groups import Group
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.rollout.scoring import TruncationPolicy, correctness
from jaxflash.types import FailureReason, Prompt, Sample

log = logging.getLogger(__name__)

ROLLOUT_FIELDS = (
    "learner_step",
    "prompt_id",
    "sample_index",
    "prompt",
    "answer",
    "response",
    "response_tokens",
    "response_len",
    "finish_reason",
    "reward",
    "correct",
    "reward_error",
    "outcome",
    "reason",
    "failure",
    "loss_masked",
    "start_version",
    "staleness",
    "token_version_min",
    "token_version_max",
)
"""Keys of every rollouts.jsonl row, in order (docs/METRICS.md)."""


def rollout_row(
    sample: Sample,
    prompt: Any,
    *,
    outcome: str,
    reason: str,
    learner_version: int,
    truncation: TruncationPolicy,
    failure: FailureReason | None = None,
) -> dict[str, Any]:
    """The rollouts.jsonl row of one sample that left the buffer.

    Args:
      sample: the scored sample.
      prompt: its Prompt (None when no longer known: text and answer are "").
      outcome: "trained" | "filtered" | "stale" | "failed" | "regenerated" (the
        prompt is generated again; these samples are discarded).
      reason: "trained", the filter reason, "stale", "surplus_stale" or "failed".
      learner_version: version of the learner step the batch was taken for
        (the row's ``learner_step`` is the step it produces, version + 1).
      truncation: decides ``loss_masked``.
      failure: why a failed prompt failed.
    """
    versions = np.asarray(sample.token_versions)
    start = int(start_version_of(sample))
    text, answer = (prompt.text, prompt.answer) if isinstance(prompt, Prompt) else ("", "")
    row = {
        "learner_step": int(learner_version) + 1,
        "prompt_id": int(sample.prompt_id),
        "sample_index": int(sample.sample_index),
        "prompt": text,
        "answer": answer,
        "response": sample.response_text,
        "response_tokens": [int(t) for t in sample.response_tokens],
        "response_len": len(sample.response_tokens),
        "finish_reason": str(sample.finish_reason),
        "reward": sample.reward,
        "correct": correctness(sample),
        "reward_error": (sample.reward_info or {}).get("error"),
        "outcome": outcome,
        "reason": reason,
        "failure": None if failure is None else str(failure),
        "loss_masked": outcome != "trained" or truncation.masks(sample),
        "start_version": start,
        "staleness": int(learner_version) - start,
        "token_version_min": int(versions.min()) if versions.size else None,
        "token_version_max": int(versions.max()) if versions.size else None,
    }
    return row


def batch_metrics(groups: Sequence[Group], trained: Sequence[Sample]) -> dict[str, Any]:
    """Sample statistics of one learner step.

    Args:
      groups: the step's groups (every sample of a trained prompt).
      trained: the samples that carried loss (masked ones excluded).

    Returns:
      num_groups, num_samples (samples with loss), samples_masked, and over every
      sample of ``groups`` (masked included: they are what the policy produced for
      the trained prompts): reward_mean, reward_std, accuracy (``correctness``),
      response_len_mean, response_len_max, truncated_frac; with a reward that reports
      ``outcome/<name>`` components (``code``: how each sandboxed run ended),
      sandbox_outcomes = {name: samples}. Only the counts when there are no groups.
    """
    samples = [s for g in groups for s in g.samples]
    out: dict[str, Any] = {
        "num_groups": len(groups),
        "num_samples": len(trained),
        "samples_masked": len(samples) - len(trained),
    }
    if not samples:
        return out
    rewards = np.array([s.reward for s in samples], np.float64)
    lens = np.array([len(s.response_tokens) for s in samples], np.float64)
    out.update(
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        accuracy=float(np.mean([correctness(s) for s in samples])),
        response_len_mean=float(lens.mean()),
        response_len_max=float(lens.max()),
        truncated_frac=float(np.mean([s.truncated for s in samples])),
    )
    outcomes = collections.Counter(
        name.removeprefix("outcome/")
        for s in samples
        for name, value in (s.reward_info or {}).get("components", {}).items()
        if name.startswith("outcome/") and value
    )
    if outcomes:
        out["sandbox_outcomes"] = dict(sorted(outcomes.items()))
    return out


def staleness_metrics(stale: np.ndarray) -> dict[str, Any]:
    """staleness_mean/max/hist over the samples with loss (learner version - start)."""
    if stale.size == 0:
        return {}
    values, counts = np.unique(stale, return_counts=True)
    return {
        "staleness_mean": float(stale.mean()),
        "staleness_max": int(stale.max()),
        "staleness_hist": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
    }


def learner_metrics(train: dict[str, float]) -> dict[str, float]:
    """The train step's metrics, with the engine-vs-learner logprob gap split in two.

    ``logprob_gap_on_policy_max``: max |log pi - log mu| over tokens sampled by the
    learner's current version (engine/learner numerical agreement: float rounding);
    ``logprob_gap_off_policy_max``: the same over tokens of older versions (policy
    change plus rounding; 0 when there are none); ``on_policy_tokens`` counts the
    former. A dual-cycle step's per-cycle ratio statistics are left out for a cycle
    that had no tokens (``learner.cycles.drop_empty_cycles``).
    """
    out = drop_empty_cycles(train)  # no ratio statistics for a cycle without tokens
    out.pop("logprob_gap_max", None)  # the max over both kinds: reported split below
    out["logprob_gap_on_policy_max"] = out.pop("logprob_gap_max_current")
    out["logprob_gap_off_policy_max"] = out.pop("logprob_gap_max_off_policy")
    out["on_policy_tokens"] = out.pop("current_tokens")
    return out


def timeline_row(
    step: int,
    spans: dict[str, Any],
    *,
    origin: float,
    wait: tuple[float, float],
    train: tuple[float, float],
    publish: tuple[float, float],
) -> dict[str, Any]:
    """One step's timeline.jsonl row; every time in seconds since ``origin`` (run start).

    Args:
      step: the policy version after the step.
      spans: ``RolloutScheduler.take_timeline_spans()``: "gen" (busy (t0, t1) per
        server, since the previous step's row) and "reward" (submitted, scored).
      origin: clock time of the run's start.
      wait, train, publish: the learner's (t0, t1): waiting for the batch, the
        update, the weight publish (copy + hand-over).

    Returns:
      {"step", "learner": {"wait", "train", "publish"}: [t0, t1], "gen": [[[t0, t1],
      ...] per server], "reward": [[t0, t1], ...]} (docs/METRICS.md).
    """

    def rel(span) -> list[float]:
        return [round(float(span[0]) - origin, 4), round(float(span[1]) - origin, 4)]

    return {
        "step": int(step),
        "learner": {"wait": rel(wait), "train": rel(train), "publish": rel(publish)},
        "gen": [[rel(s) for s in server] for server in spans.get("gen", [])],
        "reward": [rel(s) for s in spans.get("reward", [])],
    }


# (metric, label, format) of the console's step line, in order; absent ones are left out.
_STEP_LINE = (
    ("reward_mean", "reward_mean", "{:.3f}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("response_len_mean", "response_len_mean", "{:.1f} tokens"),
    ("truncated_frac", "truncated_frac", "{:.2f}"),
    ("grad_norm", "grad_norm", "{:.3g}"),
    ("logprob_gap_on_policy_max", "logprob_gap_on_policy_max", "{:.2g}"),
    ("staleness_max", "staleness_max", "{:d}"),
    ("cycle_replay_samples", "replayed", "{:d} samples"),
    ("gen_tokens_per_s", "generation", "{:.1f} tokens/s"),
    ("train_tokens_per_s", "training", "{:.1f} tokens/s"),
)


def time_metrics(
    *,
    step_s: float,
    train_s: float,
    wait_s: float,
    trained_at_s: float,
    learner_metrics: dict[str, Any],
    sync: Any,
) -> dict[str, Any]:
    """A step's times, rates and weight sync (seconds; docs/METRICS.md names).

    Args:
      step_s, train_s, wait_s: the step's, the update's and the learner's wait for the
        batch. trained_at_s: since the first request of the run.
      learner_metrics: the update's (its "tokens" trained).
      sync: the publish (``fleet.WeightSync``: copy_s, handover_s, bytes).
    """
    return {
        "train_time_s": train_s,
        "train_tokens_per_s": learner_metrics.get("tokens", 0.0) / max(train_s, 1e-9),
        "trained_at_s": trained_at_s,
        "weight_sync_s": sync.copy_s + sync.handover_s,
        "weight_copy_s": sync.copy_s,
        "publish_bytes": sync.bytes,  # adapters only under LoRA
        "learner_wait_s": wait_s,
        "learner_idle_frac": wait_s / max(step_s, 1e-9),
        "step_time_s": step_s,
    }


def step_line(
    step: int, total_steps: int, elapsed: str, metrics: dict[str, Any], first_update: bool = False
) -> str:
    """The console's one line per step: every column labelled, rates with their unit.

    Args:
      step: the policy version after the step (0: the evaluation before training).
      total_steps: the run's ``total_steps``.
      elapsed: time since the run started, as text.
      metrics: the step's metrics.jsonl row.
      first_update: the step's update was the first (its time is mostly XLA compiling
        it: said next to its rate).
    """
    parts = [f"step {step}/{total_steps}", f"elapsed {elapsed}"]
    if "step_time_s" in metrics:
        parts.append(f"step_time {metrics['step_time_s']:.1f} s")
    if "skipped" in metrics:
        parts.append(f"skipped: {metrics['skipped']} (nothing to train)")
    for key, label, fmt in _STEP_LINE:
        value = metrics.get(key)
        if key == "logprob_gap_on_policy_max" and metrics.get("on_policy_tokens") == 0:
            parts.append(f"{label} n/a (no on-policy tokens)")  # 0 would read as agreement
        elif isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{label} {fmt.format(int(value) if fmt == '{:d}' else value)}")
    if metrics.get("elastic_to_learner") or metrics.get("elastic_to_generation"):
        parts.append(  # an elastic move at this boundary (runtime.elastic)
            f"moved: learner {metrics['learner_devices']} devices, "
            f"{metrics['generation_slices']} generation slices from the next step"
        )
    if "eval_accuracy" in metrics:
        # metrics.jsonl writes a non-finite value as a string ("nan": no prompt scored,
        # or < 2 prompts for a standard error), so both are checked before formatting.
        acc, err = metrics["eval_accuracy"], metrics.get("eval_accuracy_stderr")
        text = f"eval_accuracy {acc:.3f}" if _finite(acc) else "eval_accuracy n/a"
        text += f" ± {err:.3f}" if _finite(acc) and _finite(err) else ""
        parts.append(f"{text} ({metrics.get('eval_prompts', 0)} prompts)")
    return " | ".join(parts) + (" (first update: includes compiling it)" if first_update else "")


def _finite(value: Any) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and bool(np.isfinite(value))


def write_run_config(workdir: str, exp: Any, tokenizer: Any, prompt_lengths: Any) -> str:
    """Writes ``<workdir>/run_config.json`` (making ``workdir``): the experiment as run and
    the stop set.

    The experiment after everything derived at start (the task's reward, the prompt
    limits measured from the data), the prompt lengths measured, and the
    tokenizer's stop set: every id that ends a response, its token and the
    sources that named it (eos, generation_config.json, GGUF eot, the template).
    Rewritten at every start, so it describes the latest launch; when a resumed
    launch changes a setting other than ``total_steps``, the previous file is kept as
    ``run_config.<n>.json`` and a warning names every changed field.

    Returns:
      The file's path.
    """
    os.makedirs(workdir, exist_ok=True)  # only once the config is known to run
    stops = tokenizer.stop_set
    info = {
        "experiment": dataclasses.asdict(exp),
        "prompt_lengths": dataclasses.asdict(prompt_lengths),
        "stop_set": {
            "ids": sorted(stops.ids),
            "tokens": {str(i): tokenizer.id_to_token(i) for i in sorted(stops.ids)},
            "sources": {str(i): list(stops.sources[i]) for i in sorted(stops.ids)},
            "describe": stops.describe(tokenizer.id_to_token),
        },
    }
    path = os.path.join(workdir, "run_config.json")
    info = json.loads(json.dumps(info, default=str))  # as it reads back
    changed = _changed_settings(path, info["experiment"])
    if changed:
        n = 1
        while os.path.exists(os.path.join(workdir, f"run_config.{n}.json")):
            n += 1
        os.replace(path, os.path.join(workdir, f"run_config.{n}.json"))
        log.warning(
            "this launch changes settings of the run in %s: %s (the previous settings are "
            "kept in run_config.%d.json)", workdir, "; ".join(changed), n
        )  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return path


def _changed_settings(path: str, new: dict[str, Any]) -> list[str]:
    """ "field: old -> new" for each setting that differs from ``path``'s (total_steps,
    the documented way to train further, excepted); [] when there is no earlier file."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)["experiment"]
    except (OSError, ValueError, KeyError):
        return []

    def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            out: dict[str, Any] = {}
            for k, v in tree.items():
                out.update(leaves(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: tree}

    a, b = leaves(old), leaves(new)
    keys = sorted((set(a) | set(b)) - {"total_steps", "learner.total_steps"})
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def describe_model(config: Any, lora: Any = None) -> str:
    """One console line: the shape of a ``ModelConfig``, and what is trained.

    Args:
      lora: ``learner.lora`` (a ``models.lora.LoraConfig``) or None: with it, the line
        names the rank, the targets, the float32 adapters and the frozen base's storage
        (int8/int4: QLoRA) instead of "<param_dtype> params".
    """
    valid = config.valid_vocab_size
    vocab = f"vocab {config.vocab_size}" + (f" ({valid} used)" if valid else "")
    if lora is None:
        trained = f"{config.param_dtype} params"
    else:  # adapters are float32 (models.lora.adapter_layout); the base never trains
        kind = "QLoRA" if lora.base_dtype in ("int8", "int4") else "LoRA"
        trained = (
            f"{kind} rank {lora.rank} (alpha {lora.alpha:g}) on {','.join(lora.targets)}: "
            f"float32 adapters trained, the base frozen in {lora.base_dtype}"
        )
    return (
        f"{config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads "
        f"({config.n_kv_heads} kv), {vocab}, context {config.max_seq_len}, "
        f"{trained}, {config.compute_dtype} compute"
    )


def describe_schedule(exp: Any) -> str:
    """One console line: synchronous, or asynchronous with its staleness bound alpha.

    Args:
      exp: the ``ExperimentConfig`` (``rollout.async_ratio``, ``mesh``, ``controller``,
        ``learner.loss``).
    """
    alpha = exp.rollout.async_ratio
    if alpha == 0:
        return (
            "schedule: synchronous (rollout.async_ratio=0): each step trains on samples of "
            "the policy it starts with"
        )
    adaptive = exp.controller.kind == "adaptive"
    bound = f"the adaptive controller sets alpha <= {alpha} each step" if adaptive else ""
    return (
        f"schedule: asynchronous, staleness <= alpha = {alpha} (rollout.async_ratio): "
        "generation keeps decoding on its own slices while the learner trains, and a "
        f"sample may be up to {alpha} policy versions old (loss {exp.learner.loss})"
        + (f"; {bound}" if bound else "")
    )


def check_finite(metrics: dict[str, Any], step: int) -> None:
    """Fail loudly on NaN/Inf training metrics (eval NaN with no prompts is allowed).

    Raises:
      FloatingPointError: ``loss``, ``grad_norm`` or ``entropy`` is not finite.
    """
    for key in ("loss", "grad_norm", "entropy"):
        value = metrics.get(key)
        if value is not None and not math.isfinite(value):
            raise FloatingPointError(f"step {step}: metric {key} is {value}: {metrics}")
