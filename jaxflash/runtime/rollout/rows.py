"""The rollouts.jsonl row: one per sample that left the buffer (docs/METRICS.md).

The batch assembler writes one for every sample of a trained, filtered, stale or failed
prompt (``rollout.batches``); a failed prompt's samples that never came back get one
too (``missing_row``: nothing generated, or the tokens lost with the request), so every
failed prompt has rows. ``ROLLOUT_FIELDS`` are its keys in order, which
``metrics.metric_docs`` documents. Host-side numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.rollout.scoring import TruncationPolicy, correctness
from jaxflash.types import FailureReason, FinishReason, Prompt, Sample

ROLLOUT_FIELDS = (
    "learner_step",
    "prompt_id",
    "sample_index",
    "prompt",
    "answer",
    "response",
    "response_tokens",
    "response_len",
    "finish_reason",
    "reward",
    "correct",
    "reward_error",
    "outcome",
    "reason",
    "failure",
    "loss_masked",
    "start_version",
    "staleness",
    "token_version_min",
    "token_version_max",
)
"""Keys of every rollouts.jsonl row, in order (docs/METRICS.md)."""


def rollout_row(
    sample: Sample,
    prompt: Any,
    *,
    outcome: str,
    reason: str,
    learner_version: int,
    truncation: TruncationPolicy,
    failure: FailureReason | None = None,
) -> dict[str, Any]:
    """The rollouts.jsonl row of one sample that left the buffer.

    Args:
      sample: the scored sample.
      prompt: its Prompt (None when no longer known: text and answer are "").
      outcome: "trained" | "filtered" | "stale" | "failed" | "regenerated" (the
        prompt is generated again; these samples are discarded).
      reason: "trained", the filter reason, "stale", "surplus_stale" or "failed".
      learner_version: version of the learner step the batch was taken for
        (the row's ``learner_step`` is the step it produces, version + 1).
      truncation: decides ``loss_masked``.
      failure: why a failed prompt failed.
    """
    versions = np.asarray(sample.token_versions)
    start = int(start_version_of(sample))
    text, answer = (prompt.text, prompt.answer) if isinstance(prompt, Prompt) else ("", "")
    row = {
        "learner_step": int(learner_version) + 1,
        "prompt_id": int(sample.prompt_id),
        "sample_index": int(sample.sample_index),
        "prompt": text,
        "answer": answer,
        "response": sample.response_text,
        "response_tokens": [int(t) for t in sample.response_tokens],
        "response_len": len(sample.response_tokens),
        "finish_reason": str(sample.finish_reason),
        "reward": sample.reward,
        "correct": correctness(sample),
        "reward_error": (sample.reward_info or {}).get("error"),
        "outcome": outcome,
        "reason": reason,
        "failure": None if failure is None else str(failure),
        "loss_masked": outcome != "trained" or truncation.masks(sample),
        "start_version": start,
        "staleness": int(learner_version) - start,
        "token_version_min": int(versions.min()) if versions.size else None,
        "token_version_max": int(versions.max()) if versions.size else None,
    }
    return row


def missing_row(
    prompt_id: int,
    sample_index: int,
    prompt: Any,
    *,
    learner_version: int,
    failure: FailureReason | None,
    reason: str = "failed",
) -> dict[str, Any]:
    """The rollouts.jsonl row of a failed prompt's sample that never came back.

    Nothing of it is known beyond its identity (it was never generated -- a malformed
    row, an over-long prompt -- or its request was aborted, rejected or lost with its
    server): empty response, ``finish_reason`` "aborted", no reward, versions null.

    Args:
      prompt_id, sample_index: the sample's identity.
      prompt: its Prompt (anything else: text and answer are "").
      learner_version: as ``rollout_row``.
      failure: why the prompt failed.
      reason: the dropped group's reason ("failed"; "drained" at shutdown).
    """
    text, answer = (prompt.text, prompt.answer) if isinstance(prompt, Prompt) else ("", "")
    return {
        "learner_step": int(learner_version) + 1,
        "prompt_id": int(prompt_id),
        "sample_index": int(sample_index),
        "prompt": text,
        "answer": answer,
        "response": "",
        "response_tokens": [],
        "response_len": 0,
        "finish_reason": str(FinishReason.ABORTED),
        "reward": None,
        "correct": 0.0,
        "reward_error": None,
        "outcome": "failed",
        "reason": reason,
        "failure": None if failure is None else str(failure),
        "loss_masked": True,
        "start_version": None,
        "staleness": None,
        "token_version_min": None,
        "token_version_max": None,
    }
