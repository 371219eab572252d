"""The RL program, top to bottom: one loop for RLVR and agentic runs, every placement.

    sample ─► generate (fleet) ─► score ─► group ─► advantages ─► train ─► publish ─► plan

It talks to the rooms' doors only (docs/LAYOUT.md): config, workloads, rollout, fleet and
control. The servers keep decoding while the learner trains (ROLL Flash, arXiv 2510.11345).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from jaxflash.metrics.writer import MetricsWriter
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.replay_spec import check_replay_learner
from jaxflash.runtime.console import Console, GenerationStatus, duration
from jaxflash.runtime.control.run_control import RunControl
from jaxflash.runtime.control.step_control import StepReport
from jaxflash.runtime.fleet.fleets import ServerSettings, make_fleet
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.fleet.learner_links import LeaderLinks
from jaxflash.runtime.fleet.learner_setup import start_learner
from jaxflash.runtime.fleet.placement import carve
from jaxflash.runtime.interrupt import DeferredInterrupt, Interrupted, Preempted
from jaxflash.runtime.resume import checkpoint_meta, finished_line, finished_run, stopped_note
from jaxflash.runtime.rollout import records
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.scheduler_setup import make_scheduler
from jaxflash.runtime.workloads import learner_batch
from jaxflash.runtime.workloads.evaluation import HeldOutEval
from jaxflash.runtime.workloads.workload import make_workload

log = logging.getLogger(__name__)


def run(
    exp: ExperimentConfig, *, workdir: str, server_factory: Callable[..., Any] = GenerationServer,
    clock: Clock | None = None, console: Console | None = None,
    learner_links: LeaderLinks | None = None,
    stop_after: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Runs (or resumes) ``exp`` in ``workdir``; returns the last step's metrics (a finished
    run: its last row). ``server_factory`` builds each thread server (tests inject faults);
    ``stop_after(metrics)`` True ends the run after that step, saved like a last one.
    Raises: ConfigError (found before the model loads), TimeoutError (no batch in time),
      RuntimeError (every server died), FloatingPointError (non-finite loss, grad or entropy)."""
    clock, console = clock or RealClock(), console or Console(None)
    check_replay_learner(exp.replay, exp.controller, multi_process=learner_links is not None)
    t_run = clock.now()
    if (finished := finished_run(workdir, exp.total_steps, console)) is not None:
        return finished  # nothing to do: said instead of resuming silently
    console.background("setting up")  # what is wrong with the config fails before the model
    placement = carve(exp.mesh)
    console.line(f"devices: {placement.describe()}")
    workload = make_workload(exp, console)  # a task and its reward, or an environment
    exp, tokenizer = workload.exp, workload.tokenizer  # exp: with the prompt limits derived
    learner, model = start_learner(exp, tokenizer, placement, workdir, console, learner_links)
    # Only once the workdir took this launch (same model, state restored): a refused
    # launch leaves the workdir's record of its run as it was.
    records.write_run_config(workdir, exp, tokenizer, workload.prompt_lengths())
    meta, ledger, version = learner.meta, learner.ledger, int(learner.meta.step)
    inbox = Inbox()  # where servers, reward futures and environments report back
    with console.phase("starting the generation servers"):  # threads, or programs
        servers = ServerSettings(inbox.generated, clock, server_factory)  # given once
        fleet = make_fleet(exp, model, placement, tokenizer, workdir, servers)
    with console.phase("publishing the weights to the generation engines"):
        fleet.start(learner, version)  # fleet.pool: what the rollout routes to
    control = RunControl(exp, placement, meta.extra)  # replay, step controller, elastic
    B, G = control.fresh_prompts, exp.rollout.group_size
    reward_pool = workload.reward_pool(clock)  # None: the environments score episodes
    scheduler = make_scheduler(exp, workload, fleet.pool, inbox, meta, ledger, batch_prompts=B,
        async_ratio=control.async_ratio, reward_pool=reward_pool, clock=clock)  # fmt: skip
    control.attach(learner=learner, fleet=fleet, scheduler=scheduler)  # elastic moves
    pack = dict(pad_id=tokenizer.pad_id, max_len=model.max_seq_len)  # batch rows
    episodic, wait_s = workload.plays_episodes, workload.batch_timeout_s()
    evaluate = HeldOutEval(workload, fleet, reward_pool, console, clock)  # on the fleet
    elapsed = lambda: duration(clock.now() - t_run)  # noqa: E731
    writer, metrics = MetricsWriter(workdir), {}
    preempted, failing = False, 0  # failing: steps in a row in which every prompt failed
    interrupt = DeferredInterrupt(lambda: learner.sigterm).install()  # raised at checks only
    try:
        if version == 0 and workload.eval_size:
            console.background(f"step 0/{exp.total_steps}")
            metrics = evaluate(0, stop=interrupt.check_stop)  # SIGTERM: stops, unscored
            row = writer.write_step(0, {**metrics, **ledger.metrics()})
            console.line(records.step_line(0, exp.total_steps, elapsed(), row))
        scheduler.start()
        while version < exp.total_steps:
            interrupt.check()
            t_step, label = clock.now(), f"step {version + 1}/{exp.total_steps}"
            console.background(label)
            # 1-4. Sample, generate, score, group: B groups with staleness <= alpha.
            note = console.once("engine", " (the first generation compiles the engine)")
            status = GenerationStatus(scheduler, clock.now, samples=B * G, episodes=episodic)
            with console.phase(f"{label}: generating{note}", status):
                batch = scheduler.next_batch(version, timeout_s=wait_s, stop=interrupt.check_stop)
            interrupt.check()  # a Ctrl-C while generating stops before the update, not after
            writer.write_rollouts(batch.rows)
            # 5. Advantages (per token for episodes), packed; + the replay cycle's rows at rho.
            lb = workload.learner_batch(batch.groups, num_sequences=B * G, **pack)
            stale = lb.staleness(version)  # versions, per sample that carries loss
            train_batch, replay_metrics = control.mix(lb, learner_version=version, **pack)
            # 6. Train (jitted once per batch shape; state donated), or skip an empty step.
            t_train, compiled_now = clock.now(), False
            if train_batch is not None:
                note = console.once("learner", " (the first update compiles the step)")
                n = len(lb.samples) + replay_metrics.get("cycle_replay_samples", 0)
                compiled_now = bool(note)
                with console.phase(f"{label}: training on {n} samples{note}"):
                    step_metrics = records.learner_metrics(learner.train(train_batch))
            else:
                skipped = learner_batch.empty_reason(batch.groups, batch.dropped)
                scheduler.count("steps_skipped", f"steps_skipped_{skipped}")
                log.warning("step %d has nothing to train (%s): skipped", version + 1, skipped)
                learner.skip()
                step_metrics = {"skipped": skipped}
            train_s = clock.now() - t_train  # a Ctrl-C from here on: this step is saved (9.)
            trained_at_s = clock.now() - (scheduler.first_request_at or t_step)
            scheduler.mark_trained(batch.groups)
            # Books before publish frees capacity: in flight = admitted under the old weights.
            snapshot, sched_stats = scheduler.snapshot(), scheduler.stats()
            (generated, pending), gen = scheduler.progress(), scheduler.server_metrics(version)
            # 7. Publish: the fleet puts the new version on every server (they keep decoding).
            t_sync, version = clock.now(), learner.step
            sync = fleet.publish(learner, version, scheduler)
            writer.write_timeline(records.timeline_row(
                version, scheduler.take_timeline_spans(), origin=t_run,
                wait=(t_step, t_step + batch.wait_s), train=(t_train, t_train + train_s),
                publish=(t_sync, clock.now()),
            ))  # fmt: skip
            step_s = clock.now() - t_step  # metrics: docs/METRICS.md
            metrics = {
                **learner_batch.step_batch_metrics(batch, lb, step_metrics, stale),
                **replay_metrics, **gen,
                **records.time_metrics(step_s=step_s, train_s=train_s, wait_s=batch.wait_s,
                    trained_at_s=trained_at_s, learner_metrics=step_metrics, sync=sync),
                "policy_version": version, **sched_stats, "prompt_outcomes": ledger.outcomes,
            }  # fmt: skip
            plan = control.after_step(StepReport.measure(  # None without a step controller
                next_version=version, samples_generated=generated, queue_samples=pending * G,
                step_s=step_s, train_s=train_s, staleness=stale, learner_metrics=step_metrics,
            ))  # fmt: skip
            if plan is not None:  # in force from the next step: rho, alpha, requests in flight
                metrics.update(plan.metrics)
                scheduler.reconfigure(**dataclasses.asdict(plan.scheduler))
                B = plan.fresh_prompts
            metrics.update(control.elastic_metrics())
            stopping = stop_after is not None and bool(stop_after(metrics))
            due = version % exp.eval.every == 0 or version == exp.total_steps or stopping
            if due and not interrupt.requested:  # 8. Evaluate (not when stopping on Ctrl-C).
                metrics.update(evaluate(version, stop=interrupt.check_stop))
            records.check_finite(metrics, version)
            row = writer.write_step(version, metrics)
            console.line(records.step_line(version, exp.total_steps, elapsed(), row, compiled_now))
            failing = failing + 1 if step_metrics.get("skipped") == "all_failed" else 0
            learner_batch.check_failing_streak(failing, ledger.outcomes)  # broken reward/data
            # 9. Checkpoint (and stop here if preempted: every learner process agrees).
            preempted = learner.preempted(version)
            last = version == exp.total_steps or preempted or stopping or interrupt.requested
            if version % exp.checkpoint.every == 0 or last:
                learner.save(checkpoint_meta(version, snapshot, *control.checkpoint_state()))
            interrupt.check()  # a Ctrl-C during the step: saved just now
            if preempted or stopping:
                console.line(stopped_note(version, workdir, preempted=preempted))
                break
    except (Preempted, Interrupted) as stop:  # SIGTERM or a first Ctrl-C at a check: the last
        if learner.saved_step < version:  # trained step is saved (once); the step in flight
            learner.save(checkpoint_meta(version, snapshot, *control.checkpoint_state()))
        if isinstance(stop, Interrupted):  # is generated again on resume
            raise  # the launcher exits 130, naming the step a resume starts from
        console.line(stopped_note(version, workdir, preempted=True))
    finally:
        interrupt.restore()  # a Ctrl-C while shutting down interrupts at once
        console.background("shutting down: stopping the servers, writing the last checkpoint")
        # The scheduler aborts what is outstanding (counted) and stops the servers first.
        for part in (p for p in (scheduler, fleet, learner, reward_pool, writer) if p):
            part.close()
        console.background(None)
    if not (preempted or learner.sigterm):
        console.line(finished_line(version, exp.total_steps, elapsed(), workdir))
    return metrics
