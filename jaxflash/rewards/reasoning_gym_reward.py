"""reasoning-gym's own verifiers as a jaxflash reward ("reasoning_gym").

The answer string of a reasoning-gym row is JSON ``{"dataset", "entry"}``
(``jaxflash.data.reasoning_gym_task``). The response's final answer is the
content of its *last* ``<answer>...</answer>`` pair (reasoning-gym's
convention, ``reasoning_gym.utils.extract_answer``); the dataset's
``score_answer(answer, entry)`` scores it in [0, 1] (some verifiers give
partial credit, e.g. Countdown 0.05 for a well-formed wrong expression).
reasoning-gym is imported on first use, inside the worker that scores.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable

from jaxflash.rewards.base import RewardResult, register


@functools.lru_cache(maxsize=64)
def _score_fn(dataset: str) -> Callable[..., float]:
    import reasoning_gym  # noqa: PLC0415 (optional, ~1 s import)

    return reasoning_gym.get_score_answer_fn(dataset)


@register("reasoning_gym")
def reasoning_gym_reward(response_text: str, answer: str) -> RewardResult:
    """Score a response with its reasoning-gym dataset's verifier.

    Args:
      response_text: the response only.
      answer: the row's JSON ``{"dataset": name, "entry": {...}}``.

    Returns:
      RewardResult(score = the verifier's score in [0, 1], components
      {"correct": 1.0 iff score == 1, "answer_found"}); error set when the
      answer string is not a reasoning-gym payload (a data problem).

    Raises:
      TypeError: response_text or answer is not a str.
    """
    if not isinstance(response_text, str) or not isinstance(answer, str):
        raise TypeError("reasoning_gym_reward takes (response_text: str, answer: str)")
    try:
        payload = json.loads(answer)
        dataset, entry = payload["dataset"], payload["entry"]
    except (ValueError, TypeError, KeyError):
        return RewardResult(
            score=0.0,
            components={"correct": 0.0, "answer_found": 0.0},
            error=f"answer is not a reasoning-gym payload: {answer[:80]!r}",
        )
    from reasoning_gym.utils import extract_answer  # noqa: PLC0415

    extracted = extract_answer(response_text)
    if extracted is None:
        return RewardResult(score=0.0, components={"correct": 0.0, "answer_found": 0.0})
    score = float(_score_fn(dataset)(answer=extracted, entry=entry))
    if not math.isfinite(score):
        return RewardResult(
            score=0.0,
            components={"correct": 0.0, "answer_found": 1.0},
            error=f"reasoning-gym {dataset!r} verifier returned {score}",
        )
    return RewardResult(
        score=score, components={"correct": float(score >= 1.0), "answer_found": 1.0}
    )
