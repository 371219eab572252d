"""The RLVR program, top to bottom: one loop for both placements.

    sample prompts ─► generate (servers) ─► score (reward workers) ─► group ─►
    advantages ─► train (jitted, sharded) ─► publish weights (D2D) ─► evaluate ─► checkpoint

One learner step: ``RolloutScheduler.next_batch`` waits for B groups whose
staleness is <= α; advantages per group; the jitted ``train_step``; the new
weights go device to device to every generation server, which keep decoding
(ROLL Flash, arXiv 2510.11345); then metrics, evaluation and a checkpoint.

Placements (``runtime.fleet.placement``):

* colocated (``mesh.colocated=True``, α = 0): ONE generation server on the
  learner's own devices. Nothing is admitted until the new weights are
  published, so the server is idle while the learner trains: the synchronous
  baseline every speed-up is measured against.
* disjoint slices (α >= 0): one server per generation slice; with α > 0 the
  servers run up to α versions ahead of the learner.
* elastic (``controller.elastic``, disjoint thread slices): at a step boundary the
  decision in force may move whole generation slices into the learner mesh or
  back (``runtime.control.elastic``): servers retired or added, in-flight requests
  re-queued, the learner state resharded device to device.
* generation programs (``mesh.generation_processes``): each slice its own JAX
  program behind the same server protocol (``runtime.fleet.fleets``); the learner
  offers each version and the programs pull it. SIGTERM: the step in progress
  is saved and the run stops (``LearnerProgram.preempted``). Ctrl-C: the loop
  stops at its next safe point, the step in progress unsaved (``runtime.interrupt``).

A step with nothing to train (every sample masked, every group filtered, failed
or stale) is skipped with a counted reason (``steps_skipped_<reason>``): the
policy version still advances, with the weights unchanged, so the run goes on.

What it trains on, the workload (``runtime.workloads.workload``), is chosen once: a task's
prompts scored by reward workers, or (``env.name`` set) groups of episodes sharing
an environment seed (``runtime.workloads.agentic``). It is built before the model loads, so
whatever the config names fails in seconds (``<workdir>/run_config.json`` records
it). A finished workdir is reported and left alone; the console names long phases.

Resume: the ledger, counters and data cursor are checkpointed; prompts in flight then
are generated again from scratch, never trained twice (``prompts_regenerated_on_resume``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxflash.metrics.writer import MetricsWriter
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.groups import GroupFilter
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.replay_spec import check_replay_learner
from jaxflash.runtime.console import Console, EvalStatus, GenerationStatus, duration
from jaxflash.runtime.control.elastic import make_elastic
from jaxflash.runtime.control.replay_cycle import make_replay_cycle
from jaxflash.runtime.control.step_control import StepReport, make_step_control
from jaxflash.runtime.fleet.fleets import make_fleet
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.fleet.learner_links import LeaderLinks
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from jaxflash.runtime.fleet.placement import carve
from jaxflash.runtime.interrupt import DeferredInterrupt
from jaxflash.runtime.model_setup import check_workdir_model, describe_source, load_model
from jaxflash.runtime.resume import checkpoint_meta, finished_note, finished_step, last_metrics
from jaxflash.runtime.rollout import records
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.scheduler import RolloutScheduler
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings
from jaxflash.runtime.workloads.episode_metrics import episode_metrics
from jaxflash.runtime.workloads.learner_batch import check_failing_streak, empty_reason
from jaxflash.runtime.workloads.workload import make_workload
from jaxflash.sharding.distributed import advertised_host
from jaxflash.sync.transfer_sender import WeightSender

log = logging.getLogger(__name__)


def run(
    exp: ExperimentConfig,
    *,
    workdir: str,
    server_factory: Callable[..., Any] = GenerationServer,
    clock: Clock | None = None,
    console: Console | None = None,
    learner_links: LeaderLinks | None = None,
    stop_after: Callable[[dict[str, Any]], bool] | None = None,
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
      learner_links: on process 0 of a multi-process learner, the links to the
        other learner processes (they run ``learner_program.follow``).
      stop_after: called with each step's metrics (before its evaluation); True
        ends the run after that step, evaluated and checkpointed like a last step
        (budgets in generated samples or wall time: ``benchmarks/replay.py``).

    Returns:
      The last step's metrics (a finished run: the last row of its metrics.jsonl).

    Raises:
      ConfigError: the task, its data, the reward or the environment cannot run
        (naming the fields), found before the model loads.
      TimeoutError: no batch could be assembled in time (servers hung).
      RuntimeError: every generation server died.
      FloatingPointError: a non-finite loss, gradient norm or entropy.
    """
    clock = clock or RealClock()
    console = console or Console(None)
    check_replay_learner(exp.replay, exp.controller, multi_process=learner_links is not None)
    t_run = clock.now()
    done = finished_step(workdir, exp.total_steps)
    if done is not None:  # nothing to do: say so instead of resuming silently
        console.line(finished_note(workdir, done, exp.total_steps))
        return last_metrics(workdir)

    # ------------------------------------------------------------ workload, tokenizer
    # Everything that can be wrong with the config fails here, before the slow model load.
    console.background("setting up")
    placement = carve(exp.mesh)
    console.line(f"devices: {placement.describe()}")
    workload = make_workload(exp, console)  # a task and its reward, or an environment
    exp, tokenizer = workload.exp, workload.tokenizer  # exp: with the prompt limits derived
    console.line(workload.describe())
    stops = tokenizer.stop_set.describe(tokenizer.id_to_token)
    console.line(f"stop set (ids that end a response): {stops}")
    os.makedirs(workdir, exist_ok=True)  # only once the config is known to run
    records.write_run_config(workdir, exp, tokenizer, workload.prompt_lengths())

    # ------------------------------------------------------------ model + learner (born sharded)
    what = describe_source(exp.model)
    with console.phase("loading the model", announce=f"loading the model ({what}) ..."):
        model_config, imported_params = load_model(exp.model, exp.rollout, tokenizer)
    log.debug("model: %s", model_config)
    console.line(f"model: {records.describe_model(model_config)}")
    check_workdir_model(workdir, model_config)
    console.background("setting up the learner, the generation engines and the reward workers")
    with console.phase("building the learner state"):
        # Generation programs pull weights from every learner process's sender.
        sender = WeightSender(host=advertised_host()) if exp.mesh.generation_processes else None
        learner = LearnerProgram(
            exp, model_config, imported_params, placement.learner, workdir,
            sender=sender, links=learner_links,
        )  # fmt: skip
    meta, ledger = learner.meta, learner.ledger
    if meta.step:
        console.line(
            f"resumed from step {meta.step} of {exp.total_steps} in {workdir} (data cursor "
            f"{meta.data_cursor}; {len(ledger.open_ids)} prompts in flight, generated again)"
        )
    del imported_params

    # ------------------------------------------------------------ engines + first weights
    version = int(meta.step)  # policy version == learner steps taken
    # Threads on this program's generation meshes, or generation programs (runtime.fleet).
    with console.phase("starting the generation servers"):
        fleet = make_fleet(exp, model_config, placement, tokenizer, workdir)
    with console.phase("publishing the weights to the generation engines"):
        gen_params = fleet.publish(learner, version)

    # ------------------------------------------------------------ data, rewards, scheduler
    r = exp.rollout
    B, G = r.prompts_per_step, r.group_size
    # ReFlow's replay cycle (control.replay_cycle; None without replay): B - fresh groups
    # of every learner batch come from the replay buffer instead of the servers. The step
    # controller (control.step_control; None likewise) owns the decision in force: rho,
    # alpha, requests in flight, the role split (a resumed run continues the checkpoint's).
    cycle = make_replay_cycle(exp, extra=meta.extra)
    control = make_step_control(
        exp,
        learner_devices=int(placement.learner.devices.size),
        generation_devices=sum(int(m.devices.size) for m in placement.generation),
        extra=meta.extra,
    )
    B, alpha = (
        (control.fresh_prompts, control.decision.async_ratio) if control else (B, r.async_ratio)
    )
    source = workload.source(meta.data_cursor)
    resume = workload.resume(source, ledger.open_ids)
    reward_pool = workload.reward_pool(clock)  # None: the environments score episodes
    episodes = workload.plays_episodes  # groups of episodes, not prompts' samples
    filter_knobs = r.group_filter_kwargs()
    group_filter = GroupFilter(**filter_knobs) if filter_knobs is not None else None
    inbox = Inbox()
    server_kwargs = dict(
        stop_ids=tokenizer.stop_ids, partial_rollout=r.partial_rollout,
        on_finished=inbox.generated, clock=clock, server_factory=server_factory,
    )  # fmt: skip
    # The checkpoint's books: buffer_* counters go on, as prompts_* / samples_* do.
    books = RolloutBooks(
        source=source, ledger=ledger, resume_prompts=resume,
        buffer=GroupBuffer(G, group_filter=group_filter, state=meta.extra.get("group_buffer")),
        counters=meta.extra.get("counters", {}),
    )  # fmt: skip
    settings = RolloutSettings.from_spec(
        r, batch_prompts=B, async_ratio=alpha, seed=exp.seed, policy_version=version,
        # Dynamic sampling: a filtered group's prompt is replaced at once (up to B a step);
        # so is a group of episodes whose environment kept failing.
        refill_dropped=group_filter is not None or episodes,
    )  # fmt: skip
    servers = fleet.servers(gen_params, version=version, **server_kwargs)
    dispatch = workload.dispatch(reward_pool)  # prompts scored, or episodes played
    scheduler = RolloutScheduler(servers, inbox, books, settings, dispatch, clock=clock)
    # The elastic pool (runtime.elastic; None unless controller.elastic): the decision's
    # role split moves generation slices into or out of the learner at step boundaries.
    # A resumed run moves to its checkpointed split here, before the first step.
    elastic = make_elastic(
        exp, learner=learner, fleet=fleet, scheduler=scheduler, placement=placement,
        server_kwargs=server_kwargs, extra=meta.extra,
        learner_devices=control.decision.learner_devices if control else None,
    )  # fmt: skip
    pack = dict(pad_id=tokenizer.pad_id, max_len=model_config.max_seq_len)  # batch rows
    compiled = {"engine": False, "learner": False}  # for the console's notes

    def run_eval(v: int) -> dict[str, float]:
        if not workload.eval_size:
            return {}
        unit = "episodes" if episodes else "samples"
        t0, status = clock.now(), EvalStatus(clock.now, unit=unit)
        note = "" if compiled["engine"] else " (the first evaluation compiles the engine)"
        announce = f"evaluating at step {v}: {workload.describe_eval()}{note} ..."
        engine, params = fleet.eval_target(gen_params)
        with console.phase("evaluating", status, announce=announce):
            out = workload.evaluate(engine, params, reward_pool, version=v, progress=status.update)
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
    preempted, failing = False, 0  # failing: steps in a row in which every prompt failed
    interrupt = DeferredInterrupt()  # Ctrl-C: raised at the checks below, not anywhere
    interrupt.install()
    try:
        if version == 0 and workload.eval_size:
            console.background(f"step 0/{exp.total_steps}")
            metrics = run_eval(0)
            show(0, writer.write_step(0, {**metrics, **ledger.metrics()}))
        scheduler.start()
        servers_before = scheduler.server_stats()
        while version < exp.total_steps:
            interrupt.check()
            t_step = clock.now()
            step_label = f"step {version + 1}/{exp.total_steps}"
            console.background(step_label)
            # 1-4. Sample, generate, score, group: B groups with staleness <= alpha.
            note = "" if compiled["engine"] else " (the first generation compiles the engine)"
            progress = GenerationStatus(scheduler, clock.now, samples=B * G, episodes=episodes)
            with console.phase(f"{step_label}: generating{note}", progress):
                batch = scheduler.next_batch(
                    version, timeout_s=workload.batch_timeout_s(), stop=interrupt.check
                )
            compiled["engine"] = True
            writer.write_rollouts(batch.rows)

            # 5. Advantages per group (per token for episodes), packed; samples masked by
            # truncation, and the tokens an environment wrote, carry no loss.
            lb = workload.learner_batch(batch.groups, num_sequences=B * G, **pack)
            stale = np.array([version - start_version_of(s) for s in lb.samples], np.int64)
            train_batch, replay_metrics = lb.batch, {}
            if cycle is not None:  # + the replay cycle at rho, rows labelled by cycle
                train_batch, replay_metrics = cycle.step_batch(
                    lb, learner_version=version, replay_ratio=control.replay_ratio, **pack
                )

            # 6. Train (jitted once per batch shape; state donated) -- or skip an empty step.
            t_train = clock.now()
            compiled_now = train_batch is not None and not compiled["learner"]
            if train_batch is not None:
                note = "" if compiled["learner"] else " (the first update compiles the step)"
                n = len(lb.samples) + replay_metrics.get("cycle_replay_samples", 0)
                with console.phase(f"{step_label}: training on {n} samples{note}"):
                    step_metrics = records.learner_metrics(learner.train(train_batch))
                compiled["learner"] = True
            else:
                skipped = empty_reason(batch.groups, batch.dropped)
                scheduler.count("steps_skipped", f"steps_skipped_{skipped}")
                log.warning("step %d has nothing to train (%s): skipped", version + 1, skipped)
                learner.skip()
                step_metrics = {"skipped": skipped}
            train_s = clock.now() - t_train
            interrupt.check()  # (the step is lost: nothing of it was published or written)
            trained_at_s = clock.now() - (scheduler.first_request_at or t_step)
            scheduler.mark_trained(batch.groups)
            # Books as of now, before publish frees capacity: the checkpoint's in-flight
            # prompts are exactly those admitted under the weights being replaced.
            snapshot, sched_stats = scheduler.snapshot(), scheduler.stats()
            generated, groups_pending = scheduler.progress()
            servers_now = scheduler.server_stats()
            gen = records.server_metrics(servers_before, servers_now, version)
            servers_before = servers_now

            # 7. Publish: D2D to every generation mesh (or offered to the generation
            # programs, which pull it); the servers keep decoding.
            t_sync = clock.now()
            version = learner.step
            gen_params = fleet.publish(learner, version)
            copy_s = clock.now() - t_sync
            handover_s = scheduler.publish(gen_params, version)
            writer.write_timeline(
                records.timeline_row(
                    version, scheduler.take_timeline_spans(), origin=t_run,
                    wait=(t_step, t_step + batch.wait_s), train=(t_train, t_train + train_s),
                    publish=(t_sync, clock.now()),
                )
            )  # fmt: skip

            # Metrics (docs/METRICS.md).
            step_s = clock.now() - t_step
            metrics = {
                **records.batch_metrics(batch.groups, lb.samples),
                **episode_metrics(batch.groups, batch.dropped),
                **step_metrics,
                **records.staleness_metrics(stale),
                **replay_metrics,
                **gen,
                "train_time_s": train_s,
                "train_tokens_per_s": step_metrics.get("tokens", 0.0) / max(train_s, 1e-9),
                "trained_at_s": trained_at_s,
                "weight_sync_s": copy_s + handover_s,
                "weight_copy_s": copy_s,
                "publish_bytes": fleet.last_publish_bytes,  # adapters only under LoRA
                "learner_wait_s": batch.wait_s,
                "learner_idle_frac": batch.wait_s / max(step_s, 1e-9),
                "step_time_s": step_s,
                "policy_version": version,
                **sched_stats,
                "prompt_outcomes": ledger.outcomes,
            }
            if control is not None:  # the step controller's plan, in force from the next
                # step: rho (fresh groups, replayed samples), alpha, the requests in flight
                # (staleness bound, admission capacity) and, with the elastic pool, the
                # role split (devices move here)
                report = StepReport(
                    next_version=version,
                    samples_generated=generated,
                    step_s=step_s,
                    train_s=train_s,
                    trained_samples=int(step_metrics.get("sequences", 0)),
                    queue_samples=groups_pending * G,
                    staleness_mean=float(stale.mean()) if stale.size else 0.0,
                    replay_ess=step_metrics.get("replay_ess_token"),
                )
                plan = control.after_step(
                    report, move=elastic.move_to if elastic is not None else None
                )
                metrics.update(plan.metrics)
                scheduler.reconfigure(**dataclasses.asdict(plan.scheduler))
                B = plan.fresh_prompts
            if elastic is not None:
                metrics.update(elastic.step_metrics())
            stopping = stop_after is not None and bool(stop_after(metrics))
            # 8. Evaluate.
            interrupt.check()
            if version % exp.eval.every == 0 or version == exp.total_steps or stopping:
                metrics.update(run_eval(version))
            records.check_finite(metrics, version)
            show(version, writer.write_step(version, metrics), compiled_now)
            failing = failing + 1 if step_metrics.get("skipped") == "all_failed" else 0
            check_failing_streak(failing, ledger.outcomes)  # a broken reward or data: stop

            # 9. Checkpoint (and stop here if preempted: every learner process agrees).
            preempted = learner.preempted(version)
            last = version == exp.total_steps or preempted or stopping
            if version % exp.checkpoint.every == 0 or last:
                replay = {**cycle.state_dict(), **control.state_dict()} if cycle else None
                pool = elastic.state_dict() if elastic else None
                learner.save(checkpoint_meta(version, snapshot, replay, pool))
            if preempted:
                console.line(
                    f"preempted (SIGTERM): saved step {version}; run the same command to "
                    f"resume {workdir} from it"
                )
                break
            if stopping:
                console.line(f"stopped after step {version} (stop_after)")
                break
    finally:
        interrupt.restore()  # a Ctrl-C while shutting down interrupts at once
        console.background("shutting down: stopping the servers, writing the last checkpoint")
        scheduler.close()  # outstanding requests aborted (counted), servers stopped
        fleet.close()
        learner.close()
        if reward_pool is not None:
            reward_pool.close()
        writer.close()
        console.background(None)
    if preempted:
        return metrics
    console.line(
        f"finished {version}/{exp.total_steps} steps in {duration(clock.now() - t_run)}: "
        f"{workdir}/metrics.jsonl, rollouts.jsonl; tensorboard --logdir {workdir}/tensorboard"
    )
    return metrics
