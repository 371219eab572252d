"""benchmarks/replay.py's bookkeeping: same budgets across modes, time to target without
evaluation time, and the simulator's replay configurations."""

import importlib.util
import json
import math
import os

import pytest

from configs import smoke

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "replay.py")
_spec = importlib.util.spec_from_file_location("bench_replay", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_time_to_target_excludes_evaluation_time(tmp_path):
    rows = [
        {"step": 0, "eval_accuracy": 0.0, "eval_time_s": 5.0, "trained_at_s": 0.0},
        {"step": 1, "trained_at_s": 8.0, "samples_generated": 8},
        {"step": 2, "trained_at_s": 12.0, "samples_generated": 16, "eval_accuracy": 0.25},
        {"step": 3, "trained_at_s": 20.0, "samples_generated": 24, "eval_time_s": 2.0},
        {"step": 4, "trained_at_s": 25.0, "samples_generated": 32, "eval_accuracy": 0.5},
    ]
    rows[2]["eval_time_s"] = 1.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = bench._curve(str(tmp_path))
    # Step 2: 12 - 5 (step 0's evaluation); step 4: 25 - 5 - 1 - 2.
    assert curve == [(7.0, 16, 0.25), (17.0, 32, 0.5)]
    assert bench.time_to_target(curve, 0.5) == 17.0
    assert bench.time_to_target(curve, 0.2) == 7.0
    assert math.isinf(bench.time_to_target(curve, 0.9))


@pytest.mark.parametrize("mode", bench.MODES)
def test_modes_spend_the_same_generation_budget(mode):
    exp = bench._config(smoke.__file__, mode, seed=0, budget=64, rho=0.5, eval_samples=16)
    r = exp.rollout
    fresh_groups = 2 if mode in ("replay", "adaptive") else r.prompts_per_step
    assert r.prompts_per_step == 4 and r.group_size == 2
    assert exp.total_steps * fresh_groups * r.group_size == 64
    assert exp.eval.every * fresh_groups * r.group_size == 16
    assert (exp.replay.ratio > 0) == (mode in ("replay", "adaptive"))
    assert (exp.controller.kind == "adaptive") == (mode == "adaptive")
    assert exp.rollout.async_ratio == (0 if mode == "sync" else 2)


def test_simulator_configs_share_the_device_budget():
    cfgs = {m: bench.sim_config(m, slots=256, slots_per_server=32, rho=0.5) for m in bench.MODES}
    assert cfgs["sync"].servers == cfgs["sync"].learner_devices == 8
    for m in ("async", "replay"):
        assert cfgs[m].servers + cfgs[m].learner_devices == 8
    assert cfgs["async"].batch_prompts == 16 and cfgs["replay"].batch_prompts == 8
    assert cfgs["replay"].replay_ratio == pytest.approx(1.0)  # rho / (1 - rho) per fresh
