"""Math answer correctness on Math-Verify (huggingface/Math-Verify).

Extract once: the response's final answer is extracted a single time (a
``\\boxed{}`` first, then "the answer is N" / "Answer: N", then the last
number or LaTeX expression), and the reference label is parsed a single time
as a *plain* answer (a label "5" needs no box; a label "\\frac{1}{2}" or
"3\\sqrt{2}" is read as LaTeX). So grading "... so the answer is \\boxed{5}"
against "5" and grading the already-extracted "5" against "5" both give 1.0.

Math-Verify's own timeouts use SIGALRM, which raises off the main thread; they
are disabled here (``parsing_timeout=None``, ``timeout_seconds=None``) and
deadlines are enforced by `jaxflash.runtime.reward_pool` instead (it kills a
worker process that runs past its deadline).
"""

from __future__ import annotations

import functools
import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from jaxflash.rewards.base import RewardResult, register

# A boxed answer wins over "the answer is" patterns (priority 0 = matched first);
# without a box Math-Verify takes the answer-anchored match, else the last expression.
RESPONSE_EXTRACTION = (
    LatexExtractionConfig(boxed_match_priority=0),
    ExprExtractionConfig(),
)
# The label is wrapped in $...$ and read as LaTeX (covers "5", "-12", "1,234",
# "\\frac{1}{2}", "\\dfrac{3}{4}", "3\\sqrt{2}", "2^{10}", "x=3"); plain-expression
# parsing of the raw label is the fallback.
_LABEL_LATEX = (LatexExtractionConfig(boxed_match_priority=0),)
_LABEL_EXPR = (ExprExtractionConfig(),)


class _DropTimeoutDisabledWarning(logging.Filter):
    """Math-Verify warns once per process that its timeout is off; that is on purpose here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def extract_answer(response_text: str) -> list:
    """Extract and parse the final answer of a response (Math-Verify objects).

    Args:
      response_text: the model's response (never the prompt).

    Returns:
      Math-Verify's parse: [sympy object, extracted string] or [] if no answer.
    """
    return parse(
        response_text, list(RESPONSE_EXTRACTION), parsing_timeout=None, raise_on_error=False
    )


@functools.lru_cache(maxsize=8192)
def parse_label(answer: str) -> tuple:
    """Parse a reference label once, as a plain answer (no box needed).

    Cached: the G samples of a group (and every epoch) share one parse.

    Args:
      answer: the reference answer, e.g. "5", "\\frac{1}{2}", "\\boxed{5}".

    Returns:
      Math-Verify's parse as a tuple; () if the label cannot be parsed.
    """
    text = answer.strip()
    if not text:
        return ()
    # A label that already carries its own delimiters or box is parsed as given.
    wrapped = text if ("$" in text or "\\boxed" in text) else f"${text}$"
    gold = parse(wrapped, list(_LABEL_LATEX), parsing_timeout=None, raise_on_error=False)
    if not gold:
        gold = parse(text, list(_LABEL_EXPR), parsing_timeout=None, raise_on_error=False)
    return tuple(gold)


@register("math")
def math_answer_reward(response_text: str, answer: str) -> RewardResult:
    """1.0 if the response's final answer equals the reference, else 0.0.

    Args:
      response_text: the model's response only.
      answer: the reference answer label.

    Returns:
      RewardResult with components {"correct", "answer_found"}; error set only
      when the *label* cannot be parsed (a data problem, not a wrong answer).

    Raises:
      TypeError: response_text or answer is not a str.

    References:
      Math-Verify, https://github.com/huggingface/Math-Verify (parse / verify).
    """
    if not isinstance(response_text, str):
        raise TypeError(f"response_text must be str, got {type(response_text).__name__}")
    if not isinstance(answer, str):
        raise TypeError(f"answer must be str, got {type(answer).__name__}")
    gold = parse_label(answer)
    if not gold:
        return RewardResult(
            score=0.0,
            components={"correct": 0.0, "answer_found": 0.0},
            error=f"could not parse reference answer {answer!r}",
        )
    pred = extract_answer(response_text)
    if not pred:
        return RewardResult(score=0.0, components={"correct": 0.0, "answer_found": 0.0})
    correct = verify(list(gold), pred, timeout_seconds=None, raise_on_error=False)
    score = 1.0 if correct else 0.0
    return RewardResult(score=score, components={"correct": score, "answer_found": 1.0})
