"""Held-out evaluation: accuracy (mean@n) on a fixed prompt set, scored by the run's reward."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.slot_loop import SlotBatcher
from jaxflash.generation.slot_types import check_request
from jaxflash.runtime.rollout.reward_pool import RewardPool
from jaxflash.runtime.rollout.scoring import (
    TruncationPolicy,
    correctness,
    response_text,
    scored_sample,
)
from jaxflash.types import GenerationRequest, Prompt, SamplingParams

EVAL_SEED_OFFSET = 1_000_003  # eval samples never share RNG streams with training samples
_NO_TRUNCATION_PENALTY = TruncationPolicy(mode="none")  # accuracy counts the answer alone

Progress = Callable[[int, int, int], None]
"""``progress(samples_finished, samples_total, tokens_generated_so_far)``."""


def evaluate(
    engine: LlamaEngine,
    params: Any,
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
      engine, params: generation engine and params (engine samples ``sampling``).
      prompts: held-out prompts (the same list at every evaluation).
      samples_per_prompt: n samples per prompt.
      sampling: the training sampling (one engine, one compiled distribution).
      seed: the run seed (offset so eval never shares RNG streams with training).
      policy_version: version of ``params``.
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
            check_request(engine, reqs[0])
        except ValueError:
            failed += 1
            continue
        requests.extend(reqs)
    answers = {p.prompt_id: p.answer for p in prompts}
    batcher = SlotBatcher(
        engine, params, policy_version=policy_version, stop_ids=tokenizer.stop_ids
    )
    for request in requests:
        batcher.add(request)
    if progress is not None:
        progress(0, len(requests), 0)
    scored = []  # (sample, future), in finishing order
    while not batcher.idle:
        for s in batcher.step():
            item = (
                response_text(s, tokenizer),
                answers[s.prompt_id],
                f"eval prompt {s.prompt_id} sample {s.sample_index}",
            )
            scored.append((s, reward_pool.submit(item)))
        if progress is not None:  # every decode step: long responses finish late
            progress(len(scored), len(requests), batcher.stats.generated_tokens)
    per_prompt: dict[int, list[float]] = {}
    errored: set[int] = set()
    for s, fut in scored:
        s, failure = scored_sample(s, fut.result(), _NO_TRUNCATION_PENALTY)
        if failure is not None:
            errored.add(s.prompt_id)
        per_prompt.setdefault(s.prompt_id, []).append(correctness(s))
    means = np.array([np.mean(v) for k, v in per_prompt.items() if k not in errored])
    n = len(means)
    return {
        "eval_accuracy": float(means.mean()) if n else float("nan"),
        "eval_accuracy_stderr": float(means.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "eval_prompts": n,
        "eval_failed": failed + len(errored),
    }
