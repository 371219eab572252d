"""Prompt limits: ``data.max_prompt_tokens`` and ``rollout.max_prefill_length`` from the data.

``prompt_lengths`` sets both when they are 0 ("derive") from the prompts a task
measured (``runtime.workloads.task_setup.measure_prompts``):

* the limit is the next power of two at or above the longest one (the engine's
  prefill buckets are powers of two, so this costs no extra compile), with 25 %
  head-room first for a procedural task, whose later rows were not measured.

A derived limit never asks more of the model than its context: capped at
``max_seq_len - rollout.max_new_tokens`` (``context``, read from the model's files
before its weights load), so one over-long row fails as ``prompt_too_long`` instead of
stopping the run (a 9,035-token row once derived 16384 and the run was refused for a
context of 8192, naming fields the user never set). A random-init model's context is
itself sized to the limit (``model_setup.load_model``): nothing to cap, and the
start-up line says so.

A derived limit set by a few outliers (at least ``OUTLIER_FACTOR`` times the limit
that would cover 99 % of the rows) sizes every step's prefill and KV cache to them:
one 18,039-token row among 60-token ones made generation ~6x slower in a trial. The
run keeps every row (nothing is failed that the user did not ask to fail) and says so
at start-up, naming the rows and the ``data.max_prompt_tokens`` that would fail them as
``prompt_too_long`` instead (``PromptLengths.outliers``).

A limit the user set is checked against the same measurement: if every prompt
measured is longer, the run stops with an error naming both fields; if some
are, it says how many will fail as ``prompt_too_long`` (and which rows, when known).
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
OUTLIER_FACTOR = 4  # a derived limit this many times the 99 %-of-rows one is said so


def _pow2_limit(tokens: float) -> int:
    """The prefill bucket (a power of two, at least ``MIN_PROMPT_TOKENS``) for ``tokens``."""
    return max(MIN_PROMPT_TOKENS, 1 << (math.ceil(tokens) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class PromptLengths:
    """What was measured, in tokens of the rendered chat prompt.

    Attributes:
      measured: prompts rendered; every_row: whether that was every row there is.
      shortest, longest: their lengths (0 when none rendered).
      limit: ``data.max_prompt_tokens`` in force; derived: whether it was derived here.
      too_long: measured prompts longer than ``limit``.
      context: the model's ``max_seq_len`` the derived limit was capped by (0: not
        known before the load: a random-init model, whose context is sized to fit).
      capped: the derived limit before the cap (0: not capped).
      longer_rows: where the first prompts longer than ``limit`` are ("file:line").
      outliers: derived limits only: rows longer than ``typical_limit`` when the
        limit is at least ``OUTLIER_FACTOR`` times it (0: no such outliers).
      typical_limit: the limit that covers 99 % of the rows measured (0 with outliers 0).
      outlier_rows: where the first outliers are ("file:line").
    """

    measured: int
    every_row: bool
    shortest: int
    longest: int
    limit: int
    derived: bool
    too_long: int
    context: int = 0
    capped: int = 0
    longer_rows: tuple[str, ...] = ()
    outliers: int = 0
    typical_limit: int = 0
    outlier_rows: tuple[str, ...] = ()

    def describe(self) -> str:
        """One console line."""
        rows = "every row" if self.every_row else f"{self.measured} rows"
        how = "derived from" if self.derived else "checked against"
        line = (
            f"prompt length limit {self.limit} tokens (data.max_prompt_tokens, {how} "
            f"{rows}: {self.shortest}-{self.longest} tokens)"
        )
        if self.capped:
            line += (
                f", capped from {self.capped} at the model's context (max_seq_len "
                f"{self.context} - rollout.max_new_tokens): {self.too_long} longer "
                + ("prompt fails" if self.too_long == 1 else "prompts fail")
                + " as prompt_too_long"
            )
        elif self.derived and not self.context:
            line += "; the random-init model's context is sized to it + rollout.max_new_tokens"
        if self.outliers:
            line += (
                f"; sized by {self.outliers} outlier row"
                + ("" if self.outliers == 1 else "s")
                + f" (99 % of rows fit {self.typical_limit}: every step's prefill and KV "
                f"cache pay for them; data.max_prompt_tokens={self.typical_limit} fails them "
                "as prompt_too_long instead)"
            )
        return line


def prompt_lengths(
    exp: ExperimentConfig, lengths: list[int], every_row: bool, failures: Sequence[str] = (),
    *, context: int | None = None, where: Sequence[str] = (),
) -> tuple[ExperimentConfig, PromptLengths]:  # fmt: skip
    """The experiment with its prompt limits set (derived where 0), and what was measured.

    Args:
      failures: why rows could not be rendered (``measure_prompts``): the first is
        quoted when no row could be.
      context: the model's ``max_seq_len`` (``model_setup.model_context``); a derived
        limit is capped at ``context - rollout.max_new_tokens``. None: not known
        before the load (a random-init model, sized to the limit).
      where: each measured prompt's row ("file:line"), parallel to ``lengths``.

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
    capped = 0
    headroom = 1.0 if every_row else PROCEDURAL_HEADROOM
    if derived:
        limit = _pow2_limit(max(lengths) * headroom)
        room = (context or 0) - r.sampling.max_new_tokens  # what the model's context allows
        if context and limit > room >= 1:  # one outlier row must not stop the run
            capped, limit = limit, room
    too_long = sum(n > limit for n in lengths)
    longer = [w for n, w in zip(lengths, where, strict=True) if n > limit] if where else []
    typical, outlying = 0, []
    if derived:  # the 99 %-of-rows limit (lower rank: one row in ten is not "typical")
        typical = _pow2_limit(sorted(lengths)[int(0.99 * (len(lengths) - 1))] * headroom)
        if limit >= OUTLIER_FACTOR * typical:
            outlying = [i for i, n in enumerate(lengths) if n > typical]
        else:
            typical = 0
    info = PromptLengths(
        measured=len(lengths),
        every_row=every_row,
        shortest=min(lengths, default=0),
        longest=max(lengths, default=0),
        limit=limit,
        derived=derived,
        too_long=too_long,
        context=int(context or 0) if derived else 0,
        capped=capped,
        longer_rows=tuple(longer[:5]),
        outliers=len(outlying),
        typical_limit=typical,
        outlier_rows=tuple(where[i] for i in outlying[:5]) if where else (),
    )
    rows = f" (rows {', '.join(info.longer_rows)}{', ...' if len(longer) > 5 else ''})"
    rows = rows if longer else ""
    if lengths and too_long == len(lengths):
        raise ConfigError(
            f"every prompt of data.task={d.task!r} measured ({info.measured} prompts of "
            f"{info.shortest}-{info.longest} tokens with the chat template) is longer than "
            f"the limit of {limit} tokens (data.max_prompt_tokens={d.max_prompt_tokens}, "
            f"rollout.max_prefill_length={r.max_prefill_length}; 0 follows the other"
            + (
                f"; derived, then capped at the model's context {context} - "
                f"rollout.max_new_tokens={r.sampling.max_new_tokens}"
                if capped
                else ""
            )
            + f"){rows}: raise both to at least {info.longest}, or set both to 0 to derive "
            "them from the data"
        )
    if too_long:
        log.warning(
            "%d of %d prompts measured are longer than data.max_prompt_tokens=%d%s and will "
            "fail as prompt_too_long (longest %d tokens)%s",
            too_long,
            len(lengths),
            limit,
            " (derived, capped at the model's context)" if capped else "",
            info.longest,
            rows,
        )
    if outlying:
        log.warning(
            "the derived prompt length limit %d tokens is set by %d outlier row(s)%s: 99 %% "
            "of the %d rows measured fit %d, and every step's prefill and KV cache are sized "
            "to the limit (slower generation); set data.max_prompt_tokens=%d to fail them as "
            "prompt_too_long instead",
            limit,
            len(outlying),
            f" ({', '.join(info.outlier_rows)}{', ...' if len(outlying) > 5 else ''})"
            if info.outlier_rows
            else "",
            len(lengths),
            typical,
            typical,
        )
    return exp.with_prompt_lengths(limit), info
