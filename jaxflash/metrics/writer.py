"""Run logs: metrics.jsonl, rollouts.jsonl and TensorBoard event files.

One JSON object per learner step goes to ``<workdir>/metrics.jsonl``; scalar
fields are mirrored to TensorBoard (tensorboardX) under the same names; one JSON
object per generated sample goes to ``<workdir>/rollouts.jsonl``; one per step
with the step's spans (generation busy, reward scoring, learner wait / update /
publish) to ``<workdir>/timeline.jsonl``. Files are
opened in append mode so a resumed run continues them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from tensorboardX import SummaryWriter

from jaxflash import failpoints


def _jsonable(value: Any) -> Any:
    """Converts numpy/jax scalars and arrays to JSON types; NaN/Inf become strings."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def truncate_jsonl(path: str, key: str, max_value: int) -> int:
    """Drops rows whose ``key`` exceeds ``max_value`` (work lost after the last checkpoint).

    Returns the number of rows dropped; a missing file drops nothing. Rows without
    ``key`` are kept.
    """
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if not (isinstance(row.get(key), int) and row[key] > max_value):
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(lines) - len(kept)


class MetricsWriter:
    """Writes per-step metrics and per-sample rollouts for one run.

    The TensorBoard event file is created at the first ``write_step``, so a run
    that writes no step (a rerun of a finished run, a run that fails at start)
    leaves no empty event file behind.

    Args:
      workdir: run directory (created if missing).
    """

    def __init__(self, workdir: str) -> None:
        os.makedirs(workdir, exist_ok=True)
        self._workdir = workdir
        self._metrics = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        self._rollouts = open(os.path.join(workdir, "rollouts.jsonl"), "a", encoding="utf-8")
        self._tb: SummaryWriter | None = None
        self._timeline = open(os.path.join(workdir, "timeline.jsonl"), "a", encoding="utf-8")

    def write_step(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Appends one metrics row and mirrors its finite scalars to TensorBoard.

        Args:
          step: learner step (policy version after the update).
          metrics: name -> scalar (or small list/dict, JSON only).

        Returns:
          The row as written (JSON types).
        """
        row = {"step": int(step), **_jsonable(dict(metrics))}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        failpoints.reach("metrics_written")
        if self._tb is None:
            self._tb = SummaryWriter(os.path.join(self._workdir, "tensorboard"))
        for name, value in row.items():
            if name == "step":
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._tb.add_scalar(name, value, global_step=step)
        self._tb.flush()
        return row

    def write_rollouts(self, rows: list[Mapping[str, Any]]) -> None:
        """Appends one JSON line per sample (prompt, response, reward, versions, ...)."""
        lines = [json.dumps(_jsonable(dict(row))) + "\n" for row in rows]
        half = len(lines) // 2
        self._rollouts.writelines(lines[:half])
        failpoints.reach("rollouts_write", before_kill=lambda: self._torn(lines[half:]))
        self._rollouts.writelines(lines[half:])
        self._rollouts.flush()

    def write_timeline(self, row: Mapping[str, Any]) -> None:
        """Appends one step's timeline (spans in seconds since the run started)."""
        self._timeline.write(json.dumps(_jsonable(dict(row))) + "\n")
        self._timeline.flush()

    def _torn(self, rest: list[str]) -> None:
        # What a SIGKILL here can leave on disk: the buffered writer flushes whenever its
        # buffer fills, so any prefix of the bytes written so far, a cut line included.
        if rest:
            self._rollouts.write(rest[0][: len(rest[0]) // 2])
        self._rollouts.flush()

    def close(self) -> None:
        self._metrics.close()
        self._rollouts.close()
        self._timeline.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
