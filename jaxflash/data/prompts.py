"""Turn dataset rows into tokenized `jaxflash.types.Prompt`s, from a resumable cursor.

`PromptSource` reads row ``cursor`` (from a list of rows, e.g. `files.load_rows`,
or a function of the index, e.g. `ArithmeticTask.row`), renders the user
message through the tokenizer's chat template, tokenizes it, and yields a
`Prompt` whose ``prompt_id`` is the cursor index. A row that cannot become a
prompt (malformed, or longer than ``max_prompt_tokens``) yields a
`PromptFailure` instead, so the caller counts it as failed (with its reason)
and nothing is silently lost. Save ``cursor`` in a checkpoint and pass it back
as ``start`` to resume exactly.

The tokenizer is duck-typed (layer-2 packages do not import each other): it
needs ``apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)`` returning the token ids (a list, or a mapping with
``input_ids`` as transformers 5 returns). Asking for ids rather than encoding a
rendered string keeps transformers' BOS rule: the template writes BOS (or
not), and no second one is added by encoding with special tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxflash.data.files import RowFailure
from jaxflash.types import FailureReason, Prompt


class TemplateTokenizer(Protocol):
    """What PromptSource needs from a tokenizer (``jaxflash.models.text.tokenizer.Tokenizer``
    and transformers' tokenizers fit)."""

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = True,
    ) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptFailure:
    """A dataset row that did not become a Prompt.

    Attributes:
      prompt_id: the cursor index of the row (as a Prompt would have had).
      reason: what went wrong, naming the prompt id (for people; never parsed).
      failure: the kind, counted by the ledger (MALFORMED_ROW or PROMPT_TOO_LONG).
      meta: provenance (source file and line when known).
    """

    prompt_id: int
    reason: str
    failure: FailureReason
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


RowsFn = Callable[[int], Mapping[str, Any]]


class PromptSource:
    """Iterator of `Prompt | PromptFailure` over dataset rows, from a cursor.

    Args:
      rows: a sequence of rows ({"prompt", "answer", optional "meta"} dicts or
        `RowFailure`s), or a function index -> row (an infinite source).
      tokenizer: see `TemplateTokenizer`.
      max_prompt_tokens: longest allowed rendered prompt, in tokens (>= 1).
      start: cursor to start from (a checkpointed `cursor`), >= 0.
      system_prompt: if set, a system message placed before the user message.
      cycle: for a sequence, wrap around at the end (prompt ids keep growing,
        so each epoch's prompts have fresh ids); otherwise stop at the end.

    Raises:
      ValueError: max_prompt_tokens < 1 or start < 0.
      TypeError: rows is neither a sequence nor a callable.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any] | RowFailure] | RowsFn,
        tokenizer: TemplateTokenizer,
        *,
        max_prompt_tokens: int,
        start: int = 0,
        system_prompt: str | None = None,
        cycle: bool = False,
    ) -> None:
        if max_prompt_tokens < 1:
            raise ValueError(
                f"PromptSource.max_prompt_tokens must be >= 1, got {max_prompt_tokens}"
            )
        if start < 0:
            raise ValueError(f"PromptSource.start must be >= 0, got {start}")
        if isinstance(rows, Sequence) and not isinstance(rows, str):
            self._rows_fn: RowsFn | None = None
            self._rows: Sequence[Any] | None = rows
            if cycle and not rows:
                raise ValueError("PromptSource: cannot cycle over an empty row sequence")
        elif callable(rows):
            self._rows_fn, self._rows = rows, None
        else:
            raise TypeError(f"PromptSource.rows must be a sequence or a callable, got {type(rows)}")
        self._tokenizer = tokenizer
        self._max_prompt_tokens = max_prompt_tokens
        self._system_prompt = system_prompt
        self._cycle = cycle
        self._cursor = start

    @property
    def cursor(self) -> int:
        """Index of the next row to read (save it; resume with ``start=cursor``)."""
        return self._cursor

    def __iter__(self) -> Iterator[Prompt | PromptFailure]:
        return self

    def __next__(self) -> Prompt | PromptFailure:
        index = self._cursor
        if self._rows is not None:
            if index >= len(self._rows) and not self._cycle:
                raise StopIteration
            row = self._rows[index % len(self._rows)]
        else:
            row = self._rows_fn(index)
        self._cursor = index + 1
        return self.render(index, row)

    def take(self, n: int) -> list[Prompt | PromptFailure]:
        """Up to n next items (fewer at the end of a non-cycling sequence)."""
        out = []
        for item in self:
            out.append(item)
            if len(out) == n:
                break
        return out

    def render(self, prompt_id: int, row: Mapping[str, Any] | RowFailure) -> Prompt | PromptFailure:
        """Build the Prompt (or PromptFailure) for one row; does not move the cursor."""
        if isinstance(row, RowFailure):
            return PromptFailure(
                prompt_id=prompt_id,
                reason=f"prompt {prompt_id}: malformed row: {row}",
                failure=FailureReason.MALFORMED_ROW,
                meta={"source": row.source, "line": row.line},
            )
        meta = (
            dict(row["meta"])
            if isinstance(row, Mapping) and isinstance(row.get("meta"), Mapping)
            else {}
        )
        problem = _row_problem(row)
        if problem is not None:
            if "source" in meta and "line" in meta:  # a file's row: say where it is
                problem = f"{meta['source']}:{meta['line']}: {problem}"
            return PromptFailure(
                prompt_id=prompt_id,
                reason=f"prompt {prompt_id}: malformed row: {problem}",
                failure=FailureReason.MALFORMED_ROW,
                meta=meta,
            )
        messages = [{"role": "user", "content": row["prompt"]}]
        if self._system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self._system_prompt})
        ids = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        if isinstance(ids, str):
            raise TypeError("tokenizer.apply_chat_template(tokenize=True) returned a str, not ids")
        tokens = np.asarray(ids, dtype=np.int32)
        if tokens.ndim != 1:
            raise ValueError(f"tokenizer returned token ids of shape {tokens.shape}, expected 1-D")
        if len(tokens) > self._max_prompt_tokens:
            return PromptFailure(
                prompt_id=prompt_id,
                reason=(
                    f"prompt {prompt_id} is {len(tokens)} tokens, longer than "
                    f"max_prompt_tokens={self._max_prompt_tokens}"
                ),
                failure=FailureReason.PROMPT_TOO_LONG,
                meta={**meta, "prompt_tokens": len(tokens)},
            )
        return Prompt(
            prompt_id=prompt_id,
            text=row["prompt"],
            prompt_tokens=tokens,
            answer=row["answer"],
            meta=meta,
        )


def _row_problem(row: Any) -> str | None:
    """Why `row` is not a usable {"prompt": str, "answer": str} mapping, or None."""
    if not isinstance(row, Mapping):
        return f"row is a {type(row).__name__}, not a mapping"
    for key in ("prompt", "answer"):
        if key not in row:
            return f"missing key {key!r}; row has keys {sorted(row)}"
        if not isinstance(row[key], str):
            return f"{key!r} must be a string, got {type(row[key]).__name__}"
    if not row["prompt"].strip():  # (an empty answer may be right: a reward that ignores it)
        return "'prompt' is empty"
    return None
