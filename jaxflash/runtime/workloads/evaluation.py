"""Held-out evaluation: accuracy (mean@n) on a fixed prompt set, scored by the run's reward.

It generates through whatever fleet the run has: a ``Generate`` (``fleet.generator()``:
an engine of this process, or the generation programs) runs the requests.
``HeldOutEval`` is the loop's call: the workload's held-out evaluation (``Workload.held_out``)
with console progress.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxflash.runtime.clock import Clock
from jaxflash.runtime.console import Console, EvalStatus
from jaxflash.runtime.interrupt import Interrupted, Preempted
from jaxflash.runtime.rollout.reward_pool import RewardPool
from jaxflash.runtime.rollout.scoring import (
    TruncationPolicy,
    correctness,
    response_text,
    scored_sample,
)
from jaxflash.types import GenerationRequest, Prompt, Sample, SamplingParams

log = logging.getLogger(__name__)
EVAL_SEED_OFFSET = 1_000_003  # eval samples never share RNG streams with training samples
_NO_TRUNCATION_PENALTY = TruncationPolicy(mode="none")  # accuracy counts the answer alone

Progress = Callable[[int, int, int], None]
"""``progress(samples_finished, samples_total, tokens_generated_so_far)``."""


class Generate(Protocol):
    """What evaluation generates with (``fleet.eval_generation``: an engine here, or the
    generation programs), at the version being evaluated."""

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError if ``request`` cannot run (too long, other sampling)."""

    def run(
        self,
        requests: Sequence[GenerationRequest],
        *,
        version: int,
        on_step: Callable[[list[Sample], int], None] | None = None,
    ) -> list[Sample]:
        """One Sample per request, in request order; ``on_step(finished, tokens so
        far)`` as samples finish."""


class HeldOutEval:
    """The run's evaluation: ``self(version)`` runs the workload's ``held_out`` (a
    ``workloads.workload.HeldOut``) on ``fleet.generator()`` (whatever fleet the run has)
    with console progress; {} when the workload holds nothing out. Adds ``eval_time_s``."""

    def __init__(self, held_out: Any, fleet: Any, console: Console, clock: Clock):
        self._held_out, self._fleet, self._console, self._clock = held_out, fleet, console, clock

    def __call__(self, version: int, stop: Callable[[], None] | None = None) -> dict[str, float]:
        """Evaluate ``version``; ``stop()`` is called at every progress report (each decode
        step, or every 0.2 s on generation programs): a ``Preempted`` or ``Interrupted`` it
        raises ends the evaluation unscored ({} : a stopping run saves rather than evaluates)."""
        held_out, console, clock = self._held_out, self._console, self._clock
        if not held_out.size:
            return {}
        t0 = clock.now()
        status = EvalStatus(clock.now, unit=held_out.unit)
        note = console.once("engine", " (the first evaluation compiles the engine)")
        announce = f"evaluating at step {version}: {held_out.describe()}{note} ..."

        def progress(done: int, total: int, tokens: int) -> None:
            if stop is not None:
                stop()
            status.update(done, total, tokens)

        with console.phase("evaluating", status, announce=announce):
            generate = self._fleet.generator()
            try:
                out = held_out.evaluate(generate, version=version, progress=progress)
            except (Preempted, Interrupted):
                log.warning(
                    "evaluation at step %d stopped (SIGTERM or Ctrl-C): not scored", version
                )
                return {}
        return {**out, "eval_time_s": clock.now() - t0}


def evaluate(
    generate: Generate,
    prompts: list[Prompt],
    *,
    samples_per_prompt: int,
    sampling: SamplingParams,
    seed: int,
    policy_version: int,
    tokenizer: Any,
    reward_pool: RewardPool,
    progress: Progress | None = None,
) -> dict[str, float]:
    """Answer accuracy on held-out prompts, as mean@n with its standard error.

    Each sample is sent to the reward pool the moment it finishes, so scoring
    overlaps the rest of the generation.

    Args:
      generate: runs the requests (its engines sample ``sampling``).
      prompts: held-out prompts (the same list at every evaluation).
      samples_per_prompt: n samples per prompt.
      sampling: the training sampling (one engine, one compiled distribution).
      seed: the run seed (offset so eval never shares RNG streams with training).
      policy_version: the version evaluated (what ``generate`` holds).
      tokenizer: ``stop_ids`` (every id that ends a response) and
        ``response_text(ids)`` (the text the reward sees).
      reward_pool: the training reward pool (the same reward scores both).
      progress: called after every decode step (for the console).

    Returns:
      {"eval_accuracy": mean over prompts of the per-prompt mean correctness
       (``scoring.correctness``: the reward's ``correct`` component, else its
       score; the training metric ``accuracy``'s definition),
       "eval_accuracy_stderr": standard error over prompts, "eval_prompts": count,
       "eval_failed": prompts that could not be evaluated (too long / reward error)}.
    """
    requests = []
    failed = 0
    reasons: collections.Counter[str] = collections.Counter()  # failed samples, by reason
    for p in prompts:
        reqs = [
            GenerationRequest(
                prompt_id=p.prompt_id,
                sample_index=i,
                prompt_tokens=p.prompt_tokens,
                sampling=sampling,
                seed=seed + EVAL_SEED_OFFSET,
            )
            for i in range(samples_per_prompt)
        ]
        try:
            generate.check(reqs[0])
        except ValueError:
            failed += 1
            reasons["prompt_too_long"] += samples_per_prompt  # or other sampling: refused
            continue
        requests.extend(reqs)
    answers = {p.prompt_id: p.answer for p in prompts}
    if progress is not None:
        progress(0, len(requests), 0)
    scored = []  # (sample, future), in finishing order

    def score(finished: list[Sample], tokens: int) -> None:
        for s in finished:
            item = (
                response_text(s, tokenizer),
                answers[s.prompt_id],
                f"eval prompt {s.prompt_id} sample {s.sample_index}",
            )
            scored.append((s, reward_pool.submit(item)))
        if progress is not None:  # every decode step: long responses finish late
            progress(len(scored), len(requests), tokens)

    generate.run(requests, version=policy_version, on_step=score)
    per_prompt: dict[int, list[float]] = {}
    errored: set[int] = set()
    for s, fut in scored:
        s, failure = scored_sample(s, fut.result(), _NO_TRUNCATION_PENALTY)
        if failure is not None:
            errored.add(s.prompt_id)
            reasons[str(failure)] += 1
        per_prompt.setdefault(s.prompt_id, []).append(correctness(s))
    means = np.array([np.mean(v) for k, v in per_prompt.items() if k not in errored])
    n = len(means)
    if reasons:  # a reward that raises fails evaluation too: said, not only counted
        log.warning(
            "evaluation at step %d: %d of %d prompts failed and are left out of "
            "eval_accuracy (failed samples by reason: %s)",
            policy_version, failed + len(errored), len(prompts), dict(sorted(reasons.items())),
        )  # fmt: skip
    return {
        "eval_accuracy": float(means.mean()) if n else float("nan"),
        "eval_accuracy_stderr": float(means.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "eval_prompts": n,
        "eval_failed": failed + len(errored),
    }
