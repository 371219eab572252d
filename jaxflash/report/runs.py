"""Reading what runs and benchmarks wrote: metrics.jsonl, timeline.jsonl, results JSON.

A reader only: nothing here imports the runtime. Files are JSON Lines written by
``jaxflash.metrics.writer`` (one object per learner step; NaN/Inf as strings) and a
benchmark's results JSON (``benchmarks/replay.py`` and alike:
``{"runs": {name: [{"seed", "curve": [{"step", "seconds", "trained", "accuracy"},
...]}, ...]}}``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's outputs.

    Attributes:
      name: label in legends (the workdir's name).
      workdir: the directory read.
      metrics: metrics.jsonl rows in file order (a resumed run's rows continue it).
      timeline: timeline.jsonl rows (empty for runs written before it existed).
    """

    name: str
    workdir: str
    metrics: tuple[dict[str, Any], ...]
    timeline: tuple[dict[str, Any], ...]

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x, y) over the rows that hold a finite number under ``key``.

        ``x``: "step", "samples" (trained samples so far: the running sum of
        ``num_samples``) or "wall" (``trained_at_s``; 0 before the first update). A run
        resumed before its checkpoints kept the run's clock restarted ``trained_at_s``
        from 0: a value below the previous row's goes on from there, so "wall" never
        goes back.
        """
        xs, ys, samples, wall, restarted_at = [], [], 0.0, 0.0, 0.0
        for row in self.metrics:
            samples += _number(row.get("num_samples")) or 0.0
            if t := _number(row.get("trained_at_s")):
                if restarted_at + t < wall:  # an old resume's clock started again at 0
                    restarted_at = wall
                wall = restarted_at + t
            y = _number(row.get(key))
            if y is None:
                continue
            xs.append({"step": float(row.get("step", 0)), "samples": samples, "wall": wall}[x])
            ys.append(y)
        return xs, ys

    def has(self, key: str) -> bool:
        """Whether any metrics row holds ``key``."""
        return any(key in row for row in self.metrics)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Rows of a JSON Lines file ([] if missing); a line cut short by a kill is skipped."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def load_run(workdir: str, name: str | None = None) -> Run:
    """The run in ``workdir``.

    Raises:
      FileNotFoundError: ``workdir`` has no metrics.jsonl with any row (names it).
    """
    metrics = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if not metrics:
        raise FileNotFoundError(f"{workdir}: no metrics.jsonl rows (is it a run's --workdir?)")
    timeline = read_jsonl(os.path.join(workdir, "timeline.jsonl"))
    label = name or os.path.basename(os.path.normpath(workdir))
    return Run(label, workdir, tuple(metrics), tuple(timeline))


@dataclasses.dataclass(frozen=True)
class Curve:
    """One configuration of a benchmark: its seeds' curves (list of point dicts each)."""

    name: str
    seeds: tuple[tuple[dict[str, Any], ...], ...]


def load_results(path: str) -> tuple[dict[str, Any], list[Curve]]:
    """A benchmark results JSON: (the whole object, one Curve per configuration).

    Raises:
      ValueError: no ``runs`` mapping of configuration -> list of {"curve": [...]}
        (names the file).
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not runs:
        raise ValueError(f"{path}: a results JSON needs 'runs': {{name: [{{'curve': [...]}}]}}")
    curves = []
    for name, seeds in runs.items():
        seeds = seeds if isinstance(seeds, list) else [seeds]
        got = tuple(
            tuple(p for p in s.get("curve", []) if isinstance(p, dict))
            for s in seeds
            if isinstance(s, dict)
        )
        if not any(got):
            raise ValueError(f"{path}: runs[{name!r}] has no 'curve' points")
        curves.append(Curve(str(name), got))
    return data, curves
