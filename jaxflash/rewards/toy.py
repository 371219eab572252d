"""A dense toy reward for plumbing runs on random-init models.

A tiny random model never answers arithmetic correctly, so the Math-Verify reward
is 0 for every sample and GRPO has nothing to learn from. ``digit_fraction``
(the share of non-space response characters that are ASCII digits) varies
between samples from the start and can be raised by RL, so a smoke run shows a
learning signal. It is not a task anyone should train a real model on.
"""

from __future__ import annotations

from jaxflash.rewards.base import RewardResult, register


@register("digit_fraction")
def digit_fraction_reward(response_text: str, answer: str) -> RewardResult:
    """Share of non-whitespace characters of the response that are digits, in [0, 1].

    Args:
      response_text: the response only (never the prompt).
      answer: ignored.

    Returns:
      RewardResult with score in [0, 1]; 0.0 for an empty response.
    """
    del answer
    chars = [c for c in response_text if not c.isspace()]
    if not chars:
        return RewardResult(score=0.0, components={"digit_fraction": 0.0})
    frac = sum(c in "0123456789" for c in chars) / len(chars)
    return RewardResult(score=frac, components={"digit_fraction": frac})
