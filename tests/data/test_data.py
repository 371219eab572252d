"""Data: procedural arithmetic, JSONL/Parquet rows, PromptSource with a fake tokenizer."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxflash.data.arithmetic import DEFAULT_TEMPLATE, ArithmeticTask, evaluate
from jaxflash.data.files import DatasetError, RowFailure, load_rows
from jaxflash.data.prompts import PromptFailure, PromptSource
from jaxflash.types import FailureReason, Prompt

# ------------------------------------------------------------------ arithmetic


def _expr(prompt: str) -> str:
    return re.fullmatch(r"What is (.*)\? Answer with just the number\.", prompt).group(1)


def test_evaluate_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([10, 2, 3], ["-", "-"]) == 5
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate([7, 0], ["*"]) == 0


def test_rows_are_deterministic_and_correct():
    task = ArithmeticTask(0)
    assert DEFAULT_TEMPLATE == "What is {expr}? Answer with just the number."
    # Pinned so an accidental change of the random stream shows up (2 + 3 = 5 by hand).
    assert task.row(0) == {"prompt": "What is 2 + 3? Answer with just the number.", "answer": "5"}
    rows = [task.row(i) for i in range(200)]
    assert rows == [ArithmeticTask(0).row(i) for i in range(200)]  # fresh instance, same rows
    assert rows[::-1] == [task.row(i) for i in reversed(range(200))]  # order-free
    assert rows != [ArithmeticTask(1).row(i) for i in range(200)]
    for row in rows:
        expr = _expr(row["prompt"])
        assert re.fullmatch(r"\d( [-+*] \d)", expr), expr  # 2 one-digit operands
        assert str(eval(expr)) == row["answer"]  # independent evaluator (Python's)
        assert int(row["answer"]) >= 0  # allow_negative=False


def test_knobs():
    task = ArithmeticTask(
        5, min_operands=3, max_operands=4, min_digits=2, max_digits=3, ops="-", allow_negative=True
    )
    answers, counts = [], set()
    for i in range(100):
        expr = _expr(task.row(i)["prompt"])
        operands = [int(x) for x in expr.split(" - ")]
        counts.add(len(operands))
        assert all(10 <= x <= 999 for x in operands), expr
        answers.append(int(task.row(i)["answer"]))
        assert answers[-1] == operands[0] - sum(operands[1:])
    assert counts == {3, 4}
    assert min(answers) < 0
    custom = ArithmeticTask(0, template="Compute {expr}.", ops="*").row(3)["prompt"]
    assert re.fullmatch(r"Compute \d \* \d\.", custom)


def test_train_and_eval_never_overlap():
    # The whole space of one-digit additions is 100 problems: exhaust it.
    knobs = dict(ops="+", max_digits=1)
    train = {ArithmeticTask(0, **knobs).row(i)["prompt"] for i in range(3000)}
    held = {ArithmeticTask(0, split="eval", **knobs).row(i)["prompt"] for i in range(1000)}
    assert train.isdisjoint(held)
    assert len(train | held) == 100
    assert 1 <= len(held) <= 25
    # Same for a larger space, and across different seeds of the two splits.
    knobs = dict(max_operands=3, max_digits=2)
    train = {ArithmeticTask(1, **knobs).row(i)["prompt"] for i in range(500)}
    held = {ArithmeticTask(2, split="eval", **knobs).row(i)["prompt"] for i in range(500)}
    assert train.isdisjoint(held) and len(held) > 400


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_operands=1), "min_operands"),
        (dict(min_operands=3, max_operands=2), "max_operands=2"),
        (dict(max_digits=0), "min_digits"),
        (dict(ops="+/"), "ops"),
        (dict(template="no field"), "template"),
        (dict(split="test"), "split"),
        (dict(eval_fraction=1.0), "eval_fraction"),
    ],
)
def test_arithmetic_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(0, **kwargs)


def test_arithmetic_bad_index():
    with pytest.raises(ValueError, match="-1"):
        ArithmeticTask(0).row(-1)


# ----------------------------------------------------------------------- files


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_jsonl_with_aliases_and_gsm8k_marker(tmp_path):
    path = _write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            json.dumps({"question": "Q1?", "answer": "1 + 1 = 2\n#### 2"}),
            "",
            json.dumps({"question": "Q2?", "answer": "so #### 1,000"}),
        ],
    )
    rows = load_rows(path, prompt_key="question", answer_marker="####")
    assert rows == [
        {"prompt": "Q1?", "answer": "2", "meta": {"source": str(path), "line": 1}},
        {"prompt": "Q2?", "answer": "1,000", "meta": {"source": str(path), "line": 3}},
    ]


def test_numeric_answers_are_read_as_text(tmp_path):
    # {"answer": 4} is common in real data; verifiers compare text ("4" == "4.0" is
    # theirs to decide), a bool is not a label.
    rows = [{"prompt": "3+1?", "answer": 4}, {"prompt": "half?", "answer": 0.5}]
    path = _write_jsonl(tmp_path / "num.jsonl", [json.dumps(r) for r in rows])
    assert [r["answer"] for r in load_rows(path)] == ["4", "0.5"]
    path = _write_jsonl(tmp_path / "bool.jsonl", [json.dumps({"prompt": "p", "answer": True})])
    with pytest.raises(DatasetError, match="must be a string, got bool"):
        load_rows(path)


def test_load_parquet_and_nested_keys(tmp_path):
    path = tmp_path / "dapo.parquet"
    table = pa.table(
        {"q": ["A?", "B?"], "reward_model": [{"ground_truth": "3"}, {"ground_truth": "4"}]}
    )
    pq.write_table(table, path)
    rows = load_rows(path, prompt_key="q", answer_key="reward_model.ground_truth")
    assert [(r["prompt"], r["answer"], r["meta"]["line"]) for r in rows] == [
        ("A?", "3", 1),
        ("B?", "4", 2),
    ]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "x", "answer": ', "bad_line.jsonl:2: bad JSON"),
        ('{"prompt": "x"}', "bad_line.jsonl:2: missing key 'answer'"),
        (
            '{"prompt": "x", "answer": [5]}',
            "bad_line.jsonl:2: 'answer' (the answer) must be a string, got list",
        ),
        (
            '{"prompt": 7, "answer": "5"}',
            "bad_line.jsonl:2: 'prompt' (the prompt) must be a string, got int",
        ),
        ("[1, 2]", "bad_line.jsonl:2: row is a list"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"prompt": "p", "answer": "1"})
    path = _write_jsonl(tmp_path / "bad_line.jsonl", [good, bad_line, good])
    with pytest.raises(DatasetError, match=re.escape(message)):
        load_rows(path)
    rows = load_rows(path, on_error="skip")
    assert [type(r).__name__ for r in rows] == ["dict", "RowFailure", "dict"]
    assert rows[1].line == 2 and str(rows[1]).startswith(f"{path}:2: ")


def test_parquet_malformed_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", None]}), path)
    with pytest.raises(DatasetError, match=r"bad\.parquet:2: 'answer' .* got NoneType"):
        load_rows(path)


def test_load_rows_bad_path(tmp_path):
    with pytest.raises(ValueError, match="unknown format"):
        load_rows(tmp_path / "rows.csv")
    with pytest.raises(FileNotFoundError):
        load_rows(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------- prompts


class FakeTokenizer:
    """Chat template "<s>{system}|<u>{user}|<a>"; one token per character (its code point)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, *, tokenize=False):
        assert add_generation_prompt
        tags = {"system": "<s>", "user": "<u>"}
        text = "".join(f"{tags[m['role']]}{m['content']}|" for m in messages) + "<a>"
        return self.encode(text) if tokenize else text

    def encode(self, text):
        return [ord(c) for c in text]


