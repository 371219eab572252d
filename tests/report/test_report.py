"""``python -m jaxflash.report``: figures chosen by what the runs wrote, several runs on
one figure, a benchmark results JSON, errors naming the input. Synthetic run files
(fast); the report of a real run is checked in tests/runtime/test_rlvr.py (async smoke)."""

import json
import os

import pytest

from jaxflash.report import load_run, write_report
from jaxflash.report.__main__ import main
from tests.report_fixtures import check_report_pngs


def _write(workdir, metrics, timeline=()):
    os.makedirs(workdir, exist_ok=True)
    for name, rows in (("metrics.jsonl", metrics), ("timeline.jsonl", timeline)):
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(workdir)


def _step(step, **extra):
    return {
        "step": step,
        "num_samples": 8,
        "reward_mean": 0.1 * step,
        "trained_at_s": 2.0 * step,
        "staleness_hist": {"0": 4, "1": 3, "2": 1},  # as learner_batch.staleness_metrics writes it
        **extra,
    }


def _timeline(step):
    t = 2.0 * step
    return {
        "step": step,
        "learner": {"wait": [t - 2, t - 1.2], "train": [t - 1.2, t - 0.3], "publish": [t - 0.3, t]},
        "gen": [[[t - 2.5, t - 1.0]], [[t - 1.9, t - 0.5], [t - 0.4, t - 0.1]]],
        "reward": [[t - 1.5, t - 1.4], [t - 1.3, t - 1.25]],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    sync = _write(
        root / "sync",
        [{"step": 0, "eval_accuracy": 0.1}]
        + [_step(s, eval_accuracy=0.1 + 0.1 * s) for s in (1, 2, 3)],
        [_timeline(s) for s in (1, 2, 3)],
    )
    replay = _write(
        root / "replay",
        [
            _step(
                s,
                replay_age_hist=[0, 2, 1],
                replay_reuse_hist=[0, 3],
                fresh_ess_token=0.9,
                replay_ess_token=0.7,
            )
            for s in (1, 2)
        ],  # fmt: skip
        [_timeline(s) for s in (1, 2)],
    )
    agentic = _write(
        root / "agentic",
        [
            _step(s, turns_per_episode=3.0 + s, sampled_tokens_mean=20.0, success_rate=0.2 * s)
            for s in (1, 2)
        ],  # fmt: skip
    )
    return {"sync": sync, "replay": replay, "agentic": agentic, "root": root}


def test_one_run_gets_curves_staleness_and_its_timeline(runs):
    check_report_pngs(runs["sync"], {"curves", "staleness", "timeline"}, timeline_step=3)
    sidecar = write_report([runs["sync"]], os.path.join(runs["root"], "s1"), step=2)
    assert sidecar["figures"]["timeline"]["panels"] == ["timeline of step 2: sync"]


def test_several_runs_share_each_figure_and_add_replay_and_agentic_panels(runs):
    sources = [runs["sync"], runs["replay"], runs["agentic"]]
    out = os.path.join(runs["root"], "cmp")
    sidecar = check_report_pngs(
        sources, {"curves", "staleness", "timeline", "replay", "agentic"}, out=out
    )
    figs = sidecar["figures"]
    assert figs["staleness"]["panels"] == [
        f"staleness per step: {n}" for n in ("sync", "replay", "agentic")
    ]
    assert figs["replay"]["panels"] == [
        "replay age (versions)", "replay reuse count", "ESS (normalised, token) vs learner step"
    ]  # fmt: skip
    assert figs["agentic"]["panels"][0] == "episode length (turns) vs learner step"
    assert figs["timeline"]["panels"][2] == "timeline: agentic"  # no timeline.jsonl: says so


def test_series_against_samples_and_wall_time(runs):
    run = load_run(runs["sync"])
    xs, ys = run.series("reward_mean", "samples")
    assert xs == [8.0, 16.0, 24.0] and ys == pytest.approx([0.1, 0.2, 0.3])
    assert run.series("eval_accuracy", "wall")[0] == [0.0, 2.0, 4.0, 6.0]


def test_wall_time_of_a_run_resumed_before_the_clock_was_kept_never_goes_back(tmp_path):
    # Issue 31's trial: steps 1-3 at 108, 173, 248 s, then the resume restarted
    # trained_at_s at 0 and step 4 read 95 s, so "reward vs wall time" ran backwards.
    rows = [_step(s, trained_at_s=t) for s, t in ((1, 108.0), (2, 173.0), (3, 248.0), (4, 95.0))]
    rows.append(_step(5, trained_at_s=160.0))
    xs, _ = load_run(_write(tmp_path / "old", rows)).series("reward_mean", "wall")
    assert xs == [108.0, 173.0, 248.0, 343.0, 408.0]


def test_a_benchmark_results_json(tmp_path):
    curve = [
        {"step": s, "seconds": 10.0 * s, "trained": 8 * s, "accuracy": 0.1 * s} for s in range(4)
    ]
    runs = {"sync": [{"seed": 0, "curve": curve}] * 2, "async": [{"seed": 0, "curve": curve[:3]}]}
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"runs": runs}))
    sidecar = check_report_pngs(str(results), {"results"}, out=str(tmp_path / "rep"))
    assert sidecar["figures"]["results"]["panels"] == [
        "accuracy vs step", "accuracy vs trained", "accuracy vs seconds"
    ]  # fmt: skip


def test_bad_inputs_are_named(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no metrics.jsonl rows" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main([str(bad)]) == 2
    assert "bad.json: a results JSON needs 'runs'" in capsys.readouterr().err
