"""Format rewards: did the response state a final answer in the requested form?

Judged from the response text only. A prompt that says "put your final answer
in \\boxed{}" never earns the reward by itself: the response "The answer is 7."
scores 0 under the boxed form (and 1 under the "answer is" form).
"""

from __future__ import annotations

import dataclasses
import re

from jaxflash.rewards.base import RewardResult, register

FORMS = ("boxed", "answer_is")
"""Known answer forms: "boxed" = a non-empty \\boxed{...} (or \\fbox{...});
"answer_is" = "answer is X" / "answer: X" (case-insensitive, optional "final")."""

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(
    r"\banswer\b\s*(?:\*\*)?\s*(?:is\b|:|=)\s*(?:\*\*)?\s*[^\s.,;!?*]", re.IGNORECASE
)


def boxed_contents(text: str) -> list[str]:
    """Contents of every \\boxed{...} / \\fbox{...} with balanced braces, in order.

    Example: ``boxed_contents(r"so \\boxed{\\frac{1}{2}}")`` -> ``["\\frac{1}{2}"]``.
    """
    out = []
    for match in _BOX_OPEN.finditer(text):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    out.append(text[start:pos])
                    break
    return out


def has_boxed(text: str) -> bool:
    """True if `text` holds a \\boxed{...} with balanced braces and non-blank content."""
    return any(c.strip() for c in boxed_contents(text))


def has_answer_is(text: str) -> bool:
    """True if `text` says "answer is X" / "answer: X" with some X."""
    return _ANSWER_IS.search(text) is not None


_CHECKS = {"boxed": has_boxed, "answer_is": has_answer_is}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatReward:
    """1.0 if the response gives its final answer in any of `forms`, else 0.0.

    A class (not a closure) so that it pickles into reward-pool workers.

    Attributes:
      forms: subset of FORMS; components report each form separately.
    """

    forms: tuple[str, ...] = ("boxed",)

    def __post_init__(self) -> None:
        if not self.forms:
            raise ValueError("FormatReward.forms must not be empty")
        unknown = [f for f in self.forms if f not in _CHECKS]
        if unknown:
            raise ValueError(f"FormatReward.forms has unknown forms {unknown}; known: {FORMS}")
        object.__setattr__(self, "forms", tuple(self.forms))

    def __call__(self, response_text: str, answer: str) -> RewardResult:
        """Score a response; `answer` is unused (the format does not depend on it)."""
        del answer
        if not isinstance(response_text, str):
            raise TypeError(f"response_text must be str, got {type(response_text).__name__}")
        components = {f: 1.0 if _CHECKS[f](response_text) else 0.0 for f in self.forms}
        return RewardResult(score=max(components.values()), components=components)


register("format_boxed")(FormatReward(forms=("boxed",)))
register("format_answer_is")(FormatReward(forms=("answer_is",)))
register("format_any")(FormatReward(forms=FORMS))
