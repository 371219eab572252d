"""Tasks by name: where prompts come from and which reward verifies them.

``make_task(name, seed=..., eval_size=..., **options) -> TaskData`` is what a
run's ``data.task=<name>`` selects:

- ``arithmetic``: seeded procedural arithmetic (``arithmetic.ArithmeticTask``);
  reward ``math``.
- ``digits``: seeded digit strings to reverse / sort / copy (``digits.DigitTask``;
  options ``op``, ``length``, ``num_symbols``); reward ``digit_match`` (partial
  credit per position).
- ``file``: ``{prompt, answer}`` rows of a JSONL/Parquet file (GSM8K:
  ``answer_marker="####"``); reward ``math``.
- ``math_file``: MATH-style rows ``{problem, solution}``; the label is the
  solution's last ``\\boxed{}`` (or the whole field if it has none) and the
  prompt asks for a boxed answer; reward ``math``.
- ``reasoning_gym:<dataset>``: any reasoning-gym dataset (``reasoning_gym_task``);
  reward ``reasoning_gym``. ``countdown`` = ``reasoning_gym:countdown``.
- ``humaneval``: OpenAI's HumanEval problems (``code_tasks``); reward ``code``
  (the program runs against the tests in the sandbox).
- ``code_file``: ``{prompt, tests}`` rows of a JSONL/Parquet file (``code_tasks``);
  reward ``code``.

File tasks hold out the first ``min(eval_size, 10 %)`` rows for evaluation and
read the rest in epochs shuffled with the run's seed (``epochs.EpochShuffledRows``;
``shuffle=False`` keeps file order); procedural tasks have disjoint train/eval
splits by construction. ``train`` is a sequence (read in epochs by the caller)
or a function cursor -> row; both keep a resumed run on the same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxflash.data import code_tasks
from jaxflash.data.arithmetic import ArithmeticTask
from jaxflash.data.digits import DigitTask
from jaxflash.data.epochs import EpochShuffledRows
from jaxflash.data.files import DatasetError, RowFailure, load_rows
from jaxflash.rewards.format import boxed_contents

MATH_INSTRUCTION = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
REASONING_GYM_PREFIX = "reasoning_gym:"
ALIASES = {"countdown": "reasoning_gym:countdown"}


@dataclasses.dataclass(frozen=True)
class TaskData:
    """What a run reads.

    Attributes:
      train: a sequence of rows, or a function cursor -> row (infinite).
      eval_rows: held-out rows ({"prompt", "answer", "meta"}).
      reward: registered reward name that verifies this task.
    """

    train: Sequence[Any] | Callable[[int], Any]
    eval_rows: Sequence[Any]
    reward: str


def _arithmetic(*, seed: int, eval_size: int, **knobs: Any) -> TaskData:
    train = ArithmeticTask(seed, split="train", **knobs)
    held_out = ArithmeticTask(seed, split="eval", **knobs)
    return TaskData(train=train.row, eval_rows=held_out.rows(0, eval_size), reward="math")


def _split_file(rows: list, *, seed: int, eval_size: int, shuffle: bool, path: str) -> TaskData:
    if not rows:
        raise DatasetError(f"{path}: no rows")
    n_eval = min(eval_size, len(rows) // 10)  # hold out at most 10 % of a file
    train = EpochShuffledRows(rows[n_eval:], seed, shuffle=shuffle)
    return TaskData(train=train, eval_rows=rows[:n_eval], reward="math")


def _file(
    *,
    seed: int,
    eval_size: int,
    path: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    answer_marker: str | None = None,
    on_error: str = "skip",
    shuffle: bool = True,
) -> TaskData:
    rows = load_rows(
        path,
        prompt_key=prompt_key,
        answer_key=answer_key,
        answer_marker=answer_marker or None,
        on_error=on_error,
    )
    return _split_file(rows, seed=seed, eval_size=eval_size, shuffle=shuffle, path=path)


def math_label(solution: str) -> str:
    """The label of a MATH-style solution: its last ``\\boxed{}`` content, else the text.

    Raises:
      ValueError: an empty label.
    """
    boxes = [b.strip() for b in boxed_contents(solution) if b.strip()]
    label = boxes[-1] if boxes else solution.strip()
    if not label:
        raise ValueError("empty answer")
    return label


def _math_file(
    *,
    seed: int,
    eval_size: int,
    path: str,
    prompt_key: str = "problem",
    answer_key: str = "solution",
    on_error: str = "skip",
    shuffle: bool = True,
    instruction: str = MATH_INSTRUCTION,
) -> TaskData:
    rows: list[Any] = []
    for row in load_rows(path, prompt_key=prompt_key, answer_key=answer_key, on_error=on_error):
        if isinstance(row, RowFailure):
            rows.append(row)
            continue
        meta = row["meta"]
        try:
            answer = math_label(row["answer"])
        except ValueError as e:
            failure = RowFailure(source=meta["source"], line=meta["line"], reason=str(e))
            if on_error == "raise":
                raise DatasetError(str(failure)) from None
            rows.append(failure)
            continue
        rows.append({"prompt": row["prompt"] + instruction, "answer": answer, "meta": meta})
    return _split_file(rows, seed=seed, eval_size=eval_size, shuffle=shuffle, path=path)


def _reasoning_gym(dataset: str) -> Callable[..., TaskData]:
    def build(*, seed: int, eval_size: int, **options: Any) -> TaskData:
        from jaxflash.data.reasoning_gym_task import ReasoningGymTask  # noqa: PLC0415

        train = ReasoningGymTask(dataset, seed, split="train", **options)
        held_out = ReasoningGymTask(dataset, seed, split="eval", **options)
        return TaskData(
            train=train.row, eval_rows=held_out.rows(0, eval_size), reward="reasoning_gym"
        )

    return build


def _humaneval(
    *,
    seed: int,
    eval_size: int,
    template: str = code_tasks.HUMANEVAL_TEMPLATE,
    shuffle: bool = True,
) -> TaskData:
    train, held_out = code_tasks.split_humaneval(
        seed=seed, eval_size=eval_size, template=template, shuffle=shuffle
    )
    return TaskData(train=train, eval_rows=held_out, reward="code")


def _code_file(
    *,
    seed: int,
    eval_size: int,
    path: str,
    prompt_key: str = "prompt",
    answer_key: str = "tests",
    on_error: str = "skip",
    shuffle: bool = True,
) -> TaskData:
    rows = code_tasks.load_code_rows(
        path, prompt_key=prompt_key, answer_key=answer_key, on_error=on_error
    )
    task = _split_file(rows, seed=seed, eval_size=eval_size, shuffle=shuffle, path=path)
    return dataclasses.replace(task, reward="code")


CODE_TASKS = ("humaneval", "code_file")
"""Tasks verified by the ``code`` reward (model-written programs run in the sandbox)."""


def _digits(*, seed: int, eval_size: int, **knobs: Any) -> TaskData:
    train = DigitTask(seed, split="train", **knobs)
    held_out = DigitTask(seed, split="eval", **knobs)
    return TaskData(
        train=train.row, eval_rows=held_out.rows(0, eval_size), reward=TASK_REWARDS["digits"]
    )


TASK_REWARDS = {"digits": "digit_match", **{name: "code" for name in CODE_TASKS}}
"""Tasks whose reward is not ``math``: their own registered reward."""

TASKS: dict[str, Callable[..., TaskData]] = {
    "arithmetic": _arithmetic,
    "digits": _digits,
    "file": _file,
    "math_file": _math_file,
    "humaneval": _humaneval,
    "code_file": _code_file,
}


def task_names() -> list[str]:
    """Names ``make_task`` accepts (``reasoning_gym:<dataset>`` stands for ~100)."""
    return sorted([*TASKS, *ALIASES, f"{REASONING_GYM_PREFIX}<dataset>"])


def get_task(name: str) -> Callable[..., TaskData]:
    """The builder of task ``name``.

    Raises:
      ValueError: unknown name (lists the known ones).
    """
    name = ALIASES.get(name, name)
    if name in TASKS:
        return TASKS[name]
    if name.startswith(REASONING_GYM_PREFIX) and name[len(REASONING_GYM_PREFIX) :]:
        return _reasoning_gym(name[len(REASONING_GYM_PREFIX) :])
    raise ValueError(f"unknown task {name!r}; known: {task_names()}")


def make_task(name: str, *, seed: int, eval_size: int, **options: Any) -> TaskData:
    """Build task ``name`` (see the module table) with the run's seed.

    Args:
      name: a task name.
      seed: the run's seed (procedural rows, epoch shuffles).
      eval_size: held-out rows wanted (files: at most 10 % of the file).
      **options: the task's own options (``path``, ``prompt_key``, ``shuffle``,
        arithmetic knobs, reasoning-gym ``config`` / ``template`` ...).

    Raises:
      ValueError: unknown task, or options the task does not take (names them).
      DatasetError: a file task whose file has no rows or a malformed row
        (with ``on_error="raise"``).
    """
    builder = get_task(name)
    try:
        return builder(seed=seed, eval_size=eval_size, **options)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise ValueError(f"task {name!r}: {e}") from None
        raise


def task_reward(name: str) -> str:
    """The reward that verifies task ``name`` (without building it)."""
    name = ALIASES.get(name, name)
    if name in TASK_REWARDS:
        return TASK_REWARDS[name]
    return "reasoning_gym" if name.startswith(REASONING_GYM_PREFIX) else "math"


__all__ = [
    "ALIASES",
    "CODE_TASKS",
    "MATH_INSTRUCTION",
    "TASKS",
    "TASK_REWARDS",
    "TaskData",
    "get_task",
    "make_task",
    "math_label",
    "task_names",
    "task_reward",
]
