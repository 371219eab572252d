"""Writing a report: the figures that apply to the runs given, as PNGs plus a sidecar.

``write_report`` decides which figures apply (replay figures only when a run
replayed, agentic ones only for episodes), saves each as ``<out>/<name>.png`` and
writes ``<out>/report.json``: per figure its path, pixel size and every panel's
title, so a test (or a person) can check what was drawn without reading pixels.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from jaxflash.report import plots
from jaxflash.report.runs import Run, load_results, load_run

DPI = 100


def _save(fig: Figure, out: str, name: str) -> dict[str, Any]:
    path = os.path.join(out, f"{name}.png")
    fig.savefig(path, dpi=DPI)
    width, height = (int(round(v * DPI)) for v in fig.get_size_inches())
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    return {"path": path, "width": width, "height": height, "panels": titles}


def figures_for(runs: Sequence[Run], *, step: int | None = None) -> dict[str, Figure]:
    """The figures that apply to ``runs``: curves, staleness and timeline always;
    replay when any run replayed; agentic when any run ran episodes."""
    figs = {
        "curves": plots.curves(runs),
        "staleness": plots.staleness(runs),
        "timeline": plots.timeline(runs, step),
    }
    if any(r.has("replay_age_hist") or r.has("replay_ess_token") for r in runs):
        figs["replay"] = plots.replay(runs)
    if any(r.has("turns_per_episode") for r in runs):
        figs["agentic"] = plots.agentic(runs)
    return figs


def write_report(
    sources: Sequence[str], out: str | None = None, *, step: int | None = None
) -> dict[str, Any]:
    """Plots for run workdirs (several on one figure) or one benchmark results JSON.

    Args:
      sources: run workdirs (each with a metrics.jsonl), or a single ``.json``
        results file of a benchmark.
      out: output directory; default ``<first workdir>/report`` or, for a results
        file, ``<its directory>/<its name>_report``.
      step: the step whose timeline is drawn (default: each run's last).

    Returns:
      The sidecar (also written to ``<out>/report.json``): {"sources", "figures":
      {name: {"path", "width", "height", "panels": [titles]}}}.

    Raises:
      FileNotFoundError: a workdir without metrics.jsonl rows.
      ValueError: no sources, a results file mixed with workdirs, or a results
        file without curves.
    """
    if not sources:
        raise ValueError("jaxflash.report: give at least one workdir or results JSON")
    results = [s for s in sources if s.endswith(".json") and os.path.isfile(s)]
    if results and len(sources) > 1:
        raise ValueError(f"jaxflash.report: one results JSON at a time, got {list(sources)}")
    if results:
        _, curves = load_results(results[0])
        stem = os.path.splitext(results[0])[0]
        out = out or f"{stem}_report"
        figs = {"results": plots.results(curves)}
    else:
        runs = [load_run(s) for s in sources]
        if len({r.name for r in runs}) < len(runs):  # same basename: use the paths
            runs = [load_run(s, name=os.path.normpath(s)) for s in sources]
        out = out or os.path.join(sources[0], "report")
        figs = figures_for(runs, step=step)
    os.makedirs(out, exist_ok=True)
    sidecar = {
        "sources": list(sources),
        "figures": {name: _save(fig, out, name) for name, fig in figs.items()},
    }
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(sidecar, f, indent=1)
    return sidecar
