"""The RLVR program, top to bottom: one loop for both placements.

    sample prompts ─► generate (servers) ─► score (reward workers) ─► group ─►
    advantages ─► train (jitted, sharded) ─► publish weights (D2D) ─► evaluate ─► checkpoint

One learner step: ``RolloutScheduler.next_batch`` waits for B groups whose
staleness is <= α; advantages per group; the jitted ``train_step``; the new
weights go device to device to every generation server, which keep decoding
(ROLL Flash, arXiv 2510.11345); then metrics, evaluation and a checkpoint.

Placements (``runtime.placement``):

* colocated (``mesh.colocated=True``, α = 0): ONE generation server on the
  learner's own devices. Nothing is admitted until the new weights are
  published, so the server is idle while the learner trains: the synchronous
  baseline every speed-up is measured against.
* disjoint slices (α >= 0): one server per generation slice; with α > 0 the
  servers run up to α versions ahead of the learner.

A step with nothing to train (every sample masked, every group filtered, failed
or stale) is skipped with a counted reason (``steps_skipped_<reason>``): the
policy version still advances, with the weights unchanged, so the run goes on.

Before the model loads, everything the config names is built or checked: the
task (``runtime.task_setup``), its reward, the tokenizer and its stop set, and
the prompt limits derived from the data (all in ``<workdir>/run_config.json``);
a workdir that already reached ``total_steps`` is reported and left alone. The
console (``runtime.console``) names every long phase while it runs.

Resume: the ledger, the counters and the data cursor are in the checkpoint;
prompts in flight at the checkpoint are regenerated from scratch at the restored
version (``prompts_regenerated_on_resume``), never trained twice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxflash.algorithms.advantages import get_advantage_estimator
from jaxflash.checkpoint.checkpointer import CheckpointMeta
from jaxflash.data.prompts import PromptSource
from jaxflash.learner.state import state_shardings
from jaxflash.learner.step import make_logprob_fn, make_train_step
from jaxflash.metrics.writer import MetricsWriter
from jaxflash.replay.group_buffer import GroupBuffer, GroupFilter
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime import records
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.runtime.console import Console, EvalStatus, GenerationStatus, duration
from jaxflash.runtime.evaluation import evaluate
from jaxflash.runtime.experiment import ExperimentConfig
from jaxflash.runtime.gen_server import GenerationServer
from jaxflash.runtime.inbox import Inbox
from jaxflash.runtime.learner_batch import empty_reason, learner_batch
from jaxflash.runtime.model_setup import (
    check_workdir_model,
    load_model,
    load_tokenizer,
    make_engine,
    make_reward,
)
from jaxflash.runtime.placement import carve
from jaxflash.runtime.replay_cycle import make_replay_cycle
from jaxflash.runtime.resume import finished_step, init_or_restore_learner, last_metrics
from jaxflash.runtime.reward_pool import RewardPool
from jaxflash.runtime.scheduler import RolloutScheduler
from jaxflash.runtime.scoring import TruncationPolicy
from jaxflash.runtime.task_setup import (
    build_task,
    eval_prompts,
    measure_prompts,
    prompt_by_id,
    prompt_lengths,
)
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.sync.publish import Publisher

log = logging.getLogger(__name__)


def run(
    exp: ExperimentConfig,
    *,
    workdir: str,
    server_factory: Callable[..., Any] = GenerationServer,
    clock: Clock | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Runs (or resumes) an RLVR experiment in ``workdir``.

    Args:
      exp: the validated experiment.
      workdir: run directory; a complete checkpoint there is resumed from, and a
        run whose last checkpoint reached ``exp.total_steps`` is not run again.
      server_factory: builds each generation server like ``GenerationServer``
        (tests wrap it to inject faults).
      clock: time source of every timing (default: real time).
      console: step lines and progress during long phases (default: silent).

    Returns:
      The last step's metrics (a finished run: the last row of its metrics.jsonl).

    Raises:
      ConfigError: the task, its data or the reward cannot run (naming the fields),
        found before the model loads.
      TimeoutError: no batch could be assembled in time (servers hung).
      RuntimeError: every generation server died.
      FloatingPointError: a non-finite loss, gradient norm or entropy.
    """
    clock = clock or RealClock()
    console = console or Console(None)
    t_run = clock.now()
    done = finished_step(workdir, exp.total_steps)
    if done is not None:  # nothing to do: say so instead of resuming silently
        console.line(
            f"{workdir} is finished: its last checkpoint is step {done} and total_steps="
            f"{exp.total_steps}. To train further, run the same command with "
            f"--config.total_steps=<more than {done}> (it resumes from step {done}); "
            "to start over, pass a new --workdir."
        )
        return last_metrics(workdir)

    # ------------------------------------------------------------ task, reward, tokenizer
    # Everything that can be wrong with the config fails here, before the slow model load.
    console.background("setting up")
    placement = carve(exp.mesh)
    console.line(f"devices: {placement.describe()}")
    reward = make_reward(exp.reward)  # resolve a custom reward before the slow model load
    with console.phase(f"building task {exp.data.task}"):
        task = build_task(exp)
        tokenizer = load_tokenizer(exp.model)
    measured = {"rows": 0, "of": 0}
    with console.phase(
        "measuring prompt lengths",
        lambda: f"{measured['rows']}/{measured['of']} rows rendered with the chat template",
    ):
        lengths, every_row = measure_prompts(
            task, tokenizer, on_row=lambda i, n: measured.update(rows=i, of=n)
        )
    exp, lengths_info = prompt_lengths(exp, lengths, every_row)
    stops = tokenizer.stop_set.describe(tokenizer.id_to_token)
    console.line(f"task {exp.data.task}, reward {exp.reward.fn}; {lengths_info.describe()}")
    console.line(f"stop set (ids that end a response): {stops}")
    os.makedirs(workdir, exist_ok=True)  # only once the config is known to run
    records.write_run_config(workdir, exp, tokenizer, lengths_info)

    # ------------------------------------------------------------ model + learner (born sharded)
    what = exp.model.path or {"gguf": "SmolLM2-135M-Instruct GGUF"}.get(exp.model.source, "")
    what = what or f"random-init preset {exp.model.preset}"
    with console.phase("loading the model", announce=f"loading the model ({what}) ..."):
        model_config, imported_params = load_model(exp.model, exp.rollout, tokenizer)
    log.debug("model: %s", model_config)
    console.line(f"model: {records.describe_model(model_config)}")
    check_workdir_model(workdir, model_config)
    console.background("setting up the learner, the generation engines and the reward workers")
    with console.phase("building the learner state"):
        state, meta, ledger, checkpointer = init_or_restore_learner(
            exp, model_config, imported_params, placement.learner, workdir
        )
    if meta.step:
        console.line(
            f"resumed from step {meta.step} of {exp.total_steps} in {workdir} (data cursor "
            f"{meta.data_cursor}; {len(ledger.open_ids)} prompts in flight, generated again)"
        )
    del imported_params
    train_step = make_train_step(model_config, exp.learner, placement.learner, LEARNER_RULES)
    step_sharding = state_shardings(
        model_config, exp.learner, placement.learner, LEARNER_RULES
    ).step

    # ------------------------------------------------------------ engines + first weights
    version = int(meta.step)  # policy version == learner steps taken
    engines = [make_engine(exp, model_config, mesh, tokenizer) for mesh in placement.generation]
    publishers = [Publisher() for _ in engines]

    def publish_weights(params: Any, v: int) -> list[Any]:
        """Learner params -> every generation mesh, device to device (version v)."""
        pairs = zip(publishers, engines, strict=True)
        out = [pub.publish(params, shardings, v).params for pub, (_, shardings) in pairs]
        jax.block_until_ready(out)
        return out

    with console.phase("publishing the weights to the generation engines"):
        gen_params = publish_weights(state.params, version)

    # ------------------------------------------------------------ data, rewards, scheduler
    r = exp.rollout
    B, G = r.prompts_per_step, r.group_size
    # ReFlow's replay cycle (runtime.replay_cycle; None without replay): B - fresh groups
    # of every learner batch come from the replay buffer instead of the servers.
    cycle = make_replay_cycle(
        exp,
        learner_mesh=placement.learner,
        generation_meshes=placement.generation,
        logprob_fn=make_logprob_fn(model_config, exp.learner, placement.learner, LEARNER_RULES),
        extra=meta.extra,
    )
    B = cycle.fresh_prompts if cycle else B
    train_rows = task.train
    held_out = eval_prompts(task, tokenizer, exp.data.max_prompt_tokens)
    source = PromptSource(
        train_rows,
        tokenizer,
        max_prompt_tokens=exp.data.max_prompt_tokens,
        start=meta.data_cursor,
        cycle=not callable(train_rows),  # a file is read in epochs; ids keep growing
    )
    resume = tuple(prompt_by_id(train_rows, source, pid) for pid in sorted(ledger.open_ids))
    reward_pool = RewardPool(
        reward, num_workers=exp.reward.num_workers, timeout_s=exp.reward.timeout_s, clock=clock
    )
    filter_knobs = r.group_filter_kwargs()
    group_filter = GroupFilter(**filter_knobs) if filter_knobs is not None else None
    truncation = TruncationPolicy(mode=r.truncation, penalty=r.truncation_penalty)
    inbox = Inbox()
    servers = [
        server_factory(
            f"gen{i}",
            engine,
            params,
            policy_version=version,
            stop_ids=tokenizer.stop_ids,
            partial_rollout=r.partial_rollout,
            on_finished=inbox.generated,
            clock=clock,
        )
        for i, ((engine, _), params) in enumerate(zip(engines, gen_params, strict=True))
    ]
    scheduler = RolloutScheduler(
        servers,
        inbox,
        source,
        ledger,
        GroupBuffer(G, group_filter=group_filter),
        reward_pool,
        tokenizer=tokenizer,
        batch_prompts=B,
        group_size=G,
        async_ratio=r.async_ratio,
        sampling=r.sampling,
        seed=exp.seed,
        policy_version=version,
        stale_policy=r.stale_policy,
        sample_deadline_s=r.sample_deadline_s,
        max_retries=r.max_retries,
        truncation=truncation,
        resume_prompts=resume,
        counters=dict(meta.extra.get("counters", {})),
        # Dynamic sampling: a filtered group's prompt is replaced at once (up to B a step).
        refill_dropped=group_filter is not None,
        clock=clock,
    )
    advantage_fn = get_advantage_estimator(exp.advantage)
    batch_timeout_s = r.sample_deadline_s * (r.max_retries + 2) + 4 * exp.reward.timeout_s
    compiled = {"engine": False, "learner": False}  # for the console's notes

    def run_eval(v: int) -> dict[str, float]:
        if not held_out:
            return {}
        t0, status = clock.now(), EvalStatus(clock.now)
        note = "" if compiled["engine"] else " (the first evaluation compiles the engine)"
        announce = f"evaluating at step {v}: {len(held_out)} prompts x "
        announce += f"{exp.eval.samples_per_prompt} samples{note} ..."
        with console.phase("evaluating", status, announce=announce):
            out = evaluate(
                engines[0][0],
                gen_params[0],
                held_out,
                samples_per_prompt=exp.eval.samples_per_prompt,
                sampling=r.sampling,
                seed=exp.seed,
                policy_version=v,
                tokenizer=tokenizer,
                reward_pool=reward_pool,
                progress=status.update,
            )
        compiled["engine"] = True
        return {**out, "eval_time_s": clock.now() - t0}

    def show(step: int, row: dict[str, Any], compiled_now: bool = False) -> None:
        elapsed = duration(clock.now() - t_run)
        line = records.step_line(step, exp.total_steps, elapsed, row)
        # The first update's time is mostly XLA compiling it: say so next to its rate.
        console.line(line + (" (first update: includes compiling it)" if compiled_now else ""))

    # ------------------------------------------------------------ the loop
    writer = MetricsWriter(workdir)
    metrics: dict[str, Any] = {}
    try:
        if version == 0 and exp.data.eval_size:
            console.background(f"step 0/{exp.total_steps}")
            metrics = run_eval(0)
            show(0, writer.write_step(0, {**metrics, **ledger.metrics()}))
        scheduler.start()
        servers_before = scheduler.server_stats()
        while version < exp.total_steps:
            t_step = clock.now()
            step_label = f"step {version + 1}/{exp.total_steps}"
            console.background(step_label)
            # 1-4. Sample, generate, score, group: B groups with staleness <= alpha.
            note = "" if compiled["engine"] else " (the first generation compiles the engine)"
            progress = GenerationStatus(scheduler, clock.now, samples=B * G)
            with console.phase(f"{step_label}: generating{note}", progress):
                batch = scheduler.next_batch(version, timeout_s=batch_timeout_s)
            compiled["engine"] = True
            writer.write_rollouts(batch.rows)

            # 5. Advantages per group; samples masked by truncation carry no loss.
            lb = learner_batch(
                batch.groups,
                advantage_fn,
                truncation,
                pad_id=tokenizer.pad_id,
                max_len=model_config.max_seq_len,
                num_sequences=B * G,
            )
            stale = np.array([version - start_version_of(s) for s in lb.samples], np.int64)
            train_batch, replay_metrics = lb.batch, {}
            if cycle is not None:  # + the replay cycle at rho; ratio statistics per cycle
                train_batch, replay_metrics = cycle.step_batch(
                    lb,
                    state.params,
                    learner_version=version,
                    pad_id=tokenizer.pad_id,
                    max_len=model_config.max_seq_len,
                )

            # 6. Train (jitted once per batch shape; state donated) -- or skip an empty step.
            t_train = clock.now()
            compiled_now = train_batch is not None and not compiled["learner"]
            if train_batch is not None:
                note = "" if compiled["learner"] else " (the first update compiles the step)"
                n = len(lb.samples) + replay_metrics.get("cycle_replay_samples", 0)
                with console.phase(f"{step_label}: training on {n} samples{note}"):
                    state, train_metrics = train_step(state, train_batch)
                    step_metrics = records.learner_metrics(
                        {k: float(v) for k, v in jax.device_get(train_metrics).items()}
                    )
                compiled["learner"] = True
            else:
                skipped = empty_reason(batch.groups, batch.dropped)
                scheduler.count("steps_skipped", f"steps_skipped_{skipped}")
                log.warning("step %d has nothing to train (%s): skipped", version + 1, skipped)
                state = state.replace(step=jax.device_put(state.step + 1, step_sharding))
                step_metrics = {"skipped": skipped}
            train_s = clock.now() - t_train
            trained_at_s = clock.now() - (scheduler.first_request_at or t_step)
            scheduler.mark_trained(batch.groups)
            # Books as of now, before publish frees capacity: the checkpoint's in-flight
            # prompts are exactly those admitted under the weights being replaced.
            snapshot, sched_stats = scheduler.snapshot(), scheduler.stats()
            servers_now = scheduler.server_stats()
            gen = records.server_metrics(servers_before, servers_now, version)
            servers_before = servers_now

            # 7. Publish: D2D to every generation mesh; the servers keep decoding.
            t_sync = clock.now()
            version = int(jax.device_get(state.step))
            gen_params = publish_weights(state.params, version)
            copy_s = clock.now() - t_sync
            handover_s = scheduler.publish(gen_params, version)

            # Metrics (README "What a run writes").
            step_s = clock.now() - t_step
            metrics = {
                **records.batch_metrics(batch.groups, lb.samples),
                **step_metrics,
                **records.staleness_metrics(stale),
                **replay_metrics,
                **gen,
                "train_time_s": train_s,
                "train_tokens_per_s": step_metrics.get("tokens", 0.0) / max(train_s, 1e-9),
                "trained_at_s": trained_at_s,
                "weight_sync_s": copy_s + handover_s,
                "weight_copy_s": copy_s,
                "learner_wait_s": batch.wait_s,
                "learner_idle_frac": batch.wait_s / max(step_s, 1e-9),
                "step_time_s": step_s,
                "policy_version": version,
                **sched_stats,
                "prompt_outcomes": ledger.outcomes,
            }
            if cycle is not None:  # the controller's inputs and decision (rho of the next step)
                metrics.update(cycle.control_from(metrics, next_version=version))
            # 8. Evaluate.
            if version % exp.eval.every == 0 or version == exp.total_steps:
                metrics.update(run_eval(version))
            records.check_finite(metrics, version)
            show(version, writer.write_step(version, metrics), compiled_now)

            # 9. Checkpoint.
            if version % exp.checkpoint.every == 0 or version == exp.total_steps:
                ledger_state, counts, cursor = snapshot
                checkpointer.save(
                    state,
                    CheckpointMeta(
                        step=version,
                        data_cursor=cursor,
                        policy_version=version,
                        counters=counts,
                        extra={
                            "ledger": ledger_state,
                            "counters": counts,
                            **({"replay": cycle.state_dict()} if cycle else {}),
                        },
                    ),
                )
    finally:
        console.background("shutting down: stopping the servers, writing the last checkpoint")
        scheduler.close()  # outstanding requests aborted (counted), servers stopped
        checkpointer.close()
        reward_pool.close()
        writer.close()
        console.background(None)
    console.line(
        f"finished {version}/{exp.total_steps} steps in {duration(clock.now() - t_run)}: "
        f"{workdir}/metrics.jsonl, rollouts.jsonl; tensorboard --logdir {workdir}/tensorboard"
    )
    return metrics
