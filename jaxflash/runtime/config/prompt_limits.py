"""Prompt limits: ``data.max_prompt_tokens`` and ``rollout.max_prefill_length`` from the data.

``prompt_lengths`` sets both when they are 0 ("derive") from the prompts a task
measured (``runtime.workloads.task_setup.measure_prompts``):

* the limit is the next power of two at or above the longest one (the engine's
  prefill buckets are powers of two, so this costs no extra compile), with 25 %
  head-room first for a procedural task, whose later rows were not measured.

A limit the user set is checked against the same measurement: if every prompt
measured is longer, the run stops with an error naming both fields; if some
are, it says how many will fail as ``prompt_too_long``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig

log = logging.getLogger(__name__)

MIN_PROMPT_TOKENS = 32
PROCEDURAL_HEADROOM = 1.25


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
