"""A learner step's phases on the run's clock: its ``time`` metrics and timeline row.

``StepTimes`` times the phases the learner goes through (waiting for the batch, the
update, the weight publish) and, with the rollout's spans (generation busy, reward
scoring), gives the step's timeline.jsonl row (``timeline_row``) and its time metrics
(``time_metrics``; docs/METRICS.md). Host-side, thread-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class SpanSource(Protocol):
    """What the step's timeline reads of the rollout (``RolloutScheduler.watch``)."""

    @property
    def first_request_at(self) -> float | None:
        """Clock time of the run's first request to a server (None before)."""

    def take_timeline_spans(self) -> dict[str, Any]:
        """Busy spans per server and reward spans since the last call."""


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
        batch. trained_at_s: since the first request of the run (a resumed run's goes
        on from its checkpoint).
      learner_metrics: the update's (its "tokens" trained).
      sync: the publish (``fleet.WeightSync``: copy_s, handover_s, bytes, and under
        delta publish changed_frac, full_fallbacks).
    """
    delta = {}
    if getattr(sync, "changed_frac", None) is not None:
        delta = {"publish_changed_frac": sync.changed_frac,
                 "publish_full_fallbacks": sync.full_fallbacks}  # fmt: skip
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
        **delta,
    }


class StepTimes:
    """The phases of one learner step at a time, on the run's clock.

    A resumed run's clock goes on from its checkpoint: ``wall_state()`` is saved with
    each checkpoint and given back as ``resumed`` (the time between the save and the
    restart is not counted), so ``trained_at_s``, the timeline and the console's
    ``elapsed`` keep increasing across a resume instead of starting again from 0.

    Args:
      now: the run's clock (``Clock.now``), seconds.
      origin: this launch's start on that clock (timeline rows count from it, plus
        ``resumed``'s ``run_s``).
      rollout: where the generation and reward spans come from.
      resumed: the checkpoint's ``wall_state()`` ({} or None: a fresh run).
    """

    def __init__(
        self, now: Callable[[], float], *, origin: float, rollout: SpanSource,
        resumed: dict[str, float] | None = None,
    ):  # fmt: skip
        self._now, self._rollout = now, rollout
        resumed = resumed or {}
        self._run_before = float(resumed.get("run_s", 0.0))  # earlier launches' seconds
        self._trained_before = float(resumed.get("trained_s", 0.0))
        self._origin = origin - self._run_before  # the run's start, as if never stopped
        self.start()

    def elapsed_s(self) -> float:
        """Seconds since the run started (earlier launches' included)."""
        return self._now() - self._origin

    def wall_state(self) -> dict[str, float]:
        """What a checkpoint keeps so a resume continues the run's clocks: ``run_s``
        (``elapsed_s``) and ``trained_s`` (the ``trained_at_s`` clock, now)."""
        return {"run_s": self.elapsed_s(), "trained_s": self._trained_clock()}

    def _trained_clock(self) -> float:
        """Seconds since the run's first request (earlier launches' included)."""
        first = self._rollout.first_request_at
        return self._trained_before + (self._now() - first if first else 0.0)

    def start(self) -> None:
        """A step begins (the learner starts waiting for its batch)."""
        self.t_step = self._now()
        self.wait_s = 0.0
        self.train = self.publish = (self.t_step, self.t_step)
        self.trained_at_s = 0.0

    def waited(self, wait_s: float) -> None:
        """The batch arrived after ``wait_s`` seconds of the learner's waiting."""
        self.wait_s = wait_s

    @property
    def train_s(self) -> float:
        """The update's seconds (or the skip's)."""
        return self.train[1] - self.train[0]

    @property
    def step_s(self) -> float:
        """The step's seconds, from ``start`` to the publish's end."""
        return self.publish[1] - self.t_step

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Times the update (the ``train`` span; ``trained_at_s`` since the run's first
        request, earlier launches' seconds included)."""
        t0 = self._now()
        yield
        self.train = (t0, self._now())
        if not self._rollout.first_request_at:  # no request yet: from the step's start
            self.trained_at_s = self._trained_before + self._now() - self.t_step
        else:
            self.trained_at_s = self._trained_clock()

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        """Times the weight publish (the ``publish`` span; the step ends with it)."""
        t0 = self._now()
        yield
        self.publish = (t0, self._now())

    def timeline(self, step: int) -> dict[str, Any]:
        """The step's timeline.jsonl row, with the rollout's spans since the last row."""
        return timeline_row(
            step,
            self._rollout.take_timeline_spans(),
            origin=self._origin,
            wait=(self.t_step, self.t_step + self.wait_s),
            train=self.train,
            publish=self.publish,
        )

    def metrics(self, learner_metrics: dict[str, Any], sync: Any) -> dict[str, Any]:
        """The step's ``time`` section (``time_metrics``)."""
        return time_metrics(
            step_s=self.step_s,
            train_s=self.train_s,
            wait_s=self.wait_s,
            trained_at_s=self.trained_at_s,
            learner_metrics=learner_metrics,
            sync=sync,
        )
