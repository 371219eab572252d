"""jaxflash.rewards: scoring responses (layer 1).

Importing the package fills the `REWARD_FNS` registry: "math" (answer
correctness on Math-Verify), "format_boxed", "format_answer_is", "format_any",
"reasoning_gym" (reasoning-gym's verifiers), "code" (the response's program run
against the task's tests in the bubblewrap sandbox, ``code_reward`` / ``sandbox``),
"uppercase_fraction" (a toy reward for smoke runs), "digit_match" (partial credit
for the digit-string tasks).
"""

from jaxflash.rewards import (  # noqa: F401  (fill the registry)
    code_reward,
    digits,
    format,
    math_reward,
    reasoning_gym_reward,
    toy,
)
from jaxflash.rewards.base import (
    REWARD_FNS,
    CombinedReward,
    RewardFn,
    RewardResult,
    as_reward_fn,
    combined,
    get_reward_fn,
    register,
)
from jaxflash.rewards.format import FormatReward
from jaxflash.rewards.math_reward import MathAnswerReward, math_answer_reward

__all__ = [
    "REWARD_FNS",
    "CombinedReward",
    "FormatReward",
    "MathAnswerReward",
    "RewardFn",
    "RewardResult",
    "as_reward_fn",
    "combined",
    "get_reward_fn",
    "math_answer_reward",
    "register",
]
