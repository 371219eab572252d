"""benchmarks/staleness.py --smoke: every mode runs through the real runtime and the
results JSON, table and plots have the documented structure with finite numbers."""

import importlib.util
import json
import math
import os
import sys

import pytest

_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")
sys.path.insert(0, _DIR)
_spec = importlib.util.spec_from_file_location(
    "bench_staleness", os.path.join(_DIR, "staleness.py")
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow
def test_smoke_grid_writes_results_and_plots(tmp_path):
    out = bench.main(["--smoke", "--workdir", str(tmp_path)])
    with open(tmp_path / "staleness.json", encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["summary"] == json.loads(json.dumps(out["summary"]))
    runs = saved["runs"]
    assert {(r["mode"], r["alpha"]) for r in runs} == {("sched", 0), ("sched", 2), ("forced", 2)}
    for r in runs:
        steps = r["steps"]
        assert [s["step"] for s in steps] == list(range(1, r["policy_version"] + 1))
        assert all(math.isfinite(s["reward"]) and 0 <= s["reward"] <= 1 for s in steps)
        # ESS of pi_theta / mu is reported on every step, in (0, 1].
        assert all(0 < s["ess"] <= 1 + 1e-6 for s in steps)
        assert r["evals"][0]["step"] == 0 and r["evals"][-1]["step"] == r["policy_version"]
        assert all(math.isfinite(e["reward"]) for e in r["evals"])
        trained = sum(r["staleness_hist"].values())
        assert trained == steps[-1]["trained"] > 0
        assert max(int(k) for k in r["staleness_hist"]) <= r["alpha"]
        if r["mode"] == "forced":
            # Version v trains on samples of version max(0, v - alpha) that the runtime
            # counts as on-policy: their logprobs differ from the learner's by the
            # policy change (0.0 at step 1, when both are version 0).
            assert steps[0]["gap"] < 1e-4
            assert all(s["gap"] > 1e-3 for s in steps[1:])
            assert [s["staleness_mean"] for s in steps] == [
                min(r["alpha"], s["step"] - 1) for s in steps
            ]
        if r["alpha"] == 0:
            assert r["staleness_hist"].keys() == {"0"}
            assert all(s["gap"] < 1e-4 for s in steps)  # sync: engine == learner
    rows = saved["summary"]
    assert len(rows) == 3
    for row in rows:
        for key in ("reward_half", "reward_final", "train_reward_last", "samples_to_target"):
            assert len(row[key]) == row["seeds"] == 1
        assert all(math.isfinite(x) for x in row["reward_final"] + row["reward_half"])
        assert 0 < row["ess_mean"] <= 1 + 1e-6
    for name in ("staleness_reward_sched.png", "staleness_reward_forced.png",
                 "staleness_distributions.png"):  # fmt: skip
        with open(tmp_path / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
