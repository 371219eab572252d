"""The run's console: one line per event, and a progress line during every long phase.

A real-model run spends minutes in phases that print nothing of their own:
loading weights, compiling the engine and the learner step, the first
evaluation, generating a step's samples. ``Console.phase`` names the phase;
while it lasts, a heartbeat thread prints ``label: status (elapsed)`` every
``every_s`` seconds of silence, where ``status`` is a function the phase
supplies (e.g. "20/32 samples generated, 16 scored, 2345 tokens at 45.0
tokens/s"). Between phases, ``background`` names what the run is in ("step
3/20"), so no stretch of work is silent for longer than ``every_s``. Plain lines, not an
in-place bar: they read the same in a terminal, through ``tee`` and in a log
file, and they never garble with the warnings logging writes to stderr.

The heartbeat reads counters the run already keeps (under their own locks); it
never touches a device and never raises into the run (a status function that
fails shows as "?").

The run's own lines are written here too: each step's (``step_line``, from its
metrics.jsonl row) and the start-up lines naming the model and the schedule
(``describe_model``, ``describe_schedule``).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

Status = Callable[[], str]


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min`` (console text)."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Console:
    """Lines to ``stream`` and, inside ``phase``, a periodic progress line.

    Args:
      stream: where lines go (None: nothing is printed, e.g. in tests).
      every_s: seconds of silence after which a running phase prints its progress.
      now: monotonic time source (seconds).
    """

    def __init__(
        self,
        stream: TextIO | None = sys.stdout,
        *,
        every_s: float = 5.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"Console.every_s must be > 0, got {every_s}")
        self._stream = stream
        self.every_s = float(every_s)
        self._now = now
        self._lock = threading.Lock()
        self._phases: list[tuple[str, Status | None, float]] = []  # innermost last
        self._background: tuple[str, Status | None, float] | None = None
        self._last_output = now()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._noted: set[str] = set()

    def once(self, key: str, note: str) -> str:
        """``note`` the first time ``key`` is asked, "" after (e.g. "the first generation
        compiles the engine": the engine is compiled once, by whichever runs first)."""
        with self._lock:
            first = key not in self._noted
            self._noted.add(key)
        return note if first else ""

    def line(self, text: str) -> None:
        """Print one line now (and restart the silence timer)."""
        with self._lock:
            self._write(text)

    @contextlib.contextmanager
    def phase(
        self, label: str, status: Status | None = None, *, announce: str | None = None
    ) -> Iterator[None]:
        """A long phase: progress lines every ``every_s`` s of silence until it ends.

        Phases nest: an inner phase reports while it lasts, then the outer one again
        (a step's phase covers the work between its generation and training phases).

        Args:
          label: what is happening, short ("step 3/20: generating").
          status: returns the progress so far ("17/32 samples ..."); called on the
            heartbeat thread, so it must only read thread-safe counters.
          announce: a line printed at once (for phases worth naming even when short).
        """
        if self._stream is None:
            yield
            return
        entry = (label, status, self._now())
        with self._lock:
            if announce:
                self._write(announce)
            self._phases.append(entry)
            self._start()
        try:
            yield
        finally:
            with self._lock:
                self._phases.remove(entry)

    def background(self, label: str | None) -> None:
        """What the run is doing between phases ("step 3/20"); None: nothing (silence
        is then expected, e.g. after the run)."""
        with self._lock:
            self._background = None if label is None else (label, None, self._now())
            if label is not None and self._stream is not None:
                self._start()

    def close(self) -> None:
        """Stop the heartbeat thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -------------------------------------------------------------- internals

    def _write(self, text: str) -> None:  # under self._lock
        if self._stream is not None:
            print(text, file=self._stream, flush=True)
        self._last_output = self._now()

    def _start(self) -> None:  # under self._lock
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="console", daemon=True)
            self._thread.start()

    def _progress_line(self) -> str | None:  # under self._lock
        current = self._phases[-1] if self._phases else self._background
        if current is None or self._now() - self._last_output < self.every_s:
            return None
        label, status, started = current
        try:
            detail = status() if status is not None else ""
        except Exception:  # a progress line must never stop the run
            detail = "?"
        elapsed = duration(self._now() - started)
        return f"  {label}: {detail} ({elapsed})" if detail else f"  {label} ({elapsed})"

    def _beat(self) -> None:
        while not self._stop.wait(min(0.5, self.every_s / 4)):
            with self._lock:
                text = self._progress_line()
                if text is not None:
                    self._write(text)


# -------------------------------------------------------------- the run's status lines


class GenerationStatus:
    """Status of one step's generation, from the scheduler's counters.

    ``status()``: "20 samples generated, 16 scored (this step needs 32), 2345 tokens
    at 45.0 tokens/s" since this object was made. Generated samples are not shown as
    a fraction of the step's need: retries, regenerated stale samples and, with
    α > 0, samples for later steps make them exceed it ("generated incl. ahead" when
    the scheduler's ``sched_async_ratio`` > 0). In an agentic run every turn is a
    generated sample, so the line reads "87 turns generated, 5 episodes finished
    (this step needs 16), ...".

    Args:
      scheduler: ``stats()`` (samples_generated, samples_scored, episodes_finished,
        sched_async_ratio; locked) and ``server_stats()`` (each server's
        generated_tokens).
      now: the run's clock (seconds).
      samples: the step's need (B·G samples, or B·G episodes with ``episodes``).
      episodes: an agentic run (the need counts episodes, not samples).
    """

    def __init__(
        self, scheduler: Any, now: Callable[[], float], *, samples: int, episodes: bool = False
    ):
        self._scheduler, self._now, self._target = scheduler, now, samples
        self._episodes = episodes
        self._t0 = now()
        self._ahead = scheduler.stats().get("sched_async_ratio", 0) > 0
        self._before = self._counts()

    def _counts(self) -> tuple[int, int, int]:
        stats = self._scheduler.stats()
        # Remote servers' stats arrive as JSON numbers (floats): counts are shown as ints.
        tokens = int(sum(s.get("generated_tokens", 0) for s in self._scheduler.server_stats()))
        done = "episodes_finished" if self._episodes else "samples_scored"
        return stats.get("samples_generated", 0), stats.get(done, 0), tokens

    def __call__(self) -> str:
        (g0, s0, t0), (g1, s1, t1) = self._before, self._counts()
        rate = (t1 - t0) / max(self._now() - self._t0, 1e-9)
        ahead = " incl. ahead" if self._ahead else ""
        if self._episodes:
            head = f"{g1 - g0} turns generated, {s1 - s0} episodes finished{ahead}"
        else:
            head = f"{g1 - g0} samples generated{ahead}, {s1 - s0} scored"
        unit = "episodes" if self._episodes else "samples"
        need = f"(this step needs {self._target} {unit})"
        return f"{head} {need}, {t1 - t0} tokens at {rate:.1f} tokens/s"


class EvalStatus:
    """Status of an evaluation: ``update`` is its progress callback, ``status()`` the line.

    Args:
      now: the run's clock (seconds).
      unit: what ``update`` counts ("samples"; "episodes" for an agentic evaluation).
    """

    def __init__(self, now: Callable[[], float], *, unit: str = "samples"):
        self._now, self._t0, self._unit = now, now(), unit
        self.done = self.total = self.tokens = 0

    def update(self, done: int, total: int, tokens: int) -> None:
        self.done, self.total, self.tokens = done, total, tokens

    def __call__(self) -> str:
        if not self.total:  # no progress reported yet: no count to show
            return f"starting (no {self._unit} counted yet)"
        rate = self.tokens / max(self._now() - self._t0, 1e-9)
        return (
            f"{self.done}/{self.total} {self._unit} finished, {self.tokens} tokens at "
            f"{rate:.1f} tokens/s"
        )


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
    return ok and math.isfinite(value)


def describe_model(config: Any, lora: Any = None) -> str:
    """One console line: the shape of a ``ModelConfig``, and what is trained.

    Args:
      lora: ``learner.lora`` (a ``models.adapters.lora.LoraConfig``) or None: with it, the line
        names the rank, the targets, the float32 adapters and the frozen base's storage
        (int8/int4: QLoRA) instead of "<param_dtype> params".
    """
    valid = config.valid_vocab_size
    vocab = f"vocab {config.vocab_size}" + (f" ({valid} used)" if valid else "")
    if lora is None:
        trained = f"{config.param_dtype} params"
    else:  # adapters are float32 (models.adapters.lora.adapter_layout); the base never trains
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


def describe_schedule(*, rollout: Any, controller: Any, learner: Any) -> str:
    """One console line: synchronous, or asynchronous with its staleness bound alpha.

    Args:
      rollout, controller, learner: the experiment's sections (``rollout.async_ratio``,
        ``controller.kind``, ``learner.loss``).
    """
    alpha = rollout.async_ratio
    if alpha == 0:
        return (
            "schedule: synchronous (rollout.async_ratio=0): each step trains on samples of "
            "the policy it starts with"
        )
    adaptive = controller.kind == "adaptive"
    bound = f"the adaptive controller sets alpha <= {alpha} each step" if adaptive else ""
    return (
        f"schedule: asynchronous, staleness <= alpha = {alpha} (rollout.async_ratio): "
        "generation keeps decoding on its own slices while the learner trains, and a "
        f"sample may be up to {alpha} policy versions old (loss {learner.loss})"
        + (f"; {bound}" if bound else "")
    )
