"""The dual replay cycle in the one RLVR loop (configs/replay_smoke.py, tiny random model).

* End to end with the adaptive controller: every learner batch is the fresh cycle plus
  the replayed samples (counts add up with the learner's own), replayed samples are
  never older than replay.max_age nor replayed more than replay.max_reuse times, the
  per-cycle importance ratios add up to the learner's ratio_mean (fresh w = 1 at
  alpha = 0; replayed w != 1: taken against their stored behaviour logprobs), the
  controller's logged decisions are the ones it makes from the logged inputs and set
  the next step's rho, and every metric is in the README's table.
* Resume: a run stopped after step 2 and resumed trains steps 3-4 on the same batches
  as an uninterrupted run (the buffer and its sampler's RNG come from the checkpoint).
* rho = 0 is today's loop: tests/runtime/test_rlvr.py's golden test runs unchanged.
"""

import json
from dataclasses import replace

import pytest

from configs import replay_smoke
from jaxflash.replay.controller import AdaptiveController, ControllerInputs, Decision
from jaxflash.replay.dual_cycle import fresh_groups_needed
from jaxflash.runtime import loop as rlvr
from jaxflash.runtime.config.experiment import ExperimentConfig
from tests.runtime.test_rlvr import _undocumented


def _rows(path):
    return [json.loads(x) for x in open(path)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replay_smoke_adaptive_end_to_end(tmp_path):
    c = replay_smoke.get_config()
    c.total_steps = 4
    c.controller.kind = "adaptive"
    c.controller.replay_schedule = ""
    exp = ExperimentConfig.from_config_dict(c)
    rlvr.run(exp, workdir=str(tmp_path))
    metrics = _rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    replayed_any = False
    for m in metrics:
        step = m["step"]
        # Fresh cycle: round((1 - rho) 4) groups of 2 at the step's rho; + the replay cycle.
        fresh_groups = fresh_groups_needed(4, m["cycle_replay_ratio_target"])
        assert m["sched_batch_prompts"] == fresh_groups, step
        assert m["cycle_fresh_samples"] == m["num_samples"] == 2 * fresh_groups, step
        assert m["sequences"] == m["cycle_fresh_samples"] + m["cycle_replay_samples"], step
        assert m["tokens"] == m["fresh_ratio_tokens"] + m["replay_ratio_tokens"], step
        # Caps: ages <= max_age (2), replays per sample <= max_reuse (2).
        assert len(m["replay_age_hist"]) == 3 and len(m["replay_reuse_hist"]) == 3
        assert sum(m["replay_age_hist"]) == m["cycle_replay_samples"] == sum(m["replay_reuse_hist"])
        assert m["replay_age_hist"][0] == 0 and m["replay_reuse_hist"][0] == 0
        assert m["replay_ingested"] == m["replay_size"] + sum(
            m[f"replay_evicted_{r}"] for r in ("capacity", "age", "reuse")
        )
        # Fresh rows are on-policy at alpha = 0: w = 1 up to float rounding.
        assert abs(m["fresh_ratio_mean"] - 1.0) < 1e-5 and m["fresh_ess_token"] > 0.9999
        combined = m["fresh_ratio_mean"] * m["fresh_ratio_tokens"]
        if m["cycle_replay_samples"]:
            replayed_any = True
            # Replayed rows were sampled by an older policy: w != 1, 0 < ESS <= 1.
            assert abs(m["replay_ratio_mean"] - 1.0) > 1e-4, step
            assert 0 < m["replay_ess_token"] <= 1 and 0 < m["replay_ess_seq"] <= 1
            combined += m["replay_ratio_mean"] * m["replay_ratio_tokens"]
        # The learner's ratio (against batch behaviour logprobs) = the per-cycle stats.
        assert m["ratio_mean"] == pytest.approx(combined / m["tokens"], rel=1e-5), step
    assert replayed_any

    # Controller: decisions as the phase-1 controller makes them from the logged inputs.
    ref = AdaptiveController(
        exp.controller.controller_config(batch_samples=8, max_async_ratio=0, group_size=2),
        Decision(
            replay_ratio=0.5,
            async_ratio=0,
            requests_in_flight=0,
            learner_devices=8,
            generation_devices=1,
        ),
    )
    for prev, m in zip([None, *metrics], metrics, strict=False):
        inputs = {k[len("ctl_in_") :]: v for k, v in m.items() if k.startswith("ctl_in_")}
        assert inputs["step"] == m["step"] and inputs["queue_depth"] >= 0
        d = ref.update(ControllerInputs(**inputs))
        assert (m["ctl_replay_ratio"], m["ctl_async_ratio"]) == (d.replay_ratio, d.async_ratio)
        assert m["ctl_proposed_generation_devices"] == d.generation_devices
        assert (m["ctl_learner_devices"], m["ctl_generation_devices"]) == (8, 1)  # not moved
        ref.applied(replace(d, learner_devices=8, generation_devices=1))
        assert m["ctl_async_ratio"] == 0  # within the user's maximum (rollout.async_ratio)
        if prev is not None:  # the decision is in force at the next step
            assert m["cycle_replay_ratio_target"] == prev["ctl_replay_ratio"]
            assert m["sched_async_ratio"] == prev["ctl_async_ratio"]
            assert m["sched_prompts_capacity"] == prev["ctl_requests_in_flight"] // 2
    assert not _undocumented(metrics)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_resumed_run_replays_like_an_uninterrupted_one(tmp_path):
    c = replay_smoke.get_config()  # fixed rho = 0.5, a checkpoint every step
    c.total_steps = 4
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path / "whole"))
    c.total_steps = 2
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path / "resumed"))
    c.total_steps = 4
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path / "resumed"))
    whole = _rows(tmp_path / "whole/metrics.jsonl")
    resumed = _rows(tmp_path / "resumed/metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    replay_keys = [
        k
        for k in whole[-1]
        if k.startswith(("cycle_", "replay_", "fresh_"))
        and not k.endswith(("_ratio_mean", "_ratio_max", "_ratio_min", "_ess_token", "_ess_seq"))
    ]
    assert "replay_age_hist" in replay_keys and whole[-1]["cycle_replay_samples"] == 4
    for w, r in zip(whole[2:], resumed[2:], strict=True):
        assert {k: w[k] for k in replay_keys} == {k: r[k] for k in replay_keys}, w["step"]
        assert r["tokens"] == w["tokens"]
        # Same samples in the same rows: losses and ratios to float32 rounding.
        for key in ("loss", "pg_loss", "replay_ratio_mean", "replay_ess_seq"):
            assert r[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (w["step"], key)
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_alpha2_replays_within_the_caps(tmp_path):
    c = replay_smoke.get_config()
    c.total_steps = 6
    c.mesh.colocated = False
    c.mesh.num_generation_slices = 2
    c.rollout.async_ratio = 2
    c.replay.max_age = 4  # > alpha: alpha-stale fresh samples can still be replayed
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path))
    metrics = _rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for m in metrics:
        assert m["staleness_max"] <= 2  # the fresh cycle keeps its alpha bound
        assert m["sequences"] == m["cycle_fresh_samples"] + m["cycle_replay_samples"]
        assert len(m["replay_age_hist"]) == 5 and m["replay_age_hist"][0] == 0
        assert m["replay_ingested"] == m["replay_size"] + sum(
            m[f"replay_evicted_{r}"] for r in ("capacity", "age", "reuse")
        )
    # Replay continues once samples arrive alpha versions old (none is rejected for age).
    assert all(m["cycle_replay_samples"] == 4 for m in metrics[1:])
    assert metrics[-1]["replay_rejected_age"] == 0
