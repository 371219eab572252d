"""Math answer correctness on Math-Verify (huggingface/Math-Verify), with stated precision.

Extract once: the response's final answer is extracted a single time (a
``\\boxed{}`` first, then "the answer is N" / "Answer: N", then the last
number or LaTeX expression), and the reference label is parsed a single time
as a *plain* answer (a label "5" needs no box; a label "\\frac{1}{2}" or
"3\\sqrt{2}" is read as LaTeX). So grading "... so the answer is \\boxed{5}"
against "5" and grading the already-extracted "5" against "5" both give 1.0.

Comparison precision (Math-Verify's defaults round floats to 6 decimals and
evaluate differences to 15 digits with ``chop``, so ``1/2^98`` equals
``1/2^99`` and ``0.0000001`` equals ``0.0000002``; both are wrong here):

1. **Exact first.** Math-Verify's comparison (strings, sets, intervals,
   relations, matrices, symbolic simplification) runs with floats kept to 15
   decimals and differences evaluated to 50 significant digits, so exact
   answers compare exactly: ``1/2^98`` vs ``1/2^99`` -> 0, ``0.5`` vs
   ``\\frac{1}{2}`` -> 1, ``\\sqrt{2}/2`` vs ``\\frac{1}{\\sqrt{2}}`` -> 1.
   Two numbers also match when equal with every decimal read as the exact
   number it denotes (``6.02\\times 10^{23}`` vs ``602000000000000000000000``).
2. **Tolerance only for inexact numbers.** When that fails, both answers are
   single real numbers, at least one is written as a decimal (a float) and
   neither is an integer, they match iff
   ``|a - b| <= max(rel_tol * max(|a|, |b|), abs_tol)``; defaults
   ``rel_tol=1e-6``, ``abs_tol=0`` (``MathAnswerReward`` sets others). So
   ``3.14159265`` vs ``\\pi`` -> 1, ``0.3333333`` vs ``1/3`` -> 1, ``3.14`` vs
   ``\\pi`` -> 0, ``0.0000002`` vs ``0.0000001`` -> 0, ``1234567.5`` vs
   ``1234567`` -> 0 (integers match exactly), and two exact numbers never get
   a tolerance.
3. **Exact at every magnitude.** Math-Verify decides two constant numbers by
   evaluating their difference to ``numeric_precision`` digits and chopping it,
   so ``\\frac{1}{100!}`` equalled ``\\frac{1}{101!}`` (and decimals were
   rounded to a fixed number of places). Its numeric leaf comparison
   (``math_verify.grader.sympy_numeric_eq``, used for plain numbers and for the
   elements of sets, tuples, intervals, relations and matrices) is replaced at
   import by ``numbers_equal``: decimals read as the exact numbers they denote,
   then the difference is decided exactly (rationals exactly; otherwise
   ``sympy.simplify`` of the difference, and only if sympy cannot decide, a
   relative comparison at 60 digits). Percentages keep Math-Verify's rule.
4. **A failed or partial parse never matches.** Math-Verify falls back to the
   extracted *string* when LaTeX conversion fails (``\\frac{\\mathrm{e}}{5}``
   gave the string ``\\frac{``, equal to the same fragment of another answer);
   an answer without a parsed expression scores 0, a label without one is a
   label error. Its unit stripping drops any trailing ``\\mathrm{..}`` /
   ``\\text{..}`` (``9\\mathrm{e}`` read as 9), so the upright constants
   ``\\mathrm{e}`` and ``\\mathrm{i}`` (also ``\\text{..}``,
   ``\\operatorname{..}``) are rewritten to ``e`` and ``i`` before parsing;
   real units stay units (``2\\,\\mathrm{cm}`` vs 2 -> 1).
5. **Scientific notation.** ``1.5e-7`` / ``6.02E23`` (which LaTeX parsing reads
   as ``1.5 * e - 7`` with Euler's e) is rewritten as the plain decimal it
   denotes (``0.00000015``, exactly, via ``decimal``) in both the response and
   the label before parsing; exponents beyond +-64 are left alone.
6. **A number is answered with a number.** When the label is a plain number
   (``63``, ``-2.5``, ``3/4``, ``\\frac{3}{4}``), an answer that adds, subtracts or
   multiplies numbers scores 0: Math-Verify evaluates it and says equal, so a policy
   learns to restate the question ("What is 0 + 63?" -> " 0+63"), which a 10-step run
   on Gemma 3 270M did (held-out accuracy 6 % -> 99.5 % with every answer an echo).
   The reward sees the response and the label, never the prompt (``rewards.base``),
   so the echo is known by its form, that of the arithmetic prompts: a sum, a
   difference or a product anywhere in the answer. It is read from Math-Verify's
   parse, which leaves the arithmetic unevaluated, so each operation is one node
   however it is typed: ``0+63``, ``70 − 7``, ``9*7``, ``9 \\times 7``,
   ``{9}\\cdot{7}``, ``2^6 - 1``, ``2^{3}\\cdot 8 - 1`` all score 0. A power
   (``2^6``, ``2^{6}``, ``2**6``), a quotient (``126/2``, ``\\frac{126}{2}``,
   ``126 \\div 2``), a root, a sign, a percentage and scientific notation
   (``6.3 \\times 10^{1}``) each write one number, as labels do (``2^{10}``,
   ``\\frac{1}{2}``), and score by their value: ``2^6`` vs 64 and ``2^{10}`` vs 1024
   both score 1 (a rule on the text scored ``2^6`` 0 and ``2^{10}`` 1). Labels that
   are themselves expressions (``3+4i``, ``2\\sqrt{3}``, ``\\frac{1}{2^{99}}``) keep
   the plain rule.

Several boxed answers: Math-Verify reads every ``\\boxed{}`` of the response
and joins the distinct ones into one set. The same value boxed twice counts
once (``\\boxed{3} ... \\boxed{3}`` vs "3" -> 1); different values form a set
that a single-valued label never equals (``\\boxed{2} or \\boxed{3}`` vs "3"
-> 0: hedging is not rewarded), while a label that is itself a set matches it
(vs "2, 3" -> 1).

Math-Verify's own timeouts use SIGALRM, which raises off the main thread; they
are disabled here (``parsing_timeout=None``, ``timeout_seconds=None``) and
deadlines are enforced by `jaxflash.runtime.rollout.reward_pool` instead (it kills a
worker process that runs past its deadline).
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import logging
import math
import re

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, grader, parse, verify

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
FLOAT_DECIMALS = 15  # Math-Verify float_rounding: floats compared at full double precision
EVAL_DIGITS = 50  # Math-Verify numeric_precision: digits of (a - b).evalf before chop
# 1.5e-7, 6.02E+23, .5e3 (not inside words or longer numbers).
# \mathrm{e} / \text{i} / \operatorname{e}: Euler's number and the imaginary unit.
_UPRIGHT_CONSTANT = re.compile(r"\\(?:mathrm|text|textrm|operatorname|rm)\s*\{\s*([ei])\s*\}")
EXACT_FALLBACK_DIGITS = 60  # relative comparison when sympy cannot decide a difference
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")


class _DropTimeoutDisabledWarning(logging.Filter):
    """Math-Verify warns once per process that its timeout is off; that is on purpose here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def normalize_scientific(text: str) -> str:
    """``1.5e-7`` -> ``0.00000015``, ``6.02E23`` -> ``602000000000000000000000``.

    LaTeX parsing reads the ``e`` of ``1.5e-7`` as Euler's number; the plain
    decimal parses the same in LaTeX and in plain text. Exact (``decimal``);
    exponents beyond +-64 are left as written.
    """

    def plain(m: re.Match) -> str:
        if abs(int(m.group(2))) > 64:
            return m.group(0)
        text = format(decimal.Decimal(m.group(0)), "f")
        return text.rstrip("0").rstrip(".") if "." in text else text

    return _SCIENTIFIC.sub(plain, text)


