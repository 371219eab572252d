"""The RL program, top to bottom: one loop for RLVR and agentic runs, every placement.

    sample ─► generate (fleet) ─► score ─► group ─► advantages ─► train ─► publish ─► plan

It talks to the rooms' doors only (docs/LAYOUT.md): config, workloads, rollout, fleet and
control. The servers keep decoding while the learner trains (ROLL Flash, arXiv 2510.11345).
``run`` drives the run: ``RLLoop`` sets its parts up and yields one record per step, each
part reporting its section of it where it arises (``metrics.tracker``); what the run does
with a record on a cadence -- evaluate, write the row and its line, check, checkpoint --
are the hooks of ``control.step_hooks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from jaxflash.metrics.run_config import write_run_config
from jaxflash.metrics.step_times import StepTimes
from jaxflash.metrics.tracker import StepInfo, StepTracker
from jaxflash.metrics.writer import MetricsWriter
from jaxflash.runtime.clock import Clock, RealClock
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.replay_spec import check_replay_learner
from jaxflash.runtime.console import Console, GenerationStatus, duration
from jaxflash.runtime.control.run_control import RunControl
from jaxflash.runtime.control.step_hooks import RunHooks
from jaxflash.runtime.fleet.fleets import ServerSettings, make_fleet
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.fleet.learner_links import LeaderLinks
from jaxflash.runtime.fleet.learner_setup import start_learner
from jaxflash.runtime.fleet.placement import carve
from jaxflash.runtime.interrupt import DeferredInterrupt, Interrupted, Preempted
from jaxflash.runtime.resume import (
    finished_line,
    finished_run,
    nothing_trained,
    resumed_note,
    stopped_note,
)
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.scheduler_setup import make_scheduler
from jaxflash.runtime.workloads.evaluation import HeldOutEval
from jaxflash.runtime.workloads.learner_batch import learner_update, report_batch
from jaxflash.runtime.workloads.workload import make_workload
from jaxflash.types import NothingTrainedError


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
      RuntimeError (every server died), FloatingPointError (non-finite loss, grad or entropy),
      NothingTrainedError (the run reached its last step with every step skipped)."""
    clock, console = clock or RealClock(), console or Console(None)
    check_replay_learner(exp.replay, exp.controller, multi_process=learner_links is not None)
    t_run = clock.now()
    if (finished := finished_run(workdir, exp.total_steps, console, exp.model)) is not None:
        return finished  # nothing to do: said instead of resuming silently
    loop = RLLoop(exp, workdir, clock, console, learner_links, server_factory, t_run=t_run)
    exp, learner, interrupt = loop.exp, loop.learner, loop.interrupt
    hooks = RunHooks(total_steps=exp.total_steps, eval_every=exp.eval.every,
        checkpoint_every=exp.checkpoint.every, writer=loop.writer, console=console,
        evaluate=HeldOutEval(loop.workload.held_out, loop.fleet, console, clock),
        learner=learner, control=loop.control, rollout=loop.scheduler.books, interrupt=interrupt,
        elapsed=lambda: duration(loop.times.elapsed_s()), wall=loop.times.wall_state)  # fmt: skip
    try:
        if loop.version == 0 and loop.workload.held_out.size and exp.eval.at_start:
            hooks.before_training()  # step 0: SIGTERM stops it, unscored
        for info in loop.steps():
            stopping = stop_after is not None and bool(stop_after(info.record))
            info.last = info.last or stopping
            # 9. Evaluate, write, check, checkpoint (and stop here if preempted).
            hooks.after_step(info)
            interrupt.check()  # a Ctrl-C during the step: saved just now
            if hooks.preempted or stopping:
                console.line(stopped_note(info.step, workdir, preempted=hooks.preempted))
                break
    except (Preempted, Interrupted) as stop:  # SIGTERM or a first Ctrl-C at a check: the last
        hooks.save_unsaved(loop.version)  # trained step is saved (once); the step in flight
        if isinstance(stop, Interrupted):  # is generated again on resume
            raise  # the launcher exits 130, naming the step a resume starts from
        console.line(stopped_note(loop.version, workdir, preempted=True))
    finally:
        interrupt.restore()  # a Ctrl-C while shutting down interrupts at once
        loop.close()
    if not (hooks.preempted or learner.sigterm):
        console.line(finished_line(loop.version, exp.total_steps, hooks.elapsed(), workdir))
        if why := nothing_trained(hooks.record, loop.version):  # not a success: exit 3
            raise NothingTrainedError(why, hooks.record)
    return hooks.record


