"""Partial-credit reward for the digit-string tasks (``data.task=digits``).

``digit_match``: the share of answer positions the response gets right,
``sum_i [r_i == a_i] / max(len(a), len(r))`` over the response's characters with
whitespace removed (a tokenizer that joins words with spaces decodes "4 1 3").
Extra characters lower the score (the denominator grows), missing ones count as
wrong, so only the exact answer scores 1.0. A random policy over ``n`` symbols
scores about 1 / n, and each position learned adds 1 / len(a): a dense signal
for a model learning from scratch.
"""

from __future__ import annotations

from jaxflash.rewards.base import RewardResult, register


@register("digit_match")
def digit_match_reward(response_text: str, answer: str) -> RewardResult:
    """Fraction of positions of ``answer`` matched by the response, in [0, 1].

    Args:
      response_text: the response only; whitespace is ignored.
      answer: the reference string (e.g. "413"); must be non-empty.

    Returns:
      RewardResult(score, components={"digit_match", "exact"}); an empty
      reference gives score 0.0 with an ``error``.
    """
    ref = "".join(answer.split())
    if not ref:
        return RewardResult(score=0.0, error="empty reference answer")
    got = "".join(response_text.split())
    hits = sum(a == b for a, b in zip(ref, got, strict=False))
    score = hits / max(len(ref), len(got))
    exact = float(got == ref)
    return RewardResult(score=score, components={"digit_match": score, "exact": exact})
