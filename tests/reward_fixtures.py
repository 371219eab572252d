"""Reward functions with faults, importable by reward worker processes."""

import time

from jaxflash.rewards.base import RewardResult


def flaky_reward(response_text: str, answer: str) -> RewardResult:
    """Raises for answer "raise", hangs for answer "hang", else scores 1 for a non-empty answer."""
    if answer == "raise":
        raise RuntimeError("reward backend exploded")
    if answer == "hang":
        time.sleep(3600)
    return RewardResult(score=float(len(response_text) % 2), components={})


def quarter_reward(response_text: str, answer: str) -> RewardResult:
    """0.25 for every response, with no "correct" component (a custom reward)."""
    return RewardResult(score=0.25, components={"quarter": 0.25})