class RLLoop:
    """The run's parts, set up in order, and its steps (``steps``: one record each).

    Args:
      exp: the experiment. workdir: the run directory. clock, console: the run's.
      learner_links: the other learner processes (None: one process).
      server_factory: builds each thread server.
      t_run: the run's start on ``clock`` (the timeline counts from it).

    Attributes:
      version: the policy version (the learner's step) after the last step.
    """

    def __init__(
        self, exp: ExperimentConfig, workdir: str, clock: Clock, console: Console,
        learner_links: LeaderLinks | None, server_factory: Callable[..., Any], *, t_run: float,
    ):  # fmt: skip
        self.clock, self.console = clock, console
        console.background("setting up")  # what is wrong with the config fails before the model
        placement = carve(exp.mesh)
        console.line(f"devices: {placement.describe()}")
        # A task (its prompt limits derived: the experiment as run), or an environment.
        self.exp, self.workload = exp, workload = make_workload(exp, console, clock)
        tokenizer = workload.tokenizer
        learner, model = start_learner(exp, tokenizer, placement, workdir, console, learner_links)
        self.learner = learner
        # Only once the workdir took this launch (same model, state restored): a refused
        # launch leaves the workdir's record of its run as it was.
        write_run_config(workdir, exp, tokenizer, workload.prompt_lengths())
        meta, self.version = learner.meta, int(learner.meta.step)
        inbox = Inbox()  # where servers, reward futures and environments report back
        with console.phase("starting the generation servers"):  # threads, or programs
            servers = ServerSettings(inbox.generated, clock, server_factory)  # given once
            self.fleet = make_fleet(exp, model, placement, tokenizer, workdir, servers)
        with console.phase("publishing the weights to the generation engines"):
            self.fleet.start(learner, self.version)  # fleet.pool: what the rollout routes to
        self.control = RunControl(  # replay, controller, elastic
            replay=exp.replay, controller=exp.controller, rollout=exp.rollout, mesh=exp.mesh,
            seed=exp.seed, placement=placement, extra=meta.extra,
        )  # fmt: skip
        # The rollout restores its own books (ledger, cursor, counters) from ``meta``; the
        # workload gives it its side (prompts scored by its reward pool, or episodes).
        self.scheduler = make_scheduler(
            exp.rollout, workload, self.fleet.pool, inbox, meta, seed=exp.seed,
            batch_prompts=self.control.fresh_prompts, async_ratio=self.control.async_ratio,
            clock=clock,
        )  # fmt: skip
        if self.version:
            in_flight = len(self.scheduler.books.open_ids)  # generated again first
            console.line(resumed_note(meta, in_flight, exp.total_steps, workdir))
        self.fleet.listen(self.scheduler)  # told of every new version and elastic move
        self.control.attach(learner=learner, fleet=self.fleet, scheduler=self.scheduler)
        self.pack = dict(  # batch rows: padding, longest row, T bucket
            pad_id=tokenizer.pad_id, max_len=model.max_seq_len,
            length_multiple=exp.learner.length_multiple,
        )  # fmt: skip
        # Metrics: each part reports its section of the step's record where it arises.
        self.writer, self.tracker = MetricsWriter(workdir), StepTracker()  # docs/METRICS.md
        self.times = StepTimes(  # the run's clocks go on from the checkpoint
            clock.now, origin=t_run, rollout=self.scheduler.watch, resumed=meta.extra.get("wall")
        )
        self.interrupt = DeferredInterrupt(lambda: learner.sigterm).install()  # at checks

    def steps(self) -> Iterator[StepInfo]:
        """Starts the rollout, then runs the steps up to ``total_steps``, one record each
        (``StepInfo.last`` at the last one); the caller acts on each before the next."""
        self.scheduler.start()
        while self.version < self.exp.total_steps:
            yield self.step()

    def step(self) -> StepInfo:
        """One learner step: sample, generate, score, group, advantages, train, publish,
        plan. Returns its record (every part's section, ``metrics.tracker.SECTIONS``)."""
        exp, console, scheduler, control = self.exp, self.console, self.scheduler, self.control
        tracker, times, interrupt, version = self.tracker, self.times, self.interrupt, self.version
        B, G = control.fresh_prompts, exp.rollout.group_size  # B: the plan in force
        self.interrupt.check()
        label = f"step {version + 1}/{exp.total_steps}"
        console.background(label)
        times.start()
        # 1-4. Sample, generate, score, group: B groups with staleness <= alpha.
        note = console.once("engine", " (the first generation compiles the engine)")
        status = GenerationStatus(
            scheduler.watch, self.clock.now, samples=B * G, episodes=self.workload.plays_episodes
        )
        with console.phase(f"{label}: generating{note}", status):
            batch = scheduler.next_batch(version, stop=interrupt.check_stop)  # or TimeoutError
        interrupt.check()  # a Ctrl-C while generating stops before the update, not after
        times.waited(batch.wait_s)
        self.writer.write_rollouts(batch.rows)
        # 5. Advantages (per token for episodes), packed; + the replay cycle's rows at rho.
        lb = self.workload.learner_batch(batch.groups, num_sequences=B * G, **self.pack)
        stale = lb.staleness(version)  # versions, per sample that carries loss
        report_batch(tracker, batch.groups, lb, stale)
        self.workload.report(batch, tracker)  # an agentic run's episodes
        train_batch = control.mix(lb, tracker, learner_version=version, **self.pack)
        # 6. Train (jitted once per batch shape; state donated), or skip an empty step.
        training = train_batch is not None
        note = console.once("learner", " (the first update compiles the step)") if training else ""
        phase = f"{label}: training on {control.rows} samples{note}"
        with times.training(), console.phase(phase) if training else contextlib.nullcontext():
            learned = learner_update(self.learner, train_batch, batch, learner_version=version)
        tracker.report("learner", learned)  # a Ctrl-C from here on: this step is saved (9.)
        # Books before publish frees capacity: in flight = admitted under the old weights.
        progress = scheduler.end_step(
            batch.groups, version, tracker, skipped=learned.get("skipped")
        )
        # 7. Publish: the fleet puts the new version on every server (they keep decoding).
        with times.publishing(), console.phase(f"{label}: publishing the weights"):
            self.version = version = self.learner.step
            sync = self.fleet.publish(self.learner, version)
        self.writer.write_timeline(times.timeline(version))
        tracker.report("time", times.metrics(learned, sync))  # docs/METRICS.md
        tracker.report("version", policy_version=version)
        # 8. Plan the next step: rho, alpha, requests in flight (the step controller).
        control.end_step(
            tracker, next_version=version, progress=progress, step_s=times.step_s,
            train_s=times.train_s, staleness=stale, learner_metrics=learned,
        )  # fmt: skip
        last = version == exp.total_steps
        return StepInfo(version, tracker.take(), last=last, first_update=bool(note))

    def close(self) -> None:
        """Shut the run down: the scheduler aborts what is outstanding (counted) and stops
        the servers first; then the fleet, the learner, the workload (its reward pool), the
        writer."""
        self.console.background("shutting down: stopping the servers, writing the last checkpoint")
        parts = (self.scheduler, self.fleet, self.learner, self.workload, self.writer)
        for part in (p for p in parts if p):
            part.close()
        self.console.background(None)
