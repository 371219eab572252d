"""Reward functions with faults, importable by reward worker processes."""

import hashlib
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


CHAOS_HANG_RATE = 0.125
"""Share of responses ``chaos_reward`` hangs on (decided by the response's hash)."""


def chaos_hangs(response_text: str) -> bool:
    """Whether ``chaos_reward`` hangs on this response (the same in every process)."""
    digest = hashlib.sha256(response_text.encode()).digest()
    return int.from_bytes(digest[:4], "big") < CHAOS_HANG_RATE * 2**32


def chaos_reward(response_text: str, answer: str) -> RewardResult:
    """Hangs on a fixed share of responses (``chaos_hangs``), else scores like
    ``uppercase_fraction``'s idea: the fraction of upper-case characters."""
    del answer
    if chaos_hangs(response_text):
        time.sleep(3600)
    upper = sum(c.isupper() for c in response_text)
    return RewardResult(score=upper / max(len(response_text), 1), components={})
