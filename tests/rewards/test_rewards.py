"""Rewards: Math-Verify answer reward (extract once), format reward, registry, combined."""

import pickle
import threading

import pytest

from jaxflash.rewards import (
    REWARD_FNS,
    FormatReward,
    RewardResult,
    combined,
    get_reward_fn,
    math_answer_reward,
    register,
)


@pytest.mark.parametrize(
    "response, label, expected",
    [
        # rl_pitfalls.md "Extract once": boxed vs plain label, and the extracted value again.
        ("... so the answer is \\boxed{5}", "5", 1.0),
        ("5", "5", 1.0),
        ("\\boxed{5}", "\\boxed{5}", 1.0),
        ("The answer is 7.", "7", 1.0),
        ("The answer is 7.", "8", 0.0),
        ("7 is wrong; the answer is 12.", "12", 1.0),
        ("7 is wrong; the answer is 12.", "7", 0.0),
        ("I think 3, then 4, so it is 7", "7", 1.0),
        # A box wins over an earlier "answer is".
        ("The answer is 4. No wait: \\boxed{5}", "5", 1.0),
        # LaTeX labels are read whole, not cut at the first number.
        ("$\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
        ("so 0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{3\\sqrt{2}}", "3\\sqrt{2}", 1.0),
        ("\\boxed{3}", "3\\sqrt{2}", 0.0),
        ("\\boxed{\\frac{3}{4}}", "\\dfrac{3}{4}", 1.0),
        ("The answer is 1234.", "1,234", 1.0),
        ("-12", "-12", 1.0),
        ("12", "-12", 0.0),
        ("The total is 1024", "2^{10}", 1.0),
    ],
)
def test_math_reward(response, label, expected):
    result = math_answer_reward(response, label)
    assert result.score == expected
    assert result.components["correct"] == expected
    assert result.error is None


def test_math_reward_no_answer_and_bad_label():
    none = math_answer_reward("I do not know.", "5")
    assert none == RewardResult(score=0.0, components={"correct": 0.0, "answer_found": 0.0})
    bad = math_answer_reward("5", "   ")
    assert bad.score == 0.0 and bad.error == "could not parse reference answer '   '"
    with pytest.raises(TypeError, match="answer must be str"):
        math_answer_reward("5", 5)


def test_math_reward_works_off_the_main_thread():
    # Math-Verify's default timeouts use SIGALRM, which raises off the main thread.
    out = []
    thread = threading.Thread(target=lambda: out.append(math_answer_reward("\\boxed{9}", "9")))
    thread.start()
    thread.join()
    assert out[0].score == 1.0 and out[0].error is None


def test_format_reward_sees_the_response_only():
    # rl_pitfalls.md: the prompt asked for \boxed{}, the response did not use it.
    boxed, answer_is = REWARD_FNS["format_boxed"], REWARD_FNS["format_answer_is"]
    assert boxed("The answer is 7.", "7").score == 0.0
    assert answer_is("The answer is 7.", "7").score == 1.0
    assert boxed("so \\boxed{7}.", "7").score == 1.0
    assert boxed("so \\boxed{\\frac{1}{2}}", "0").score == 1.0  # nested braces
    assert boxed("\\boxed{ }", "7").score == 0.0  # empty box
    assert boxed("\\boxed{7", "7").score == 0.0  # unclosed box
    assert answer_is("Answer: 42", "1").score == 1.0
    assert answer_is("I have no answer.", "1").score == 0.0
    both = REWARD_FNS["format_any"]("The answer is \\boxed{3}", "3")
    assert both == RewardResult(score=1.0, components={"boxed": 1.0, "answer_is": 1.0})
    with pytest.raises(ValueError, match="unknown forms"):
        FormatReward(forms=("latex",))


@pytest.mark.parametrize(
    "response, expected",
    [("\\boxed{5}", 1.5), ("The answer is 5.", 1.0), ("\\boxed{4}", 0.5), ("no", 0.0)],
)
def test_combined(response, expected):
    fn = combined({"math": 1.0, "format_boxed": 0.5})
    result = fn(response, "5")
    assert result.score == expected
    assert set(result.components) == {
        "math",
        "math/correct",
        "math/answer_found",
        "format_boxed",
        "format_boxed/boxed",
    }
    # Picklable, so it can run in reward-pool workers.
    assert pickle.loads(pickle.dumps(fn))(response, "5") == result


def test_combined_reports_part_errors():
    result = combined({"math": 2.0, "format_boxed": 1.0})("\\boxed{5}", "")
    assert result.score == 1.0
    assert result.error == "math: could not parse reference answer ''"


def test_registry_and_validation():
    assert {"math", "format_boxed", "format_answer_is", "format_any"} <= set(REWARD_FNS)
    assert get_reward_fn("math") is math_answer_reward
    with pytest.raises(KeyError, match="nope"):
        get_reward_fn("nope")
    with pytest.raises(KeyError, match="nope"):
        combined({"math": 1.0, "nope": 1.0})
    with pytest.raises(ValueError, match="empty"):
        combined({})
    with pytest.raises(ValueError, match="finite"):
        combined({"math": float("nan")})
    with pytest.raises(ValueError, match="already registered"):
        register("math")(math_answer_reward)
    with pytest.raises(ValueError, match="finite"):
        RewardResult(score=float("inf"))
    with pytest.raises(TypeError, match="score"):
        RewardResult(score=True)


# --------------------------------------------------------------- numeric precision
# (label, response, expected): Math-Verify's default 6-decimal rounding says 1 for
# the first two; exact answers stay exact; decimals get a stated tolerance.
NUMERIC_CASES = [
    (r"\frac{1}{2^{99}}", r"\boxed{\frac{1}{2^{98}}}", 0.0),
    ("0.0000001", r"\boxed{0.0000002}", 0.0),
    (r"\frac{1}{2^{99}}", r"\boxed{\frac{1}{2^{99}}}", 1.0),
    ("0.0000001", r"\boxed{0.0000001}", 1.0),
    (r"\frac{1}{2}", r"\boxed{0.5}", 1.0),
    ("0.5", r"\boxed{\frac{1}{2}}", 1.0),
    (r"\frac{1}{\sqrt{2}}", r"\boxed{\sqrt{2}/2}", 1.0),
    (r"\frac{1}{3}", r"\boxed{0.3333333}", 1.0),  # within rel_tol 1e-6
    (r"\frac{1}{3}", r"\boxed{0.3333}", 0.0),
    (r"\pi", r"\boxed{3.14159265}", 1.0),
    (r"\pi", r"\boxed{3.14}", 0.0),
    ("1234567", r"\boxed{1234567.5}", 0.0),  # integers match exactly
    ("1000001", r"\boxed{1000000}", 0.0),
    # scientific notation, in the response and in the label
    (r"1.5\times 10^{-7}", r"\boxed{1.5e-7}", 1.0),
    ("0.00000015", r"\boxed{1.5e-7}", 1.0),
    ("0.00000015", r"\boxed{1.6e-7}", 0.0),
    ("6.02e23", r"\boxed{6.02\times10^{23}}", 1.0),
    ("6.02e23", r"\boxed{6.03\times10^{23}}", 0.0),
    ("0.001", "The answer is 1e-3", 1.0),
    ("100000", r"\boxed{1E5}", 1.0),
    # several boxes: one set of the distinct boxed values
    ("3", r"\boxed{3} so the answer is \boxed{3}", 1.0),
    ("3", r"\boxed{2} or \boxed{3}", 0.0),
    ("2, 3", r"\boxed{2} or \boxed{3}", 1.0),
]


@pytest.mark.parametrize(("label", "response", "expected"), NUMERIC_CASES)
def test_math_reward_numeric_precision(label, response, expected):
    assert math_answer_reward(response, label).score == expected


def test_math_reward_tolerance_is_settable_and_checked():
    from jaxflash.rewards.math_reward import MathAnswerReward

    loose = MathAnswerReward(rel_tol=1e-3)
    assert loose(r"\boxed{3.1416}", r"\pi").score == 1.0
    assert math_answer_reward(r"\boxed{3.1416}", r"\pi").score == 0.0
    assert MathAnswerReward(abs_tol=1e-6)(r"\boxed{0.0000002}", "0.0000001").score == 1.0
    assert pickle.loads(pickle.dumps(loose)) == loose
    with pytest.raises(ValueError, match="rel_tol"):
        MathAnswerReward(rel_tol=-1.0)


def test_scientific_notation_is_rewritten_exactly():
    from jaxflash.rewards.math_reward import normalize_scientific

    assert normalize_scientific("1.5e-7, 6.02E+23, x2e3, e5, 1e999") == (
        "0.00000015, 602000000000000000000000, x2e3, e5, 1e999"
    )


# ------------------------------------ exact at every magnitude; no partial parses
# (label, response, expected). Math-Verify 0.9 chops a 50-digit difference (so
# 1/100! == 1/101!), rounds decimals to 15 places, strips \mathrm{e} as a unit
# (9\mathrm{e} == 9) and compares its fallback strings (\frac{\mathrm{e}}{5} ==
# \frac{\mathrm{e}}{4} as the fragment "\frac{").
EXACT_CASES = [
    # tiny exact values
    (r"\frac{1}{101!}", r"\boxed{\frac{1}{100!}}", 0.0),
    (r"\frac{1}{100!}", r"\boxed{\frac{1}{100!}}", 1.0),
    (r"10^{-61}", r"\boxed{10^{-60}}", 0.0),
    (r"\frac{1}{3^{200}}", r"\boxed{3^{-200}}", 1.0),
    (r"\pi", r"\boxed{\pi + 10^{-70}}", 0.0),
    # huge exact values
    (r"10^{100}", r"\boxed{10^{100}+1}", 0.0),
    (r"2^{1000}", r"\boxed{2^{1000}}", 1.0),
    (r"100!", r"\boxed{100! + 1}", 0.0),
    # negative
    (r"-\frac{1}{101!}", r"\boxed{-\frac{1}{100!}}", 0.0),
    (r"-10^{100}", r"\boxed{-10^{100}-1}", 0.0),
    (r"-\frac{1}{2^{200}}", r"\boxed{-2^{-200}}", 1.0),
    # mixed exact / decimal, far from 1
    (r"1.5\times 10^{-400}", r"\boxed{1.6\times 10^{-400}}", 0.0),
    (r"1.5\times 10^{-400}", r"\boxed{\frac{3}{2} \cdot 10^{-400}}", 1.0),
    (r"10^{-400}", r"\boxed{1.0000001\times 10^{-400}}", 1.0),  # within rel_tol 1e-6
    (r"10^{-400}", r"\boxed{1.001\times 10^{-400}}", 0.0),
    ("0.0000000000000002", r"\boxed{0.0000000000000001}", 0.0),
    (r"\frac{1}{3}", r"\boxed{0.333333333333333333}", 1.0),
    (r"2.5\times 10^{300}", r"\boxed{25 \cdot 10^{299}}", 1.0),
    (r"2.5\times 10^{300}", r"\boxed{2.6\times 10^{300}}", 0.0),
    # exact elements of sets / tuples
    (r"\{\frac{1}{101!}, 2\}", r"\boxed{\{\frac{1}{100!}, 2\}}", 0.0),
    (r"(\frac{1}{100!}, 2)", r"\boxed{(\frac{1}{100!}, 2)}", 1.0),
    # symbolic equality still found
    (r"\frac{1}{\sqrt{2}}", r"\boxed{\frac{\sqrt{2}}{2}}", 1.0),
    (r"\sqrt{8}", r"\boxed{2\sqrt{2}}", 1.0),
    # upright constants are constants, real units stay units
    (r"\frac{\mathrm{e}}{4}", r"\boxed{\frac{\mathrm{e}}{5}}", 0.0),
    (r"\frac{\mathrm{e}}{4}", r"\boxed{\frac{e}{4}}", 1.0),
    ("9", r"\boxed{9\mathrm{e}}", 0.0),
    (r"9e", r"\boxed{9\mathrm{e}}", 1.0),
    (r"e^{2}", r"\boxed{\mathrm{e}^{2}}", 1.0),
    ("2", r"\boxed{2\,\mathrm{cm}}", 1.0),
    ("5", r"\boxed{5\mathrm{m}}", 1.0),
    ("9", r"\boxed{9\%}", 1.0),  # Math-Verify's percentage rule is kept
]


@pytest.mark.parametrize(("label", "response", "expected"), EXACT_CASES)
def test_math_reward_exact_at_every_magnitude_and_no_partial_parse(label, response, expected):
    assert math_answer_reward(response, label).score == expected


def test_math_reward_failed_parse_never_matches():
    import sympy

    from jaxflash.rewards.math_reward import answers_match

    # Math-Verify's fallback when LaTeX conversion fails: the extracted string only.
    assert not answers_match(["\\frac{"], ["\\frac{"], rel_tol=1e-6, abs_tol=0.0)
    two = sympy.Integer(2)
    assert answers_match([two, "2"], [two, "2"], rel_tol=1e-6, abs_tol=0.0)


@pytest.mark.parametrize(
    "response, label, score",
    [
        (" 0+63", "63", 0.0),  # what Gemma 3 270M learned in 10 steps: the question echoed
        (" 0+ 63.", "63", 0.0),
        ("\\boxed{70-7}", "63", 0.0),
        ("\\boxed{9 \\times 7}", "63", 0.0),
        ("\\boxed{9 \\cdot 7}", "63", 0.0),
        ("2^6-1", "63", 0.0),
        ("(60)+3", "63", 0.0),
        (" 0 - 63", "-63", 0.0),
        ("63", "63", 1.0),
        ("0 + 63 = 63", "63", 1.0),  # working shown, then the number
        ("-63", "-63", 1.0),
        ("\\boxed{\\frac{126}{2}}", "63", 1.0),  # a fraction is a number
        ("3/4", "0.75", 1.0),
        ("\\boxed{6.3 \\times 10^{1}}", "63", 1.0),  # scientific notation is a number
        ("\\boxed{3+4i}", "3+4i", 1.0),  # a label that is an expression: the plain rule
        ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),
        ("64", "23+41", 1.0),
    ],
)
def test_a_number_is_answered_with_a_number_not_the_question_restated(response, label, score):
    assert math_answer_reward(response, label).score == score