def normalize_constants(text: str) -> str:
    """``\\mathrm{e}`` -> ``e``, ``\\mathrm{i}`` -> ``i`` (also ``\\text``, ``\\operatorname``).

    Math-Verify 0.9 turns ``\\mathrm`` into ``\\text`` and strips a trailing
    ``\\text{..}`` as a unit, so ``9\\mathrm{e}`` would read as 9.
    """
    return _UPRIGHT_CONSTANT.sub(r"\1", text)


def _parsed(answer: list | tuple) -> bool:
    """A parse that holds an expression (not only Math-Verify's fallback string)."""
    return bool(answer) and isinstance(answer[0], sympy.Basic | sympy.MatrixBase)


def extract_answer(response_text: str) -> list:
    """Extract and parse the final answer of a response (Math-Verify objects).

    Args:
      response_text: the model's response (never the prompt).

    Returns:
      Math-Verify's parse: [sympy object, extracted string] or [] if no answer.
    """
    return parse(
        normalize_powers(normalize_constants(normalize_scientific(response_text))),
        list(RESPONSE_EXTRACTION),
        parsing_timeout=None,
        raise_on_error=False,
    )


@functools.lru_cache(maxsize=8192)
def parse_label(answer: str) -> tuple:
    """Parse a reference label once, as a plain answer (no box needed).

    Cached: the G samples of a group (and every epoch) share one parse.

    Args:
      answer: the reference answer, e.g. "5", "\\frac{1}{2}", "\\boxed{5}", "1.5e-7".

    Returns:
      Math-Verify's parse as a tuple; () if the label cannot be parsed.
    """
    text = normalize_constants(normalize_scientific(answer.strip()))
    if not text:
        return ()
    # A label that already carries its own delimiters or box is parsed as given.
    wrapped = text if ("$" in text or "\\boxed" in text) else f"${text}$"
    gold = parse(wrapped, list(_LABEL_LATEX), parsing_timeout=None, raise_on_error=False)
    if not gold:
        gold = parse(text, list(_LABEL_EXPR), parsing_timeout=None, raise_on_error=False)
    return tuple(gold)


