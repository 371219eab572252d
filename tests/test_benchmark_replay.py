"""benchmarks/replay.py's bookkeeping: configurations, the budget stop, curves without
evaluation time, time / samples to target and per-seed ratios; the simulator's configs."""

import importlib.util
import json
import math
import os
import sys

import pytest

from configs import smoke

_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")
sys.path.insert(0, _DIR)
_spec = importlib.util.spec_from_file_location("bench_replay", os.path.join(_DIR, "replay.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
import replay_sim  # noqa: E402


def _write(tmp_path, rows):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_curve_excludes_evaluation_time_after_the_first_request(tmp_path):
    rows = [
        # Step 0's evaluation runs before the first generation request: not subtracted.
        {"step": 0, "eval_accuracy": 0.0, "eval_time_s": 5.0},
        {"step": 1, "trained_at_s": 8.0, "samples_generated": 8, "num_samples": 8},
        {"step": 2, "trained_at_s": 12.0, "samples_generated": 16, "num_samples": 8,
         "cycle_replay_samples": 4, "eval_accuracy": 0.25, "eval_time_s": 1.0},
        {"step": 3, "trained_at_s": 20.0, "samples_generated": 24, "num_samples": 8,
         "eval_time_s": 2.0},
        {"step": 4, "trained_at_s": 25.0, "samples_generated": 32, "num_samples": 6,
         "eval_accuracy": 0.5, "eval_accuracy_stderr": 0.1},
    ]  # fmt: skip
    _write(tmp_path, rows)
    curve = bench.read_curve(str(tmp_path))
    assert [(p["step"], p["seconds"], p["generated"]) for p in curve] == [
        (0, 0.0, 0),
        (2, 12.0, 16),
        (4, 22.0, 32),  # 25 - step 2's and step 3's evaluations
    ]
    assert [(p["trained"], p["replayed"]) for p in curve] == [(0, 0), (16, 4), (30, 4)]
    assert bench.first_reaching(curve, 0.5, "seconds") == 22.0
    assert bench.first_reaching(curve, 0.2, "generated") == 16
    assert bench.first_reaching(curve, 0.0, "seconds") == 12.0  # step 0 never counts
    assert math.isinf(bench.first_reaching(curve, 0.9, "seconds"))


def test_summary_target_from_sync_and_per_seed_ratios():
    def run(times, final):
        curve = [{"step": 0, "seconds": 0.0, "generated": 0, "accuracy": 0.1}]
        curve += [
            {"step": i + 1, "seconds": t, "generated": 10 * (i + 1), "accuracy": a}
            for i, (t, a) in enumerate(zip(times, [0.2, final], strict=True))
        ]
        return {"curve": curve, "cut": False}

    runs = {
        "sync": [run([10.0, 20.0], 0.4), run([10.0, 30.0], 0.4)],  # target 0.4
        "async": [run([5.0, 10.0], 0.5), run([5.0, 60.0], 0.3)],  # 2nd never reaches it
    }
    s = bench.summarize(runs, 1.0)
    assert s["target"] == pytest.approx(0.4)
    assert s["modes"]["sync"]["time_to_target_s"] == [20.0, 30.0]
    assert s["modes"]["async"]["speedup_vs_sync"][0] == 2.0
    assert math.isnan(s["modes"]["async"]["speedup_vs_sync"][1])  # never reached: undefined
    assert s["modes"]["async"]["samples_to_target"][0] == 20
    assert bench.mean_std([2.0, 4.0], " s") == "3.00 +- 1.41 s"
    assert bench.mean_std([1.0, 3.0, math.inf]) == "2.00 +- 1.41 (1/3 never)"
    assert bench.mean_std([math.nan, math.nan], missing="n/a") == "n/a (2/2)"
    with pytest.raises(ValueError, match="sync"):
        bench.summarize({"async": runs["async"]}, 1.0)


def test_budget_stop_counts_generated_samples_or_minutes():
    now = [0.0]
    stop = bench.budget_stop(64, 2.0, clock=lambda: now[0])
    assert not stop({"samples_generated": 63})
    assert stop({"samples_generated": 64})
    now[0] = 119.0
    assert not stop({"samples_generated": 0})
    now[0] = 120.0
    assert stop({"samples_generated": 0})
    assert not bench.budget_stop(64, None, clock=lambda: 1e9)({"samples_generated": 1})


@pytest.mark.parametrize("mode", bench.MODES)
def test_modes_share_budget_seed_and_evaluation_points(mode):
    exp = bench.make_config(
        smoke.__file__, mode, seed=3, budget=64, rho=0.5, eval_samples=16, correction="m2po"
    )
    r = exp.rollout
    assert (r.prompts_per_step, r.group_size, exp.seed) == (4, 2, 3)
    fresh = 2 if mode in ("replay", "adaptive") else 4  # groups a step at the start rho
    assert exp.eval.every * fresh * r.group_size == 16
    # Enough steps for the budget at the fewest fresh samples a step can take.
    fewest = {"adaptive": 1}.get(mode, fresh)  # adaptive: rho up to 0.75 -> 1 group
    assert exp.total_steps * fewest * r.group_size == 64
    assert (exp.replay.ratio > 0) == (mode in ("replay", "adaptive"))
    assert (exp.controller.kind == "adaptive") == (mode == "adaptive")
    assert not exp.controller.elastic  # the smoke learner's tensor = 2 cannot grow by 1
    assert exp.rollout.async_ratio == (0 if mode == "sync" else 2)
    assert exp.mesh.colocated == (mode == "sync")
    if mode in ("replay", "adaptive"):
        assert exp.learner.replay_loss == "m2po" and exp.replay.max_age > 2


def test_real_model_configs_use_the_configs_own_devices():
    real = bench.CONFIGS["real"]
    sync = bench.make_config(real, "sync", seed=0, budget=640, rho=0.5, eval_samples=160)
    asyn = bench.make_config(real, "async", seed=0, budget=640, rho=0.5, eval_samples=160)
    assert sync.model.source == "gguf" and sync.data.task == "arithmetic"
    assert (sync.mesh.num_cpu_devices, dict(sync.mesh.learner)) == (2, {"fsdp": 2, "tensor": 1})
    assert asyn.mesh.num_cpu_devices == 3 and asyn.mesh.num_generation_slices == 2
    assert sync.total_steps == 20 and sync.eval.every == 5
    adaptive = bench.make_config(real, "adaptive", seed=0, budget=640, rho=0.5, eval_samples=160)
    assert adaptive.controller.elastic and not asyn.controller.elastic  # + elastic


def test_simulator_configs_share_the_device_budget():
    cfgs = {
        m: replay_sim.sim_config(m, slots=256, slots_per_server=32, rho=0.5)
        for m in replay_sim.MODES
    }
    assert cfgs["sync"].servers == cfgs["sync"].learner_devices == 8
    for m in ("async", "replay"):
        assert cfgs[m].servers + cfgs[m].learner_devices == 8
    assert cfgs["async"].batch_prompts == 16 and cfgs["replay"].batch_prompts == 8
    assert cfgs["replay"].replay_ratio == pytest.approx(1.0)  # rho / (1 - rho) per fresh


def test_apply_override_sets_fields_and_names_bad_ones():
    import ml_collections

    c = ml_collections.ConfigDict({"learner": {"lr": 5e-6, "schedule": "constant"}})
    bench.apply_override(c, "learner.lr=2e-5")
    bench.apply_override(c, "learner.schedule=cosine")
    assert c.learner.lr == 2e-5 and c.learner.schedule == "cosine"
    bench.apply_override(c, "learner.lr=1")  # an int for a float field stays a float
    assert isinstance(c.learner.lr, float) and c.learner.lr == 1.0
    with pytest.raises(ValueError, match="learner.lrr"):
        bench.apply_override(c, "learner.lrr=1e-5")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench.apply_override(c, "learner.lr")


def test_summarize_keeps_the_target_fraction():
    def run(seconds: float, accuracy: float) -> dict:
        points = [(0, 0.0, 0.1), (2, seconds, accuracy)]
        curve = [
            {"step": s, "seconds": t, "generated": 32 * s, "accuracy": a} for s, t, a in points
        ]
        return {"curve": curve, "cut": False}

    runs = {"sync": [run(10.0, 0.8)], "async": [run(4.0, 0.5)]}
    full, half = bench.summarize(runs, 1.0), bench.summarize(runs, 0.5)
    assert full["target_frac"] == 1.0 and half["target"] == pytest.approx(0.4)
    assert full["modes"]["async"]["time_to_target_s"] == [math.inf]
    assert half["modes"]["async"]["speedup_vs_sync"] == [pytest.approx(2.5)]