# Issue 31: the rule scored a power by its spelling (2^{10} vs 1024 -> 1, 2^6 vs 64 -> 0).
# Sums, differences and products score 0 in every spelling; powers, quotients, roots
# and scientific notation are ways to write one number and score by their value.
# (Unboxed, only plain text: Math-Verify reads LaTeX outside a box or $..$ as text.)
_PLAIN_ECHOES = ["0+63", "70-7", "70 − 7", "9*7", "9 × 7", "2^6-1", "2**6-1"]
ECHOES = [*_PLAIN_ECHOES, *(f"\\boxed{{{e}}}" for e in [*_PLAIN_ECHOES, "9 \\times 7",
          "9\\times{7}", "{9}\\cdot{7}", "2^{6}-1", "2^{3}\\cdot 8 - 1",
          "\\frac{2 \\cdot 63}{2}", "3^{2} \\cdot 7", "2^{3+3}-1"])]  # fmt: skip
SPELLINGS_OF_63 = ["63", "126/2", *(f"\\boxed{{{n}}}" for n in ["63", "126/2",
                   "\\frac{126}{2}", "126 \\div 2", "126 ÷ 2", "6.3 \\times 10^{1}",
                   "\\sqrt{3969}", "(63)", "{63}"])]  # fmt: skip


