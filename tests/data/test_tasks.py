"""Tasks by name, shuffled file epochs, MATH-style files, reasoning-gym tasks and rewards."""

from __future__ import annotations

import json

import pytest

from jaxflash.data.epochs import EpochShuffledRows
from jaxflash.data.files import DatasetError, RowFailure
from jaxflash.data.prompts import PromptSource
from jaxflash.data.tasks import make_task, math_label, task_names, task_reward
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.rewards import get_reward_fn
from tests.chat_fixtures import build_checkpoint

# ------------------------------------------------------------------ epochs


def test_epochs_are_permutations_that_differ_and_resume_exactly():
    rows = [{"i": i} for i in range(10)]
    order = EpochShuffledRows(rows, seed=3)
    first = [order(c)["i"] for c in range(30)]
    for e in range(3):
        assert sorted(first[10 * e : 10 * e + 10]) == list(range(10))  # each row once per epoch
    assert first[:10] != first[10:20] != first[20:30]
    assert first[:10] != list(range(10))
    # A fresh object (a resumed run) at cursor 17 reads what the first would have read.
    again = EpochShuffledRows(rows, seed=3)
    assert [again(c)["i"] for c in range(17, 30)] == first[17:]
    assert [EpochShuffledRows(rows, seed=4)(c)["i"] for c in range(10)] != first[:10]
    assert [EpochShuffledRows(rows, seed=3, shuffle=False)(c)["i"] for c in range(12)] == [
        *range(10),
        0,
        1,
    ]
    with pytest.raises(ValueError, match="no rows"):
        EpochShuffledRows([], seed=0)


def test_file_task_holds_out_and_shuffles(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": f"q{i}", "a": str(i)}) + "\n" for i in range(50)))
    task = make_task("file", seed=1, eval_size=8, path=str(path), prompt_key="q", answer_key="a")
    assert [r["answer"] for r in task.eval_rows] == [str(i) for i in range(5)]  # 10 % cap
    epoch = [task.train(c)["answer"] for c in range(45)]
    assert sorted(epoch, key=int) == [str(i) for i in range(5, 50)] and epoch != sorted(
        epoch, key=int
    )
    kept = make_task(
        "file", seed=1, eval_size=8, path=str(path), prompt_key="q", answer_key="a", shuffle=False
    )
    assert [kept.train(c)["answer"] for c in range(3)] == ["5", "6", "7"]
    assert task.reward == "math"


# ------------------------------------------------------------------ MATH-style files


def test_math_file_labels_and_prompts(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [
        {"problem": "Compute 1/2 + 1/4.", "solution": "We add: $\\boxed{\\frac{3}{4}}$."},
        {"problem": "Two boxes.", "solution": "First \\boxed{1}, then \\boxed{2}."},
        {"problem": "Plain.", "solution": "42"},
        {"problem": "Empty.", "solution": "  "},
    ] + [{"problem": f"p{i}", "solution": f"\\boxed{{{i}}}"} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task("math_file", seed=0, eval_size=2, path=str(path), shuffle=False)
    assert [r["answer"] for r in task.eval_rows] == ["\\frac{3}{4}", "2"]
    assert task.eval_rows[0]["prompt"].endswith("put your final answer within \\boxed{}.")
    assert task.train(0)["answer"] == "42"
    failure = task.train(1)
    assert (
        isinstance(failure, RowFailure) and failure.line == 4 and "empty answer" in failure.reason
    )
    with pytest.raises(DatasetError, match=":4: empty answer"):
        make_task("math_file", seed=0, eval_size=2, path=str(path), on_error="raise")
    reward = get_reward_fn(task.reward)
    assert reward("so it is \\boxed{0.75}", task.eval_rows[0]["answer"]).score == 1.0
    assert math_label("no box") == "no box"


# ------------------------------------------------------------------ registry


def test_registry_names_and_errors(tmp_path):
    assert {"arithmetic", "file", "math_file", "countdown"} <= set(task_names())
    assert task_reward("countdown") == "reasoning_gym" and task_reward("file") == "math"
    with pytest.raises(ValueError, match="unknown task 'nope'.*arithmetic"):
        make_task("nope", seed=0, eval_size=1)
    with pytest.raises(ValueError, match="task 'arithmetic'.*unexpected keyword.*path"):
        make_task("arithmetic", seed=0, eval_size=1, path="x")
    arith = make_task("arithmetic", seed=0, eval_size=3, max_digits=2)
    assert len(arith.eval_rows) == 3 and arith.train(0) == make_task(
        "arithmetic", seed=0, eval_size=0, max_digits=2
    ).train(0)


# ------------------------------------------------------------------ reasoning-gym


@pytest.fixture
def rg():
    return pytest.importorskip("reasoning_gym", reason="reasoning-gym tasks need the package")


def test_countdown_rows_are_deterministic_disjoint_and_verified(rg):
    task = make_task("countdown", seed=5, eval_size=12)
    train = [task.train(i) for i in range(40)]
    assert train[7] == make_task("countdown", seed=5, eval_size=0).train(7)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in task.eval_rows})
    reward = get_reward_fn(task.reward)
    entry = json.loads(train[0]["answer"])["entry"]
    right = f"I think... <answer>{entry['answer']}</answer>"
    assert reward(right, train[0]["answer"]).score == 1.0
    wrong = reward("<answer>1 + 1</answer>", train[0]["answer"])
    assert wrong.score < 1.0 and wrong.components["correct"] == 0.0
    assert reward("no tags", train[0]["answer"]).components["answer_found"] == 0.0
    assert reward("x", "not json").error is not None


@pytest.mark.parametrize("dataset", ["chain_sum", "leg_counting", "spell_backward"])
def test_other_reasoning_gym_datasets_by_name(rg, dataset):
    task = make_task(f"reasoning_gym:{dataset}", seed=2, eval_size=2)
    row = task.train(0)
    entry = json.loads(row["answer"])["entry"]
    assert (
        get_reward_fn("reasoning_gym")(f"<answer>{entry['answer']}</answer>", row["answer"]).score
        == 1.0
    )
    assert "<answer></answer>" in row["prompt"]


def test_reasoning_gym_errors(rg):
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'nope'"):
        make_task("reasoning_gym:nope", seed=0, eval_size=1)
    with pytest.raises(ValueError, match="rejected config"):
        make_task("countdown", seed=0, eval_size=1, config={"min_numbers": 0})


# ------------------------------------------------------------------ prompts keep one BOS


def test_prompt_source_gives_one_bos_through_the_template(tmp_path):
    tok = Tokenizer.from_hf_dir(build_checkpoint("llama3", tmp_path))  # post-processor adds BOS
    (prompt,) = PromptSource([{"prompt": "hi", "answer": "1"}], tok, max_prompt_tokens=512)
    ids = prompt.prompt_tokens.tolist()
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids == tok.encode_chat([{"role": "user", "content": "hi"}])