class IdsTokenizer(FakeTokenizer):
    """Like transformers 5: apply_chat_template(tokenize=True) returns a dict with input_ids."""

    def apply_chat_template(self, messages, add_generation_prompt=True, *, tokenize=False):
        out = super().apply_chat_template(messages, add_generation_prompt, tokenize=tokenize)
        return {"input_ids": out, "attention_mask": [1] * len(out)} if tokenize else out


def test_prompt_source_renders_and_counts_failures():
    rows = [
        {"prompt": "hi", "answer": "1", "meta": {"line": 1}},
        {"prompt": "x" * 40, "answer": "2"},
        RowFailure(source="f.jsonl", line=3, reason="bad JSON"),
        {"prompt": "ok", "answer": 4},
        {"prompt": " \n", "answer": "5"},  # a new-user trial: trained as if it were a prompt
    ]
    out = list(PromptSource(rows, FakeTokenizer(), max_prompt_tokens=30))
    assert isinstance(out[0], Prompt)
    assert out[0].prompt_id == 0 and out[0].text == "hi" and out[0].answer == "1"
    # "<u>hi|<a>" -> code points, int32.
    np.testing.assert_array_equal(
        out[0].prompt_tokens, np.array([60, 117, 62, 104, 105, 124, 60, 97, 62], np.int32)
    )
    assert out[0].prompt_tokens.dtype == np.int32 and out[0].meta == {"line": 1}
    assert out[1] == PromptFailure(
        prompt_id=1,
        reason="prompt 1 is 47 tokens, longer than max_prompt_tokens=30",
        failure=FailureReason.PROMPT_TOO_LONG,
        meta={"prompt_tokens": 47},
    )
    assert out[2] == PromptFailure(
        prompt_id=2,
        reason="prompt 2: malformed row: f.jsonl:3: bad JSON",
        failure=FailureReason.MALFORMED_ROW,
        meta={"source": "f.jsonl", "line": 3},
    )
    assert out[3].prompt_id == 3 and "'answer' must be a string, got int" in out[3].reason
    assert out[3].failure == FailureReason.MALFORMED_ROW
    assert "malformed row: 'prompt' is empty" in out[4].reason
    assert out[4].failure == FailureReason.MALFORMED_ROW