@pytest.mark.parametrize("echo", ECHOES)
def test_every_spelling_of_arithmetic_scores_0_against_a_plain_number(echo):
    assert math_answer_reward(echo, "63").score == 0.0


@pytest.mark.parametrize("number", SPELLINGS_OF_63)
def test_every_spelling_of_the_number_scores_1(number):
    assert math_answer_reward(number, "63").score == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        ("\\boxed{2^{10}}", "1024"),
        ("\\boxed{2^10}", "1024"),
        ("\\boxed{2^6}", "64"),  # the case: scored 0 while 2^{10} scored 1
        ("\\boxed{2^{6}}", "64"),
        ("\\boxed{2**6}", "64"),
        ("2**6", "64"),
        ("The answer is 2^6.", "64"),
        ("\\boxed{(-2)^6}", "64"),
        ("\\boxed{-2^{6}}", "-64"),
        ("\\boxed{4^3}", "64"),
        ("\\boxed{2^{-1}}", "0.5"),
        ("\\boxed{64/1}", "64"),
        ("\\boxed{\\sqrt{4096}}", "64"),
        ("\\boxed{9\\%}", "9"),
        ("The answer is **64**.", "64"),  # Markdown bold is not a power
    ],
)
def test_a_power_quotient_or_root_is_a_number_whatever_its_spelling(response, label):
    assert math_answer_reward(response, label).score == 1.0
