"""A run's task: built by name, its prompts measured, held-out prompts rendered.

``build_task`` runs before the model loads, so a bad task name, option or file
fails in seconds. ``measure_prompts`` renders the prompts with the model's chat
template and measures them: every row of a file task, the held-out rows plus the
first ``SAMPLE_ROWS`` training rows of a procedural task; the limits are derived from
(or checked against) what it measured by ``runtime.config.prompt_limits``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sized
from typing import Any

from jaxflash.data.prompts import PromptFailure, PromptSource
from jaxflash.data.tasks import TaskData, make_task
from jaxflash.runtime.config.specs import ConfigError, DataSpec
from jaxflash.types import Prompt

SAMPLE_ROWS = 256
"""Training rows of a procedural task measured for its prompt lengths."""
_UNLIMITED = 1 << 30


def build_task(data: DataSpec, *, seed: int) -> TaskData:
    """``make_task(data.task, ...)`` with the run's seed and the data section's options.

    Raises:
      ConfigError: options the task does not take, a reasoning-gym dataset or
        config it rejects, a file with no rows (each message names ``data.*``).
    """
    d = data
    try:
        return make_task(d.task, seed=seed, eval_size=d.eval_size, **d.task_kwargs())
    except ValueError as e:
        raise ConfigError(f"data.task={d.task!r}: {e}") from None


def _rows_to_measure(task: TaskData) -> tuple[Iterator[Any], int, bool]:
    """(rows, how many, whether that is every row); procedural rows are generated lazily."""
    train = task.train
    if isinstance(train, Sized):  # a file's rows (EpochShuffledRows or a list)
        get = train if callable(train) else train.__getitem__
        n = len(train)
        every = True
    else:
        get, n, every = train, SAMPLE_ROWS, False
    rows = itertools.chain(task.eval_rows, (get(i) for i in range(n)))
    return rows, len(task.eval_rows) + n, every


def measure_prompts(
    task: TaskData,
    tokenizer: Any,
    *,
    on_row: Callable[[int, int], None] | None = None,
    failures: list[str] | None = None,
    where: list[str] | None = None,
) -> tuple[list[int], bool]:
    """Rendered lengths of the task's prompts (malformed rows skipped), and whether
    every row was measured. ``on_row(done, total)`` reports progress (rows of a
    procedural task are generated as they are measured); ``failures``, when given,
    receives the reason of every row that could not be rendered; ``where``, when given,
    where each measured prompt is, parallel to the lengths ("file:line" for a file's
    row, else "row <i>" in measuring order: the held-out rows first)."""
    rows, total, every_row = _rows_to_measure(task)
    source = PromptSource([], tokenizer, max_prompt_tokens=_UNLIMITED)
    lengths = []
    if on_row is not None:
        on_row(0, total)
    for i, row in enumerate(rows):
        prompt = source.render(i, row)
        if not isinstance(prompt, PromptFailure):
            lengths.append(len(prompt.prompt_tokens))
            if where is not None:
                meta = prompt.meta or {}
                at = f"{meta['source']}:{meta['line']}" if "line" in meta else f"row {i}"
                where.append(at)
        elif failures is not None:
            failures.append(prompt.reason)
        if on_row is not None:
            on_row(i + 1, total)
    return lengths, every_row


def held_out_note(data: DataSpec, task: TaskData, rendered: int) -> str:
    """One console line when the held-out evaluation is smaller than asked, or off; "" when
    it has the ``data.eval_size`` prompts asked for (or none were asked for).

    A file task holds out at most 10 % of its rows (``data.tasks``; humaneval at most
    half): a small file has no held-out split, and the run would otherwise train
    with no evaluation and say nothing.

    Args:
      data: the ``data`` section (``task``, ``eval_size``).
      rendered: held-out prompts that rendered (``eval_prompts``); malformed or too long
        held-out rows are left out.
    """
    asked, held = data.eval_size, len(task.eval_rows)
    if asked == 0 or rendered >= asked:
        return ""
    train = task.train
    size = f" ({len(train)} training rows)" if isinstance(train, Sized) else ""
    why = (
        f"data.task={data.task!r} held out {held} of the data.eval_size={asked} rows "
        f"asked for{size}; a file holds out at most 10 % of its rows (humaneval: half)"
    )
    if held > rendered:
        why += f", and {held - rendered} of them could not be rendered (malformed or too long)"
    if rendered == 0:
        return f"no held-out evaluation: {why}"
    return f"held-out evaluation on {rendered} prompts only: {why}"


def eval_prompts(task: TaskData, tokenizer: Any, max_prompt_tokens: int) -> list[Prompt]:
    """The held-out prompts, rendered (rows that cannot be are left out)."""
    source = PromptSource(task.eval_rows, tokenizer, max_prompt_tokens=max_prompt_tokens)
    return [p for p in source if not isinstance(p, PromptFailure)]


def prompt_by_id(rows: Any, source: PromptSource, prompt_id: int) -> Prompt | PromptFailure:
    """Re-render prompt ``prompt_id`` (a resumed run regenerates prompts in flight).

    ``rows`` is the task's ``train`` (a sequence, read in epochs, or an index ->
    row function); ``source`` renders it without moving its cursor.
    """
    row = rows(prompt_id) if callable(rows) else rows[prompt_id % len(rows)]
    return source.render(prompt_id, row)
