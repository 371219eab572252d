"""One synchronous rollout round: prompts -> G samples each -> rewards -> groups.

Every prompt handed in ends this round either inside a complete scored group in
the ``GroupBuffer`` or failed in it (with a reason): over-long prompts, reward
errors and timeouts are failures the ledger counts, never silent drops.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from jaxflash.data.prompts import PromptFailure
from jaxflash.generation.engine import LlamaEngine
from jaxflash.generation.slot_loop import SlotStats, check_request, run_requests
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.runtime.reward_pool import RewardPool
from jaxflash.types import GenerationRequest, Prompt, Sample, SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class TruncationPolicy:
    """What a truncated response (hit max_new_tokens) gets.

    mode "penalty": its reward is replaced by ``penalty``; mode "mask": it is
    scored normally but carries no loss (the learner never sees it); mode "none":
    it keeps its reward like any other response.
    """

    mode: str = "penalty"
    penalty: float = 0.0


@dataclasses.dataclass
class RoundResult:
    """What one rollout round produced.

    Attributes:
      samples: every finished sample of the round (scored), in request order.
      metrics: reward/accuracy/length/throughput statistics of the round.
      rows: one dict per sample for rollouts.jsonl.
    """

    samples: list[Sample]
    metrics: dict[str, float]
    rows: list[dict[str, Any]]


def _requests(prompt: Prompt, group_size: int, sampling: SamplingParams, seed: int):
    return [
        GenerationRequest(
            prompt_id=prompt.prompt_id,
            sample_index=i,
            prompt_tokens=prompt.prompt_tokens,
            sampling=sampling,
            seed=seed,
        )
        for i in range(group_size)
    ]


def rollout_round(
    engine: LlamaEngine,
    params: Any,
    items: list[Prompt | PromptFailure],
    *,
    buffer: GroupBuffer,
    group_size: int,
    sampling: SamplingParams,
    seed: int,
    policy_version: int,
    tokenizer: Any,
    reward_pool: RewardPool,
    truncation: TruncationPolicy,
) -> RoundResult:
    """Generates G samples per prompt, scores them, and files them in ``buffer``.

    Args:
      engine: generation engine (sampling distribution must equal ``sampling``).
      params: generation params (already on the engine's mesh).
      items: prompts (or failures from the prompt source, filed as failed).
      buffer: receives each scored sample, or ``fail(prompt_id, reason)``.
      group_size: G samples per prompt (prompt replication: G requests).
      sampling: temperature / top-k / top-p / max_new_tokens.
      seed: run seed; with (prompt_id, sample_index) it keys the sampling RNG.
      policy_version: version of ``params``.
      tokenizer: decodes responses for the reward (``decode(ids)``).
      reward_pool: scores (response, answer) in worker processes with deadlines.
      truncation: what a truncated response gets.

    Returns:
      RoundResult with the samples, round metrics and rollout rows.
    """
    prompts: dict[int, Prompt] = {}
    requests: list[GenerationRequest] = []
    for item in items:
        if isinstance(item, PromptFailure):
            buffer.fail(item.prompt_id, item.reason)
            continue
        reqs = _requests(item, group_size, sampling, seed)
        try:
            check_request(engine, reqs[0])
        except ValueError as err:  # e.g. longer than the engine's prefill length
            buffer.fail(item.prompt_id, f"prompt {item.prompt_id}: {err}")
            continue
        prompts[item.prompt_id] = item
        requests.extend(reqs)

    stats = SlotStats()
    t0 = time.monotonic()
    samples = run_requests(
        engine,
        params,
        requests,
        policy_version=policy_version,
        eos_id=tokenizer.eos_id,
        stats=stats,
    )
    gen_s = time.monotonic() - t0

    # Rewards are scored per sample in worker processes (Math-Verify's SIGALRM
    # timeouts only work on a main thread; a hung reward is killed, not awaited).
    futures = []
    for s in samples:
        s.response_text = tokenizer.decode(
            [int(t) for t in s.response_tokens if int(t) != tokenizer.eos_id]
        )
        item_id = f"prompt {s.prompt_id} sample {s.sample_index}"
        futures.append(reward_pool.submit((s.response_text, prompts[s.prompt_id].answer, item_id)))
    failed_prompts: dict[int, str] = {}
    for s, fut in zip(samples, futures, strict=True):
        result = fut.result()
        s.reward_info = {"components": dict(result.components), "error": result.error}
        s.reward = float(result.score)
        if result.error is not None:
            failed_prompts.setdefault(s.prompt_id, f"reward error: {result.error}")
        elif s.truncated and truncation.mode == "penalty":
            s.reward = float(truncation.penalty)
    rows = []
    for s in samples:
        if s.prompt_id in failed_prompts:
            continue
        buffer.add(s)
    for prompt_id, reason in failed_prompts.items():
        buffer.fail(prompt_id, reason)
    for s in samples:
        rows.append(
            {
                "prompt_id": s.prompt_id,
                "sample_index": s.sample_index,
                "prompt": prompts[s.prompt_id].text,
                "answer": prompts[s.prompt_id].answer,
                "response": s.response_text,
                "reward": s.reward,
                "correct": _correct(s),
                "reward_error": s.reward_info["error"],
                "finish_reason": str(s.finish_reason),
                "start_version": s.start_version,
                "token_version_min": int(s.token_versions.min()) if len(s.token_versions) else None,
                "token_version_max": int(s.token_versions.max()) if len(s.token_versions) else None,
                "response_len": len(s.response_tokens),
            }
        )
    return RoundResult(samples=samples, metrics=_round_metrics(samples, stats, gen_s), rows=rows)


def _correct(sample: Sample) -> float:
    """Answer correctness: the Math-Verify component, else reward >= 1 for custom rewards."""
    components = sample.reward_info.get("components", {})
    return float(components.get("math", float(sample.reward is not None and sample.reward >= 1.0)))


def _round_metrics(samples: list[Sample], stats: SlotStats, gen_s: float) -> dict[str, float]:
    if not samples:
        return {"num_samples": 0}
    rewards = np.array([s.reward for s in samples], np.float64)
    correct = np.array([s.reward_info["components"].get("math", 0.0) for s in samples], np.float64)
    lens = np.array([len(s.response_tokens) for s in samples], np.float64)
    return {
        "num_samples": len(samples),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(correct.mean()),
        "response_len_mean": float(lens.mean()),
        "response_len_max": float(lens.max()),
        "truncated_frac": float(np.mean([s.truncated for s in samples])),
        "reward_error_frac": float(np.mean([s.reward_info["error"] is not None for s in samples])),
        "gen_tokens": float(stats.generated_tokens),
        "gen_time_s": gen_s,
        "gen_tokens_per_s": stats.generated_tokens / gen_s if gen_s > 0 else 0.0,
        "gen_slot_occupancy": stats.occupancy,
    }
