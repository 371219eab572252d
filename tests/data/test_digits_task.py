"""The digit-string task (``data.task=digits``) and its partial-credit reward."""

from __future__ import annotations

import pytest

from jaxflash.data.digits import DigitTask, apply_op
from jaxflash.data.tasks import make_task, task_reward
from jaxflash.rewards import get_reward_fn


def test_rows_are_deterministic_disjoint_and_answered():
    train = DigitTask(3, op="reverse", length=4)
    again = DigitTask(3, op="reverse", length=4)
    assert [train.row(i) for i in range(20)] == [again.row(i) for i in range(20)]
    row = train.row(0)
    op, *digits = row["prompt"].split()
    assert op == "reverse" and len(digits) == 4
    assert row["answer"] == "".join(reversed(digits))
    held_out = DigitTask(3, op="reverse", length=4, split="eval")
    train_keys = {train.row(i)["prompt"] for i in range(500)}
    eval_keys = {held_out.row(i)["prompt"] for i in range(100)}
    assert not train_keys & eval_keys
    other_seed = DigitTask(4, op="reverse", length=4)
    assert [other_seed.row(i) for i in range(20)] != [train.row(i) for i in range(20)]
    assert apply_op("sort", [3, 1, 2]) == [1, 2, 3]
    assert apply_op("copy", [3, 1, 2]) == [3, 1, 2]
    assert all(set(DigitTask(0, num_symbols=3).row(i)["answer"]) <= set("012") for i in range(50))


@pytest.mark.parametrize(
    "knobs, match",
    [
        (dict(op="shuffle"), "op"),
        (dict(length=0), "length"),
        (dict(num_symbols=11), "num_symbols"),
        (dict(num_symbols=2, length=2), "too few"),
        (dict(eval_fraction=1.0), "eval_fraction"),
    ],
)
def test_bad_knobs_are_named(knobs, match):
    with pytest.raises(ValueError, match=match):
        DigitTask(0, **knobs)
    with pytest.raises(ValueError, match="row index"):
        DigitTask(0).row(-1)


def test_registered_with_its_reward():
    task = make_task("digits", seed=0, eval_size=5, op="sort", length=3)
    assert task.reward == task_reward("digits") == "digit_match"
    assert len(task.eval_rows) == 5
    assert task.train(7)["answer"] == "".join(sorted(task.train(7)["prompt"].split()[1:]))
    with pytest.raises(ValueError, match="digits"):
        make_task("digits", seed=0, eval_size=1, width=3)


def test_digit_match_gives_partial_credit_by_position():
    reward = get_reward_fn("digit_match")
    assert reward("4 1 3", "413").score == 1.0
    assert reward("4 1 3", "413").components == {"digit_match": 1.0, "exact": 1.0}
    assert reward("4 0 3", "413").score == pytest.approx(2 / 3)
    assert reward("1 3 4", "413").score == 0.0  # right digits, wrong places
    assert reward("4 1", "413").score == pytest.approx(2 / 3)  # a missing position is wrong
    assert reward("4 1 3 3", "413").score == pytest.approx(3 / 4)  # extra ones cost too
    assert reward("", "413").score == 0.0
    assert reward("4 1 3", "413").error is None
    empty = reward("4", " ")
    assert empty.score == 0.0 and "empty" in empty.error
