"""Start a learner fresh or resume it from a run directory."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from jax.sharding import Mesh

from jaxflash.checkpoint.checkpointer import Checkpointer, CheckpointMeta
from jaxflash.learner.state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    from_params,
)
from jaxflash.metrics.writer import truncate_jsonl
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.runtime.config.experiment import ConfigError
from jaxflash.sharding.rules import LEARNER_RULES

log = logging.getLogger(__name__)


def init_or_restore_learner(
    model_config: ModelConfig,
    imported_params: Any,
    learner_mesh: Mesh,
    workdir: str,
    *,
    learner: Any,
    checkpoint: Any,
    model: Any,
    seed: int,
    records: bool = True,
) -> tuple[TrainState, CheckpointMeta, Checkpointer]:
    """The learner state and its metadata, restored when possible (the rollout restores
    its own books from the metadata, ``rollout.scheduler_setup.make_scheduler``).

    A complete checkpoint under ``<workdir>/checkpoints`` is restored onto
    ``learner_mesh`` (Orbax ignores half-written ones); rows of metrics.jsonl and
    rollouts.jsonl written after it belong to lost work and are dropped. Otherwise
    the state is created born sharded: from ``imported_params`` (GGUF / HF), or
    randomly initialised when that is None; rows left by an earlier start that was
    killed before its first checkpoint are all lost work, and dropped (a cut last
    line included). ``records=False`` leaves metrics.jsonl
    and rollouts.jsonl alone (the other processes of a multi-process learner:
    process 0 owns them).

    Args:
      learner, checkpoint, model: the experiment's sections (``exp.learner``, ...;
        ``model`` names a LoRA base, ``base_record``).
      seed: the experiment's seed (the fresh state's initialisation).

    Returns:
      (state, meta, checkpointer); the caller owns the checkpointer.
    """
    checkpointer = Checkpointer(
        os.path.join(workdir, "checkpoints"), max_to_keep=checkpoint.max_to_keep
    )
    abstract_state = abstract_train_state(model_config, learner, learner_mesh, LEARNER_RULES)
    lora = learner.lora is not None
    if lora:  # checkpoints hold the adapters; the base is named, not copied (base_record)
        abstract_state = abstract_state.replace(base=None)
    restored = checkpointer.restore_latest(abstract_state)
    if restored is not None:
        state, meta = restored
        if lora:
            base = _rebuild_base(
                model_config, imported_params, learner_mesh, meta,
                learner=learner, model=model, seed=seed,
            )  # fmt: skip
            state = state.replace(base=base)
        log.info("resumed from step %d (data cursor %d)", meta.step, meta.data_cursor)
        if records:
            truncate_jsonl(os.path.join(workdir, "metrics.jsonl"), "step", meta.step)
            truncate_jsonl(os.path.join(workdir, "rollouts.jsonl"), "learner_step", meta.step)
            truncate_jsonl(os.path.join(workdir, "timeline.jsonl"), "step", meta.step)
        return state, meta, checkpointer
    if records:  # nothing committed: whatever an earlier start wrote is lost work
        dropped = truncate_jsonl(os.path.join(workdir, "metrics.jsonl"), "step", -1)
        dropped += truncate_jsonl(os.path.join(workdir, "rollouts.jsonl"), "learner_step", -1)
        truncate_jsonl(os.path.join(workdir, "timeline.jsonl"), "step", -1)
        if dropped:
            log.warning(
                "%s has no checkpoint: dropped %d rows of an earlier start", workdir, dropped
            )
    if imported_params is None:
        state = create_train_state(model_config, learner, learner_mesh, LEARNER_RULES, seed=seed)
    else:
        state = from_params(
            imported_params, model_config, learner, learner_mesh, LEARNER_RULES, seed=seed
        )
    return state, CheckpointMeta(step=0), checkpointer


def base_record(base: Any, *, model: Any, lora: Any) -> dict[str, Any]:
    """What a LoRA checkpoint says about its frozen base instead of holding it: the
    weights' source and the SHA-256 digest of the stored base (None with several
    processes, where no process sees the whole base).

    Args:
      base: the frozen base (``TrainState.base``).
      model, lora: the experiment's ``model`` section and ``learner.lora``.
    """
    import jax  # noqa: PLC0415

    from jaxflash.sync.transfer_digest import tree_digest  # noqa: PLC0415

    m = model
    digest = tree_digest(base) if jax.process_count() == 1 else None
    return {
        "source": m.source,
        "path": m.path,
        "preset": m.preset if m.source == "random" else "",
        "base_dtype": lora.base_dtype,
        "digest": digest,
    }


def _rebuild_base(
    model_config: ModelConfig,
    imported_params: Any,
    mesh: Mesh,
    meta: CheckpointMeta,
    *,
    learner: Any,
    model: Any,
    seed: int,
) -> Any:
    """The LoRA base of a resumed run, rebuilt from its source and checked against the
    digest the checkpoint recorded.

    Raises:
      ValueError: the rebuilt base's digest differs (the weights at model.* changed).
    """
    if imported_params is None:
        fresh = create_train_state(model_config, learner, mesh, LEARNER_RULES, seed=seed)
    else:
        fresh = from_params(imported_params, model_config, learner, mesh, LEARNER_RULES, seed=seed)
    saved = meta.extra.get("lora_base", {})
    now = base_record(fresh.base, model=model, lora=learner.lora)
    if saved.get("digest") and now["digest"] and saved["digest"] != now["digest"]:
        raise ValueError(
            f"resume: the LoRA checkpoint was trained on base {saved} but model.* now gives "
            f"digest {now['digest']} (source {now['source']!r}, path {now['path']!r})"
        )
    return fresh.base


def finished_step(workdir: str, total_steps: int) -> int | None:
    """The step of the last complete checkpoint in ``workdir`` if it reached
    ``total_steps`` (the run is finished), else None (fresh start or resume).

    Reads only the checkpoint directory: no model, no device memory.
    """
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return None
    with Checkpointer(directory) as checkpointer:
        step = checkpointer.latest_step()
    return step if step is not None and step >= total_steps else None


def finished_run(
    workdir: str, total_steps: int, console: Any, model: Any = None
) -> dict[str, Any] | None:
    """A run already finished in ``workdir``: said on ``console``, its last metrics row
    returned (nothing is resumed); None: a fresh start or a resume.

    Args:
      model: the launch's ``ModelSpec``: a finished run of another model is refused here
        (``check_finished_model``), before "finished" advises ``--config.total_steps``
        that the model check after the load would then refuse.

    Raises:
      ConfigError: ``workdir`` holds a finished run of another model.
    """
    step = finished_step(workdir, total_steps)
    if step is None:
        return None
    if model is not None:
        check_finished_model(workdir, model)
    console.line(finished_note(workdir, step, total_steps))
    return last_metrics(workdir)


def check_finished_model(workdir: str, model: Any) -> None:
    """Refuses a launch whose weights are not the ones ``workdir``'s run was trained
    from (``run_config.json``'s ``model``: ``source``, and ``preset`` or ``path``), read
    without loading them; a workdir without the file passes.

    Raises:
      ConfigError: they differ (naming the fields, saved vs now).
    """
    try:
        with open(os.path.join(workdir, "run_config.json"), encoding="utf-8") as f:
            saved = json.load(f)["experiment"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    keys = ("source", "preset") if model.source == "random" else ("source", "path")
    diff = {f"model.{k}": (saved.get(k), getattr(model, k)) for k in keys}
    diff = {k: v for k, v in diff.items() if v[0] != v[1]}
    if diff:
        raise ConfigError(
            f"workdir {workdir} holds a finished run of another model (field: saved vs "
            f"now) {diff}; pass its model.* settings to train it further, or use a new "
            "--workdir"
        )


def finished_note(workdir: str, step: int, total_steps: int) -> str:
    """The console's answer to a run asked to continue past its finished last step."""
    return (
        f"{workdir} is finished: its last checkpoint is step {step} and total_steps="
        f"{total_steps}. To train further, run the same command with "
        f"--config.total_steps=<more than {step}> (it resumes from step {step}); "
        "to start over, pass a new --workdir."
    )


def resumed_note(meta: CheckpointMeta, in_flight: int, total_steps: int, workdir: str) -> str:
    """The console's line for a run resumed from ``meta``'s checkpoint, with ``in_flight``
    prompts open in the rollout's restored ledger."""
    return (
        f"resumed from step {meta.step} of {total_steps} in {workdir} (data cursor "
        f"{meta.data_cursor}; {in_flight} prompts in flight, generated again)"
    )


def stopped_note(version: int, workdir: str, *, preempted: bool) -> str:
    """The console's line for a run that stops before its last step (SIGTERM, stop_after)."""
    if preempted and version == 0:
        return (
            f"preempted (SIGTERM) before its first step: nothing to save; run the same "
            f"command to start {workdir}"
        )
    if preempted:
        return (
            f"preempted (SIGTERM): saved step {version}; run the same command to "
            f"resume {workdir} from it"
        )
    return f"stopped after step {version} (stop_after)"


def finished_line(version: int, total_steps: int, elapsed: str, workdir: str) -> str:
    """The console's last line of a run that reached its last step (its TensorBoard
    command names the venv's ``tensorboard``, beside this Python: a bare ``tensorboard``
    is not on the PATH of a venv that is not activated)."""
    return (
        f"finished {version}/{total_steps} steps in {elapsed}: {workdir}/metrics.jsonl, "
        f"rollouts.jsonl; {venv_tool('tensorboard')} --logdir {workdir}/tensorboard"
    )


def venv_tool(name: str) -> str:
    """The command of script ``name`` of this Python's environment (``sys.executable``'s
    bin directory, unresolved so a venv stays a venv): relative to the working directory
    when under it (``.venv/bin/tensorboard``), else absolute."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def nothing_trained(record: dict[str, Any], version: int) -> str:
    """Why a run that reached step ``version`` trained nothing ("" when it trained): every
    step was skipped (``steps_skipped``, which a resume carries on, equals the steps run).

    Args:
      record: the run's last metrics row (its counters ``steps_skipped``,
        ``steps_skipped_<reason>`` and ``prompt_outcomes``).
    """
    skipped = int(record.get("steps_skipped", 0) or 0)
    if version <= 0 or skipped < version:
        return ""
    prefix = "steps_skipped_"
    why = {k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix) and v}
    failed = (record.get("prompt_outcomes") or {}).get("failed") or {}
    failures = f"; failed prompts by reason: {failed}" if failed else ""
    return (
        f"all {version} steps were skipped with nothing to train (by reason: {why}{failures}): "
        "the weights are the ones the run started with; check reward.fn and the data "
        "(rollouts.jsonl names each sample's failure)"
    )


def last_metrics(workdir: str) -> dict[str, Any]:
    """The last row of ``<workdir>/metrics.jsonl`` ({} if none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    last: dict[str, Any] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                last = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
    return last


def checkpoint_meta(
    step: int,
    snapshot: tuple[dict[str, Any], dict[str, int], int, dict[str, int]],
    replay: dict[str, Any] | None = None,
    elastic: dict[str, Any] | None = None,
    *,
    wall: dict[str, float] | None = None,
) -> CheckpointMeta:
    """What a checkpoint at ``step`` keeps beside the learner state (what resuming reads).

    Args:
      step: the learner step, which is also the policy version.
      snapshot: ``RolloutScheduler.snapshot()`` taken before the step's weights were
        published: (the ledger's state, the counters, the data cursor, the group
        buffer's counters); the ledger's prompts in flight are generated again on resume.
      replay: ``ReplayCycle.state_dict()`` (None without replay).
      elastic: ``ElasticPool.state_dict()`` (None without elastic moves).
      wall: the run's clocks (``StepTimes.wall_state``: ``run_s``, ``trained_s``), which
        a resume continues (``trained_at_s`` and the console's elapsed never go back).

    Returns:
      ``CheckpointMeta`` with ``extra`` = {"ledger", "counters", "group_buffer"[, "replay"][,
        "elastic"][, "wall"]}.
    """
    ledger_state, counts, cursor, buffer_counts = snapshot
    extra: dict[str, Any] = {"ledger": ledger_state, "counters": counts}
    extra["group_buffer"] = buffer_counts  # the buffer_* metrics go on from here
    if replay is not None:
        extra["replay"] = replay
    if elastic is not None:
        extra["elastic"] = elastic
    if wall:
        extra["wall"] = {k: float(v) for k, v in wall.items()}
    return CheckpointMeta(
        step=step, data_cursor=cursor, policy_version=step, counters=counts, extra=extra
    )
