"""Run reports: PNG plots of what runs and benchmarks wrote (a reader; no runtime imports).

    python -m jaxflash.report runs/smoke [runs/other ...] [--out DIR] [--step N]
    python -m jaxflash.report benchmarks/results/replay_real_2seeds.json

Figures: reward and held-out accuracy against step, trained samples and wall time;
the staleness histogram per step; one step's timeline (generation servers busy or
idle, reward scoring, learner wait / update / weight publish, from
``timeline.jsonl``); replay age, reuse and ESS (replay runs); episode length and
success (agentic runs). Several workdirs share each figure.
"""

from jaxflash.report.build import figures_for, write_report
from jaxflash.report.runs import Run, load_results, load_run

__all__ = ["Run", "figures_for", "load_results", "load_run", "write_report"]
