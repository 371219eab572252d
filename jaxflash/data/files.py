"""Load {prompt, answer} rows from JSONL or Parquet files (GSM8K / DAPO-Math style).

Every row that comes back is normalised to
``{"prompt": str, "answer": str, "meta": {"source": path, "line": n}}`` (n is the
1-based line of a JSONL file or the 1-based row of a Parquet file). A malformed
row (bad JSON, not an object, a missing key, a non-string value) either raises
`DatasetError` naming the file, the line and the problem, or, with
``on_error="skip"``, comes back in place as a `RowFailure` so the caller can
count it (and a cursor over the list stays aligned with the file).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal


class DatasetError(ValueError):
    """A malformed dataset row; the message names the file, the line and the problem."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowFailure:
    """A row that could not be read (returned with ``on_error="skip"``).

    Attributes:
      source: file path; line: 1-based line (JSONL) or row (Parquet); reason: the problem.
    """

    source: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}"


def _lookup(record: dict[str, Any], key: str) -> Any:
    """record[key], where a dotted key ("reward_model.ground_truth") walks nested dicts."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def _normalise(
    record: Any, *, prompt_key: str, answer_key: str, answer_marker: str | None
) -> dict[str, str]:
    """Pick and check the two fields of one decoded record; raises ValueError(problem)."""
    if not isinstance(record, dict):
        raise ValueError(f"row is a {type(record).__name__}, not a JSON object")
    out = {}
    for name, key in (("prompt", prompt_key), ("answer", answer_key)):
        try:
            value = _lookup(record, key)
        except KeyError:
            raise ValueError(
                f"missing key {key!r} (the {name}); row has keys {sorted(record)}"
            ) from None
        if name == "answer" and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # numeric labels are common ({"answer": 4}); verifiers take text
        if not isinstance(value, str):
            raise ValueError(f"{key!r} (the {name}) must be a string, got {type(value).__name__}")
        out[name] = value
    if answer_marker is not None:
        # GSM8K: the solution ends in "#### 72"; the label is what follows the marker.
        head, marker, tail = out["answer"].rpartition(answer_marker)
        del head
        if not marker or not tail.strip():
            raise ValueError(f"answer has no {answer_marker!r} followed by a final answer")
        out["answer"] = tail.strip()
    return out


def _read_records(path: str) -> list[tuple[int, Any]]:
    """(1-based line, decoded record or the JSONDecodeError) for each non-blank row."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq  # only Parquet users pay for the import

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    if lower.endswith((".jsonl", ".ndjson")):
        records: list[tuple[int, Any]] = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue  # blank lines are not rows
                try:
                    records.append((line_no, json.loads(line)))
                except json.JSONDecodeError as e:
                    records.append((line_no, e))
        return records
    raise ValueError(
        f"dataset file {path!r}: unknown format (expected .jsonl, .ndjson or .parquet)"
    )


def load_rows(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    answer_marker: str | None = None,
    on_error: Literal["raise", "skip"] = "raise",
) -> list[dict[str, Any] | RowFailure]:
    """Read every row of a JSONL / Parquet dataset file.

    Args:
      path: a .jsonl / .ndjson (one JSON object per line; blank lines ignored) or
        .parquet file.
      prompt_key, answer_key: field names, e.g. "question" / "solution"; a dotted
        key reads a nested field ("reward_model.ground_truth").
      answer_marker: if set (GSM8K: "####"), the answer is the text after its last
        occurrence.
      on_error: "raise" (default) or "skip" (malformed rows come back as RowFailure).

    Returns:
      One entry per row, in file order: {"prompt", "answer", "meta"} or RowFailure.

    Raises:
      DatasetError: a malformed row with on_error="raise" ("<path>:<line>: <problem>").
      FileNotFoundError: no such file. ValueError: unknown extension or on_error.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"load_rows on_error must be 'raise' or 'skip', got {on_error!r}")
    path = os.fspath(path)
    rows: list[dict[str, Any] | RowFailure] = []
    for line_no, record in _read_records(path):
        try:
            if isinstance(record, json.JSONDecodeError):
                raise ValueError(f"bad JSON: {record.msg} at column {record.colno}")
            row: dict[str, Any] = _normalise(
                record, prompt_key=prompt_key, answer_key=answer_key, answer_marker=answer_marker
            )
        except ValueError as e:
            failure = RowFailure(source=path, line=line_no, reason=str(e))
            if on_error == "raise":
                raise DatasetError(str(failure)) from None
            rows.append(failure)
            continue
        row["meta"] = {"source": path, "line": line_no}
        rows.append(row)
    return rows