def test_prompt_source_cursor_resume_and_cycle():
    rows = [{"prompt": str(i), "answer": str(i)} for i in range(5)]
    src = PromptSource(rows, FakeTokenizer(), max_prompt_tokens=100)
    first = src.take(2)
    assert src.cursor == 2 and [p.prompt_id for p in first] == [0, 1]
    resumed = PromptSource(rows, FakeTokenizer(), max_prompt_tokens=100, start=src.cursor)
    assert [p.text for p in resumed] == ["2", "3", "4"] and resumed.cursor == 5
    cyc = PromptSource(rows, FakeTokenizer(), max_prompt_tokens=100, start=4, cycle=True)
    assert [(p.prompt_id, p.text) for p in cyc.take(3)] == [(4, "4"), (5, "0"), (6, "1")]


def test_prompt_source_over_rows_fn_with_system_prompt():
    task = ArithmeticTask(0)
    src = PromptSource(task.row, IdsTokenizer(), max_prompt_tokens=200, start=7, system_prompt="S")
    prompt = next(src)
    assert prompt.prompt_id == 7 and prompt.answer == task.row(7)["answer"]
    expected = f"<s>S|<u>{task.row(7)['prompt']}|<a>"
    assert "".join(chr(t) for t in prompt.prompt_tokens) == expected


def test_prompt_source_validation():
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        PromptSource([], FakeTokenizer(), max_prompt_tokens=0)
    with pytest.raises(ValueError, match="start"):
        PromptSource([], FakeTokenizer(), max_prompt_tokens=5, start=-1)
    with pytest.raises(TypeError, match="rows"):
        PromptSource(3, FakeTokenizer(), max_prompt_tokens=5)


@pytest.mark.slow
def test_prompt_source_with_the_real_smollm2_tokenizer():
    from jaxflash.models.formats.weights_gguf import smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    prompt = next(PromptSource(ArithmeticTask(0).row, tok, max_prompt_tokens=64))
    assert tok.decode(prompt.prompt_tokens).endswith(
        "<|im_start|>user\nWhat is 2 + 3? Answer with just the number.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.prompt_tokens[0] == 1  # <|im_start|>, no BOS
    failure = next(PromptSource(ArithmeticTask(0).row, tok, max_prompt_tokens=10))
    assert failure.reason.startswith("prompt 0 is ") and "max_prompt_tokens=10" in failure.reason
