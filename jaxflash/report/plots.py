"""The report's figures, one function each: runs in, a matplotlib ``Figure`` out.

Figures are built with ``matplotlib.figure.Figure`` (rendered by Agg when saved;
no pyplot, no global backend switch), so reports can be written from any thread or
a headless machine. Several runs share each figure (one line or panel per run) so
configurations compare side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from jaxflash.report.runs import Curve, Run

_X_LABELS = {"step": "learner step", "samples": "trained samples", "wall": "wall time (s)"}
_LANE_COLORS = {"gen": "tab:green", "reward": "tab:purple", "wait": "0.75", "train": "tab:blue"}
_LANE_COLORS["publish"] = "tab:orange"


def _grid(rows: int, cols: int, width: float = 4.6, height: float = 3.2):
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    return fig, np.atleast_2d(fig.subplots(rows, cols, squeeze=False))


def _hist(value: Any) -> np.ndarray:
    """Counts by index from a list or a {"index": count} mapping (``staleness_hist``)."""
    if isinstance(value, dict):
        counts = {int(k): float(v) for k, v in value.items()}
        out = np.zeros(max(counts, default=-1) + 1)
        for k, v in counts.items():
            out[k] = v
        return out
    return np.asarray(value, float)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def curves(runs: Sequence[Run]) -> Figure:
    """Reward (``reward_mean``) and held-out accuracy (``eval_accuracy``) against step,
    trained samples and wall time; one line per run."""
    fig, axes = _grid(2, 3)
    for r, (key, label) in enumerate((("reward_mean", "reward"), ("eval_accuracy", "accuracy"))):
        for c, x in enumerate(("step", "samples", "wall")):
            ax = axes[r, c]
            ax.set_title(f"{'held-out ' if r else ''}{label} vs {_X_LABELS[x]}")
            ax.set_xlabel(_X_LABELS[x])
            ax.set_ylabel(key)
            drawn = False
            for run in runs:
                xs, ys = run.series(key, x)
                if xs:
                    ax.plot(xs, ys, marker="o", ms=3, label=run.name)
                    drawn = True
            if drawn:
                ax.legend(fontsize=7)
            else:
                _empty(ax, f"no {key} in these runs")
    return fig


def staleness(runs: Sequence[Run]) -> Figure:
    """Per run, the staleness histogram of the trained samples at every step
    (``staleness_hist``: count per staleness 0..α), as a step x staleness image."""
    fig, axes = _grid(1, len(runs))
    for ax, run in zip(axes[0], runs, strict=True):
        ax.set_title(f"staleness per step: {run.name}")
        ax.set_xlabel("learner step")
        ax.set_ylabel("staleness (versions)")
        rows = [
            (r["step"], _hist(r["staleness_hist"])) for r in run.metrics if r.get("staleness_hist")
        ]
        if not rows:
            _empty(ax, "no staleness_hist (no trained step)")
            continue
        depth = max(len(h) for _, h in rows)
        image = np.zeros((depth, len(rows)))
        for j, (_, hist) in enumerate(rows):
            image[: len(hist), j] = hist
        steps = [s for s, _ in rows]
        extent = (steps[0] - 0.5, steps[-1] + 0.5, -0.5, depth - 0.5)
        shown = ax.imshow(image, origin="lower", aspect="auto", cmap="viridis", extent=extent)
        fig.colorbar(shown, ax=ax, label="samples")
    return fig


def _pick_step(run: Run, step: int | None) -> tuple[dict[str, Any] | None, float | None]:
    """(the step's timeline row, the end of the previous row's publish: where it began)."""
    rows = list(run.timeline)
    at = [i for i, r in enumerate(rows) if step is None or r.get("step") == step]
    if not at:
        return None, None
    i = at[-1]
    return rows[i], (rows[i - 1]["learner"]["publish"][1] if i > 0 else None)


def timeline(runs: Sequence[Run], step: int | None = None) -> Figure:
    """Per run, one step's timeline (``step`` or the last one): every generation
    server's busy spans (with its busy share of the window), reward scoring, and the
    learner's wait / update / publish; the window runs from the previous step's
    publish to this one's (so it includes a previous step's evaluation)."""
    fig, axes = _grid(1, len(runs), width=7.0, height=3.4)
    for ax, run in zip(axes[0], runs, strict=True):
        row, since = _pick_step(run, step)
        ax.set_xlabel("seconds since the run started")
        if row is None:
            ax.set_title(f"timeline: {run.name}")
            _empty(ax, "no timeline.jsonl row for this step")
            continue
        learner = row["learner"]
        # From the previous step's publish (the first step: its first span), so work done
        # for this step before the learner asked for the batch (and evaluation) shows.
        firsts = [s[0] for spans in row.get("gen", []) for s in spans] + [learner["wait"][0]]
        t0, t1 = (since if since is not None else min(firsts)), learner["publish"][1]
        ax.set_title(f"timeline of step {row['step']}: {run.name}")
        lanes: list[tuple[str, str, list[list[float]]]] = [
            (f"gen{i} busy", "gen", spans) for i, spans in enumerate(row.get("gen", []))
        ]
        lanes.append(("reward scoring", "reward", row.get("reward", [])))
        lanes += [(f"learner {k}", k, [learner[k]]) for k in ("wait", "train", "publish")]
        ticks = []
        for y, (label, kind, spans) in enumerate(lanes):
            clipped = [(max(a, t0), min(b, t1)) for a, b in spans if b > t0 and a < t1]
            bars = [(a, max(b - a, (t1 - t0) * 2e-3)) for a, b in clipped]
            alpha = 0.35 if kind == "reward" else 0.9
            ax.broken_barh(bars, (y - 0.4, 0.8), color=_LANE_COLORS[kind], alpha=alpha)
            busy = sum(b - a for a, b in clipped) / max(t1 - t0, 1e-9)
            ticks.append(f"{label} {busy:.0%}" if kind == "gen" else label)
        ax.set_yticks(range(len(lanes)), ticks, fontsize=8)
        ax.set_xlim(t0, t1 + 1e-9)
    return fig


def replay(runs: Sequence[Run]) -> Figure:
    """Replay runs: replayed samples by age and by reuse count (summed over steps),
    and the importance-sampling ESS of fresh and replayed rows against step."""
    fig, axes = _grid(1, 3)
    for ax, key, title in (
        (axes[0, 0], "replay_age_hist", "replay age (versions)"),
        (axes[0, 1], "replay_reuse_hist", "replay reuse count"),
    ):
        ax.set_title(title)
        ax.set_ylabel("replayed samples")
        width, drawn = 0.8 / max(len(runs), 1), False
        for k, run in enumerate(runs):
            hists = [_hist(r[key]) for r in run.metrics if r.get(key)]
            if not hists:
                continue
            total = np.zeros(max(len(h) for h in hists))
            for h in hists:
                total[: len(h)] += h
            ax.bar(np.arange(len(total)) + k * width, total, width, label=run.name)
            drawn = True
        if drawn:
            ax.legend(fontsize=7)
        else:
            _empty(ax, f"no {key}")
    ax = axes[0, 2]
    ax.set_title("ESS (normalised, token) vs learner step")
    ax.set_xlabel("learner step")
    for run in runs:
        for key, style in (("fresh_ess_token", "-"), ("replay_ess_token", "--")):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, style, marker="o", ms=3, label=f"{run.name} {key[:-10]}")
    ax.legend(fontsize=7) if ax.lines else _empty(ax, "no ESS metrics")
    return fig


def agentic(runs: Sequence[Run]) -> Figure:
    """Agentic runs: turns per episode, sampled tokens per episode and success rate
    (training episodes; held-out success as dashed) against step."""
    fig, axes = _grid(1, 3)
    panels = (
        ("turns_per_episode", "episode length (turns)"),
        ("sampled_tokens_mean", "sampled tokens per episode"),
        ("success_rate", "success rate"),
    )
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        ax.set_title(f"{title} vs learner step")
        ax.set_xlabel("learner step")
        for run in runs:
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, label=run.name)
            if key == "success_rate":
                xs, ys = run.series("eval_accuracy")
                if xs:
                    ax.plot(xs, ys, "--", marker="x", ms=3, label=f"{run.name} held-out")
        ax.legend(fontsize=7) if ax.lines else _empty(ax, f"no {key}")
    return fig


def results(curves_: Sequence[Curve]) -> Figure:
    """A benchmark's curves: its metric against step, trained samples and seconds; per
    configuration the mean over seeds (thick, where the seeds share x values) and
    each seed (thin)."""
    y_key = next(
        (k for k in ("accuracy", "reward", "reward_mean") if _any_point(curves_, k)), "accuracy"
    )
    fig, axes = _grid(1, 3)
    for ax, x in zip(axes[0], ("step", "trained", "seconds"), strict=True):
        ax.set_title(f"{y_key} vs {x}")
        ax.set_xlabel(x)
        ax.set_ylabel(y_key)
        for k, curve in enumerate(curves_):
            color = f"C{k % 10}"
            per_seed = [
                [(p[x], p[y_key]) for p in seed if _finite(p.get(x)) and _finite(p.get(y_key))]
                for seed in curve.seeds
            ]
            common = _mean_curve(per_seed)
            if len(common) > 1:
                ax.plot(*zip(*common, strict=True), color=color, lw=2, label=curve.name)
            for j, pts in enumerate(p for p in per_seed if p):  # seeds' own x: no mean
                label = curve.name if j == 0 and len(common) < 2 else None
                ax.plot(*zip(*pts, strict=True), color=color, lw=0.7, alpha=0.5, label=label)
        ax.legend(fontsize=7) if ax.lines else _empty(ax, f"no {x} / {y_key} points")
    return fig


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and np.isfinite(v)


def _any_point(curves_: Sequence[Curve], key: str) -> bool:
    return any(_finite(p.get(key)) for c in curves_ for s in c.seeds for p in s)


def _mean_curve(per_seed: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Mean over seeds at the x values every seed has (all of them for one seed)."""
    seeds = [dict(pts) for pts in per_seed if pts]
    if not seeds:
        return []
    xs = sorted(set.intersection(*(set(s) for s in seeds)))
    return [(x, float(np.mean([s[x] for s in seeds]))) for x in xs]
