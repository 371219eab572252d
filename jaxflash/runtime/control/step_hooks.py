"""What a run does with each step's record, on cadences: the run's hooks.

After each learner step the loop hands the step's record (``metrics.tracker``) to
``RunHooks.after_step``, which runs these ``Hook``s in order, each when due
(``every=`` steps, and at the last step whatever the cadence):

1. ``evaluate`` (every ``eval.every``): held-out accuracy added to the record; not
   after a Ctrl-C (a stopping run saves rather than evaluates);
2. ``check_finite``: a NaN/Inf loss, grad norm or entropy stops the run;
3. ``write``: the metrics.jsonl row and its console line;
4. ``failing``: steps in a row in which every prompt failed stop the run;
5. ``preemption``: every learner process agrees whether a SIGTERM stops it here
   (the step then is the last);
6. ``checkpoint`` (every ``checkpoint.every``): the state with the books the rollout
   kept before the step's publish (``RolloutScheduler.step_books``); also after a
   Ctrl-C at this step.

``save_unsaved`` keeps the last trained step when a stop comes between two steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jaxflash.metrics.tracker import Hook, StepInfo, run_hooks
from jaxflash.metrics.writer import MetricsWriter
from jaxflash.runtime.console import Console, step_line
from jaxflash.runtime.control.run_control import RunControl
from jaxflash.runtime.interrupt import DeferredInterrupt
from jaxflash.runtime.resume import checkpoint_meta
from jaxflash.runtime.workloads.learner_batch import check_failing_streak


def check_finite(metrics: dict[str, Any], step: int) -> None:
    """Fail loudly on NaN/Inf training metrics (eval NaN with no prompts is allowed).

    Raises:
      FloatingPointError: ``loss``, ``grad_norm`` or ``entropy`` is not finite.
    """
    for key in ("loss", "grad_norm", "entropy"):
        value = metrics.get(key)
        if value is not None and not math.isfinite(value):
            raise FloatingPointError(f"step {step}: metric {key} is {value}: {metrics}")


class RunHooks:
    """The run's cadences (module docstring), over its parts.

    Args:
      total_steps, eval_every, checkpoint_every: the run's (``ExperimentConfig``).
      evaluate: ``workloads.evaluation.HeldOutEval`` ({} when nothing is held out).
      writer: the run's metrics.jsonl. console: where each row's line goes.
      learner: ``LearnerProgram`` (``preempted``, ``save``, ``saved_step``).
      control: the run's ``RunControl`` (its ``checkpoint_state``).
      rollout: the rollout's books (``RolloutScheduler.books``: ``step_books``, ``outcomes``,
        ``ledger_metrics``).
      interrupt: the run's Ctrl-C (``requested``, ``check_stop``).
      elapsed: the time since the run started, as text.
      wall: the run's clocks to keep in each checkpoint (``StepTimes.wall_state``), so
        a resume continues them.

    Attributes:
      record: the last record written (the run returns it).
      preempted: a SIGTERM stopped the run at the last step.
    """

    def __init__(
        self, *, total_steps: int, eval_every: int, checkpoint_every: int,
        evaluate: Callable[..., dict[str, Any]], writer: MetricsWriter, console: Console,
        learner: Any, control: RunControl, rollout: Any, interrupt: DeferredInterrupt,
        elapsed: Callable[[], str], wall: Callable[[], dict[str, float]] = dict,
    ):  # fmt: skip
        self._total, self._evaluate, self._writer = total_steps, evaluate, writer
        self._console, self._learner, self._control = console, learner, control
        self._rollout, self._interrupt, self.elapsed = rollout, interrupt, elapsed
        self._wall = wall
        self.record: dict[str, Any] = {}
        self.preempted, self._failing = False, 0
        self.hooks = (
            Hook(self._eval, every=eval_every),
            Hook(lambda info: check_finite(info.record, info.step)),
            Hook(self._write),
            Hook(self._failing_streak),
            Hook(self._preemption),
            Hook(self._checkpoint, every=checkpoint_every),
        )

    def before_training(self) -> dict[str, Any]:
        """Step 0 of a fresh run: the evaluation before training, its row (with the
        ledger's counts) and line. Returns the evaluation's metrics."""
        self._console.background(f"step 0/{self._total}")
        self.record = self._evaluate(0, stop=self._interrupt.check_stop)  # SIGTERM: unscored
        row = self._writer.write_step(0, {**self.record, **self._rollout.ledger_metrics()})
        self._console.line(step_line(0, self._total, self.elapsed(), row))
        return self.record

    def after_step(self, info: StepInfo) -> StepInfo:
        """Run the due hooks on a step's record (``info.last``: the run's last step)."""
        return run_hooks(self.hooks, info)

    def save_unsaved(self, version: int) -> None:
        """Save ``version`` unless it is on disk (a stop between two steps: the last
        trained step is kept; the step in flight is generated again on resume)."""
        if self._learner.saved_step < version:
            self._save(version)

    # ------------------------------------------------------------------ the hooks

    def _eval(self, info: StepInfo) -> None:
        if not self._interrupt.requested:  # not when stopping on Ctrl-C
            info.record.update(self._evaluate(info.step, stop=self._interrupt.check_stop))

    def _write(self, info: StepInfo) -> None:
        self.record = info.record
        row = self._writer.write_step(info.step, info.record)
        line = step_line(info.step, self._total, self.elapsed(), row, info.first_update)
        self._console.line(line)

    def _failing_streak(self, info: StepInfo) -> None:
        self._failing = self._failing + 1 if info.record.get("skipped") == "all_failed" else 0
        check_failing_streak(self._failing, self._rollout.outcomes)  # broken reward/data

    def _preemption(self, info: StepInfo) -> None:
        self.preempted = self._learner.preempted(info.step)  # every learner process agrees
        info.last = info.last or self.preempted or self._interrupt.requested

    def _checkpoint(self, info: StepInfo) -> None:
        self._save(info.step)

    def _save(self, version: int) -> None:
        books = self._rollout.step_books
        state = self._control.checkpoint_state()
        # A phase of its own: a real model's save takes minutes, and its progress line
        # says so rather than a bare "step 1/20 (1 min 51 s)".
        with self._console.phase(f"step {version}/{self._total}: saving the checkpoint"):
            self._learner.save(checkpoint_meta(version, books, *state, wall=self._wall()))
