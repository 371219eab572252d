"""A run's task: built by name, prompt lengths derived from it, held-out prompts rendered.

``build_task`` runs before the model loads, so a bad task name, option or file
fails in seconds. ``prompt_lengths`` sets ``data.max_prompt_tokens`` and
``rollout.max_prefill_length`` when they are 0 ("derive"):

* the prompts are rendered with the model's chat template and measured: every
  row of a file task, the held-out rows plus the first ``SAMPLE_ROWS`` training
  rows of a procedural task;
* the limit is the next power of two at or above the longest one (the engine's
  prefill buckets are powers of two, so this costs no extra compile), with 25 %
  head-room first for a procedural task, whose later rows were not measured.

A limit the user set is checked against the same measurement: if every prompt
measured is longer, the run stops with an error naming both fields; if some
are, it says how many will fail as ``prompt_too_long``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

from jaxflash.data.prompts import PromptFailure, PromptSource
from jaxflash.data.tasks import TaskData, make_task
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.types import Prompt

log = logging.getLogger(__name__)

SAMPLE_ROWS = 256
"""Training rows of a procedural task measured for its prompt lengths."""
MIN_PROMPT_TOKENS = 32
PROCEDURAL_HEADROOM = 1.25
_UNLIMITED = 1 << 30


def build_task(exp: ExperimentConfig) -> TaskData:
    """``make_task(data.task, ...)`` with the run's seed and the data section's options.

    Raises:
      ConfigError: options the task does not take, a reasoning-gym dataset or
        config it rejects, a file with no rows (each message names ``data.*``).
    """
    d = exp.data
    try:
        return make_task(d.task, seed=exp.seed, eval_size=d.eval_size, **d.task_kwargs())
    except ValueError as e:
        raise ConfigError(f"data.task={d.task!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class PromptLengths:
    """What was measured, in tokens of the rendered chat prompt.

    Attributes:
      measured: prompts rendered; every_row: whether that was every row there is.
      shortest, longest: their lengths (0 when none rendered).
      limit: ``data.max_prompt_tokens`` in force; derived: whether it was derived here.
      too_long: measured prompts longer than ``limit``.
    """

    measured: int
    every_row: bool
    shortest: int
    longest: int
    limit: int
    derived: bool
    too_long: int

    def describe(self) -> str:
        """One console line."""
        rows = "every row" if self.every_row else f"{self.measured} rows"
        how = "derived from" if self.derived else "checked against"
        return (
            f"prompt length limit {self.limit} tokens (data.max_prompt_tokens, {how} "
            f"{rows}: {self.shortest}-{self.longest} tokens)"
        )


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
) -> tuple[list[int], bool]:
    """Rendered lengths of the task's prompts (malformed rows skipped), and whether
    every row was measured. ``on_row(done, total)`` reports progress (rows of a
    procedural task are generated as they are measured); ``failures``, when given,
    receives the reason of every row that could not be rendered."""
    rows, total, every_row = _rows_to_measure(task)
    source = PromptSource([], tokenizer, max_prompt_tokens=_UNLIMITED)
    lengths = []
    if on_row is not None:
        on_row(0, total)
    for i, row in enumerate(rows):
        prompt = source.render(i, row)
        if not isinstance(prompt, PromptFailure):
            lengths.append(len(prompt.prompt_tokens))
        elif failures is not None:
            failures.append(prompt.reason)
        if on_row is not None:
            on_row(i + 1, total)
    return lengths, every_row


def prompt_lengths(
    exp: ExperimentConfig, lengths: list[int], every_row: bool, failures: Sequence[str] = ()
) -> tuple[ExperimentConfig, PromptLengths]:
    """The experiment with its prompt limits set (derived where 0), and what was measured.

    Args:
      failures: why rows could not be rendered (``measure_prompts``): the first is
        quoted when no row could be.

    Raises:
      ConfigError: no prompt could be rendered (every row malformed), or
        every measured prompt is longer than the limit (names ``data.max_prompt_tokens``
        and ``rollout.max_prefill_length``).
    """
    d, r = exp.data, exp.rollout
    limit = d.max_prompt_tokens or r.max_prefill_length
    derived = limit == 0
    if not lengths:  # every row malformed: nothing could ever be trained
        first = f"; {len(failures)} rows failed, the first: {failures[0]}" if failures else ""
        raise ConfigError(f"data.task={d.task!r}: no prompt could be rendered from the data{first}")
    if derived:
        want = max(lengths) * (1.0 if every_row else PROCEDURAL_HEADROOM)
        limit = max(MIN_PROMPT_TOKENS, 1 << (math.ceil(want) - 1).bit_length())
    too_long = sum(n > limit for n in lengths)
    info = PromptLengths(
        measured=len(lengths),
        every_row=every_row,
        shortest=min(lengths, default=0),
        longest=max(lengths, default=0),
        limit=limit,
        derived=derived,
        too_long=too_long,
    )
    if lengths and too_long == len(lengths):
        raise ConfigError(
            f"every prompt of data.task={d.task!r} measured ({info.measured} prompts of "
            f"{info.shortest}-{info.longest} tokens with the chat template) is longer than "
            f"the limit of {limit} tokens (data.max_prompt_tokens={d.max_prompt_tokens}, "
            f"rollout.max_prefill_length={r.max_prefill_length}; 0 follows the other): "
            f"raise both to at least {info.longest}, or set both to 0 to derive them from "
            "the data"
        )
    if too_long:
        log.warning(
            "%d of %d prompts measured are longer than data.max_prompt_tokens=%d and will "
            "fail as prompt_too_long (longest %d tokens)",
            too_long,
            len(lengths),
            limit,
            info.longest,
        )
    return exp.with_prompt_lengths(limit), info


def held_out_note(exp: ExperimentConfig, task: TaskData, rendered: int) -> str:
    """One console line when the held-out evaluation is smaller than asked, or off; "" when
    it has the ``data.eval_size`` prompts asked for (or none were asked for).

    A file task holds out at most 10 % of its rows (``data.tasks``; humaneval at most
    half): a small file has no held-out split, and the run would otherwise train
    with no evaluation and say nothing.

    Args:
      rendered: held-out prompts that rendered (``eval_prompts``); malformed or too long
        held-out rows are left out.
    """
    asked, held = exp.data.eval_size, len(task.eval_rows)
    if asked == 0 or rendered >= asked:
        return ""
    train = task.train
    size = f" ({len(train)} training rows)" if isinstance(train, Sized) else ""
    why = (
        f"data.task={exp.data.task!r} held out {held} of the data.eval_size={asked} rows "
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