def _real_number(x: object) -> sympy.Float | None:
    """x to 30 digits (a sympy Float: any exponent) if a constant real number, else None."""
    if not isinstance(x, sympy.Basic) or x.free_symbols:
        return None
    try:
        value = sympy.N(x, 30)
    except (TypeError, ValueError):
        return None
    if not (value.is_real and value.is_finite and value.is_Number):
        return None
    return value


def _as_written(x: sympy.Basic) -> sympy.Basic:
    """x with every float replaced by the exact decimal it prints as (0.3333333 -> 3333333/10^7)."""
    return x.xreplace({f: sympy.Rational(str(f)) for f in x.atoms(sympy.Float)})


def numbers_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Exact equality of two constant numbers, at every magnitude (module docstring, 3).

    Decimals count as the exact numbers they are written as. The difference is
    decided exactly where sympy can (rationals always; ``sympy.simplify`` of the
    difference otherwise); if sympy cannot say, the two agree iff
    ``|a - b| <= 10^-(EXACT_FALLBACK_DIGITS - 10) * max(|a|, |b|)`` at
    ``EXACT_FALLBACK_DIGITS`` digits (a relative test, so no magnitude is
    too small or too large).
    """
    a, b = _as_written(a.doit()), _as_written(b.doit())
    diff = a - b
    if diff.is_Rational:
        return diff == 0
    try:
        zero = sympy.simplify(diff).is_zero
    except (TypeError, ValueError, NotImplementedError):
        zero = None
    if zero is not None:
        return bool(zero)
    n = EXACT_FALLBACK_DIGITS
    d, scale = abs(sympy.N(diff, n)), max(abs(sympy.N(a, n)), abs(sympy.N(b, n)))
    return bool(d == 0 or d <= scale * sympy.Rational(10) ** -(n - 10))


def _numeric_eq(a, b, float_rounding: int, numeric_precision: int) -> bool:
    """Math-Verify's numeric leaf comparison, exact for constant numbers (not percentages)."""
    numbers = all(
        isinstance(x, sympy.Expr) and x.is_number and not x.has(sympy.UnevaluatedExpr)
        for x in (a, b)
    )
    if numbers:
        try:
            return numbers_equal(a, b)
        except Exception:  # sympy could not decide: never counted as a match
            return False
    return _MATH_VERIFY_NUMERIC_EQ(a, b, float_rounding, numeric_precision)


_MATH_VERIFY_NUMERIC_EQ = grader.sympy_numeric_eq
grader.sympy_numeric_eq = _numeric_eq  # looked up by name in grader.sympy_expr_eq


_PLAIN_NUMBER_LABEL = re.compile(
    r"^\s*-?\s*(?:\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?\s*$"
    r"|^\s*-?\s*\\[dt]?frac\s*\{\s*\d+\s*\}\s*\{\s*\d+\s*\}\s*$"
)
# Python's power operator between two operands (``2**6``, ``(2) ** 6``), as ``^`` (a LaTeX
# box does not parse ``**``). Unspaced or spaced on both sides: a Markdown bold marker
# (``**63**``) touches its text on one side only.
_PYTHON_POWER = re.compile(r"(?<=[\d)}])(?:\*\*|\s+\*\*\s+)(?=[\d({]|-\d)")


def normalize_powers(text: str) -> str:
    """``2**6`` -> ``2^6`` (``\\boxed{2**6}`` parses as LaTeX then, like ``2**6`` unboxed)."""
    return _PYTHON_POWER.sub("^", text)


def plain_number_label(answer: str) -> bool:
    """True if the label is a plain number: an integer, decimal or simple fraction."""
    return bool(_PLAIN_NUMBER_LABEL.match(normalize_scientific(answer.strip()).strip("$ ")))


