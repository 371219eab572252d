"""Tasks built from the config, and prompt limits derived from (or checked against) the data."""

from __future__ import annotations

import json

import pytest

from configs import rlvr_smollm2_arith
from jaxflash.data.epochs import EpochShuffledRows
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.runtime.config.prompt_limits import prompt_lengths
from jaxflash.runtime.workloads.task_setup import (
    SAMPLE_ROWS,
    build_task,
    eval_prompts,
    measure_prompts,
)


class WordTokenizer:
    """One token per word of the user message, plus 3 for the template."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        words = " ".join(m["content"] for m in messages).split()
        return list(range(3 + len(words))) if tokenize else " ".join(words)


def _exp(**overrides):
    c = rlvr_smollm2_arith.get_config()
    for key, value in overrides.items():
        section, field = key.split("__")
        c[section][field] = value
    return ExperimentConfig.from_config_dict(c)


def _file(tmp_path, lengths, name="train.jsonl"):
    path = tmp_path / name
    rows = [json.dumps({"question": "w " * n, "answer": "#### 1"}) for n in lengths]
    path.write_text("\n".join([*rows, "{not json"]) + "\n")
    return str(path)


def test_file_lengths_are_derived_from_every_row(tmp_path):
    # GSM8K-like: prompts of 90-180 words; 64 (the old fixed limit) would fail them all.
    path = _file(tmp_path, [90 + 9 * i for i in range(11)])
    exp = _exp(
        data__task="file",
        data__path=path,
        data__prompt_key="question",
        data__answer_marker="####",
        data__eval_size=1,
    )
    task = build_task(exp.data, seed=exp.seed)
    assert isinstance(task.train, EpochShuffledRows) and len(task.train) == 11  # 12 rows - 1 eval
    seen = []
    lengths, every_row = measure_prompts(task, WordTokenizer(), on_row=lambda i, n: seen.append(n))
    assert every_row and sorted(lengths) == [93 + 9 * i for i in range(11)]  # bad row skipped
    assert seen == [12] * 13  # the total first, then after every row
    derived, info = prompt_lengths(exp, lengths, every_row)
    assert derived.data.max_prompt_tokens == derived.rollout.max_prefill_length == 256
    assert (info.longest, info.limit, info.derived, info.too_long) == (183, 256, True, 0)
    assert "derived from every row: 93-183 tokens" in info.describe()
    assert info.outliers == 0 and "outlier" not in info.describe()  # a spread, not outliers
    assert [p.answer for p in eval_prompts(task, WordTokenizer(), 256)] == ["1"]


def test_procedural_lengths_get_headroom():
    exp = _exp()
    task = build_task(exp.data, seed=exp.seed)
    lengths, every_row = measure_prompts(task, WordTokenizer())
    assert not every_row and len(lengths) == exp.data.eval_size + SAMPLE_ROWS
    longest = max(lengths)  # "What is 12 + 34? Answer with just the number." + 3
    assert longest == 13
    derived, info = prompt_lengths(exp, [30], every_row)
    assert info.limit == 64  # 30 * 1.25 = 37.5 -> 64, not 32
    derived, info = prompt_lengths(exp, [10], every_row)
    assert info.limit == 32  # never below MIN_PROMPT_TOKENS


def test_a_limit_the_user_set_is_checked_against_the_data(tmp_path, caplog):
    path = _file(tmp_path, [90, 100, 40])
    exp = _exp(data__task="file", data__path=path, data__max_prompt_tokens=64)
    assert exp.rollout.max_prefill_length == 0
    kept, info = prompt_lengths(exp, [93, 103, 43], True)
    assert (info.limit, info.derived, info.too_long) == (64, False, 2)
    assert kept.rollout.max_prefill_length == 64  # follows data.max_prompt_tokens
    assert "2 of 3 prompts measured are longer than data.max_prompt_tokens=64" in caplog.text
    with pytest.raises(ConfigError) as err:
        prompt_lengths(exp, [93, 103], True)
    message = str(err.value)
    assert "data.max_prompt_tokens=64" in message and "rollout.max_prefill_length" in message
    assert "at least 103" in message and "set both to 0" in message
    assert "(2 prompts of 93-103 tokens" in message
    # Only the engine's limit given: it is the prompt limit too.
    exp = _exp(data__task="file", data__path=path, rollout__max_prefill_length=128)
    kept, info = prompt_lengths(exp, [93, 103], True)
    assert kept.data.max_prompt_tokens == kept.rollout.max_prefill_length == 128
    with pytest.raises(ConfigError, match="no prompt could be rendered"):
        prompt_lengths(_exp(data__task="file", data__path=path), [], True)
    # Limits set or not, a dataset with no usable row is refused, quoting why.
    with pytest.raises(ConfigError, match=r"2 rows failed, the first: row 0: bad answer"):
        prompt_lengths(exp, [], True, ["row 0: bad answer", "row 1: bad answer"])


def test_task_errors_name_the_data_fields(tmp_path):
    path = _file(tmp_path, [3])
    with pytest.raises(ConfigError, match=r"data.task='file'.*unexpected keyword.*bogus"):
        build_task(
            (e := _exp(data__task="file", data__path=path, data__task_options='{"bogus": 1}')).data,
            seed=e.seed,
        )
    with pytest.raises(ConfigError, match="unknown reasoning-gym dataset 'nope'"):
        build_task((e := _exp(data__task="reasoning_gym:nope")).data, seed=e.seed)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no rows"):
        build_task((e := _exp(data__task="file", data__path=str(empty))).data, seed=e.seed)


def test_a_run_whose_prompts_cannot_fit_stops_before_the_model_loads(tmp_path):
    from jaxflash.runtime.loop import run

    path = _file(tmp_path, [90, 100])
    exp = _exp(
        data__task="file", data__path=path, data__prompt_key="question", data__max_prompt_tokens=32
    )
    with pytest.raises(ConfigError, match="limit of 32 tokens"):
        run(exp, workdir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def test_a_derived_limit_is_capped_at_the_models_context_and_the_longer_rows_named(
    tmp_path, caplog
):
    # Issue 31's trial: one 9,035-token row derived a limit of 16384, and the run was
    # refused for the model's context of 8192, naming fields the user never set.
    path = _file(tmp_path, [90, 100, 9032])
    exp = _exp(data__task="file", data__path=path, data__prompt_key="question",
               data__answer_marker="####", data__eval_size=0)  # fmt: skip
    task = build_task(exp.data, seed=exp.seed)
    where: list[str] = []
    lengths, every_row = measure_prompts(task, WordTokenizer(), where=where)
    assert len(where) == len(lengths) == 3
    room = 8192 - exp.rollout.sampling.max_new_tokens
    derived, info = prompt_lengths(exp, lengths, every_row, context=8192, where=where)
    assert derived.data.max_prompt_tokens == derived.rollout.max_prefill_length == room
    assert (info.limit, info.capped, info.context, info.too_long) == (room, 16384, 8192, 1)
    assert len(info.longer_rows) == 1 and info.longer_rows[0].endswith("train.jsonl:3")
    assert "capped from 16384 at the model's context (max_seq_len 8192" in info.describe()
    assert "1 of 3 prompts measured are longer" in caplog.text and "train.jsonl:3" in caplog.text
    # The limit it derived is still set by that one row: said, with the setting that
    # would fail it instead (the trial: one 18k-token row made generation ~6x slower).
    assert (info.outliers, info.typical_limit) == (1, 128)
    assert info.outlier_rows[0].endswith("train.jsonl:3")
    assert "sized by 1 outlier row" in info.describe()
    assert "data.max_prompt_tokens=128 fails them" in info.describe()
    assert "set data.max_prompt_tokens=128 to fail them" in caplog.text
    # A random-init model's context is sized to the limit: not capped, and said.
    derived, info = prompt_lengths(exp, lengths, every_row, context=None, where=where)
    assert (info.limit, info.capped) == (16384, 0)
    assert "random-init model's context is sized to it" in info.describe()
    # A limit the user set is kept as today (the model check after the load has the say).
    exp = _exp(data__task="file", data__path=path, data__max_prompt_tokens=12000)
    kept, info = prompt_lengths(exp, lengths, every_row, context=8192, where=where)
    assert (info.limit, info.capped, info.too_long) == (12000, 0, 0)
