"""A dense toy reward for plumbing runs on random-init models.

A tiny random model never answers arithmetic correctly, so the Math-Verify reward
is 0 for every sample and GRPO has nothing to learn from. ``uppercase_fraction``
(the share of the response's letters that are upper case) varies between samples
of a random model from the start — its responses are random word pieces, some
capitalised — and RL can raise it by preferring capitalised pieces, so a smoke
run shows a learning signal. It is not a task anyone should train a real model on.
"""

from __future__ import annotations

from jaxflash.rewards.base import RewardResult, register


@register("uppercase_fraction")
def uppercase_fraction_reward(response_text: str, answer: str) -> RewardResult:
    """Share of the response's alphabetic characters that are upper case, in [0, 1].

    Args:
      response_text: the response only (never the prompt).
      answer: ignored.

    Returns:
      RewardResult with score in [0, 1]; 0.0 for a response without letters.
    """
    del answer
    letters = [c for c in response_text if c.isalpha()]
    if not letters:
        return RewardResult(score=0.0, components={"uppercase_fraction": 0.0})
    frac = sum(c.isupper() for c in letters) / len(letters)
    return RewardResult(score=frac, components={"uppercase_fraction": frac})