def arithmetic_on_numbers(expr: object) -> bool:
    """True if an answer adds, subtracts or multiplies numbers (module docstring, 6).

    Read from the answer as Math-Verify parsed it, which keeps the arithmetic
    unevaluated (``9 \\times 7`` is ``Mul(9, 7)``), so every spelling of an operation
    is the same node: ``0+63``, ``70 − 7``, ``9*7``, ``{9}\\cdot{7}``, ``2^6-1``,
    ``2^{3+3}``, ``\\frac{2 \\cdot 63}{2}`` -> True; ``63``, ``-63``, ``2^6``,
    ``2^{6}``, ``2**6``, ``\\frac{126}{2}``, ``126/2``, ``126 \\div 2``,
    ``6.3 \\times 10^{1}``, ``\\sqrt{4096}``, ``63\\%`` -> False.

    Args:
      expr: the parsed answer (``extract_answer(...)[0]``); anything else is False.
    """
    if not isinstance(expr, sympy.Basic):
        return False
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Add) or (isinstance(node, sympy.Mul) and _is_product(node)):
            return True
    return False


def _is_product(mul: sympy.Mul) -> bool:
    """A Mul of two or more numbers, not one number written with a sign (``-1 * x``), a
    divisor (``x * y^-1``), a percent (``x * 1/100``, unevaluated) or as scientific
    notation (a number times a power of ten)."""
    factors = [
        f
        for f in mul.args
        if f != -1 and not (f.is_Pow and f.exp == -1) and not isinstance(f, sympy.UnevaluatedExpr)
    ]
    if len(factors) == 2:
        mantissa, power = sorted(factors, key=lambda f: f.is_Pow)
        if mantissa.is_Number and power.is_Pow and power.base == 10 and power.exp.is_Integer:
            return False
    return len(factors) >= 2


def answers_match(gold: list, pred: list, *, rel_tol: float, abs_tol: float) -> bool:
    """Exact comparison first, tolerance only for inexact numbers (module docstring).

    Args:
      gold, pred: Math-Verify parses ([sympy object, string]).
      rel_tol, abs_tol: tolerance of step 2.

    Returns:
      False when either side holds no parsed expression (a failed or partial
      parse: Math-Verify's string fallback), whatever the strings say.
    """
    if not (_parsed(gold) and _parsed(pred)):
        return False
    if verify(
        gold,
        pred,
        float_rounding=FLOAT_DECIMALS,
        numeric_precision=EVAL_DIGITS,
        timeout_seconds=None,
        raise_on_error=False,
    ):
        return True
    g, p = gold[0], pred[0]
    if not (isinstance(g, sympy.Basic) and isinstance(p, sympy.Basic)):
        return False
    if not (g.has(sympy.Float) or p.has(sympy.Float)):
        return False  # two exact numbers: exact equality only (step 1 said no)
    a, b = _real_number(g), _real_number(p)
    if a is None or b is None or g.is_Integer or p.is_Integer:
        return False  # an integer answer is only ever matched exactly
    return bool(abs(a - b) <= max(rel_tol * max(abs(a), abs(b)), abs_tol))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathAnswerReward:
    """1.0 if the response's final answer equals the reference, else 0.0.

    A class so the tolerance is stated, settable and picklable into reward
    workers; the registered "math" reward is ``MathAnswerReward()``.

    Attributes:
      rel_tol: relative tolerance for answers written as decimals (>= 0).
      abs_tol: absolute tolerance for them (>= 0; 0 = none, so tiny answers
        are not equal by rounding).

    Returns (when called with ``(response_text, answer)``):
      RewardResult with components {"correct", "answer_found"}; error set only
      when the *label* cannot be parsed (a data problem, not a wrong answer).

    Raises:
      TypeError: response_text or answer is not a str.
      ValueError: (at construction) a negative or non-finite tolerance.

    References:
      Math-Verify, https://github.com/huggingface/Math-Verify (parse / verify).
    """

    rel_tol: float = 1e-6
    abs_tol: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rel_tol", "abs_tol"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"MathAnswerReward.{name} must be a finite float >= 0, got {value!r}"
                )

    def __call__(self, response_text: str, answer: str) -> RewardResult:
        if not isinstance(response_text, str):
            raise TypeError(f"response_text must be str, got {type(response_text).__name__}")
        if not isinstance(answer, str):
            raise TypeError(f"answer must be str, got {type(answer).__name__}")
        gold = parse_label(answer)
        if not _parsed(gold):
            return RewardResult(
                score=0.0,
                components={"correct": 0.0, "answer_found": 0.0},
                error=f"could not parse reference answer {answer!r}",
            )
        pred = extract_answer(response_text)
        if not pred:
            return RewardResult(score=0.0, components={"correct": 0.0, "answer_found": 0.0})
        correct = answers_match(list(gold), pred, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        if correct and plain_number_label(answer) and arithmetic_on_numbers(pred[0]):
            correct = False  # the question restated, not answered (module docstring, 6)
        score = 1.0 if correct else 0.0
        return RewardResult(score=score, components={"correct": score, "answer_found": 1.0})


math_answer_reward = register("math")(MathAnswerReward())
