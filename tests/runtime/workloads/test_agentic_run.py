"""Agentic experiments through the one loop: the config checks and the smoke run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from configs import agentic_frozenlake, agentic_smoke
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.runtime.rollout.episode_groups import EPISODE_ENDS
from tests.paths import REPO
from tests.runtime.test_rlvr import _undocumented


def _exp(config, **overrides):
    c = config.get_config()
    for key, value in overrides.items():
        section, field = key.split(".")
        if section not in c:  # the agentic configs have no data / reward sections
            c[section] = {}
        c[section][field] = value
    return ExperimentConfig.from_config_dict(c)


def test_agentic_configs_derive_the_engine_lengths_from_the_environment():
    exp = _exp(agentic_frozenlake)
    assert exp.env.name == "frozenlake" and exp.env.options["max_turns"] == 8
    assert exp.rollout.sampling.max_new_tokens == 8  # env.options.max_tokens_per_turn
    assert exp.rollout.max_prefill_length == exp.env.max_context_tokens - 1
    assert _exp(agentic_smoke).rollout.group_redundancy == 1


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"reward.fn": "uppercase_fraction"}, "reward.fn"),
        ({"rollout.truncation": "penalty"}, "rollout.truncation"),
        ({"rollout.max_new_tokens": 17}, "max_tokens_per_turn=8"),
        ({"env.options": '{"split": "eval"}'}, "env.options.split"),
        ({"env.options": '{"max_turns": 3, "board": 4}'}, "env.options.board"),
        ({"env.options": '{"max_turns": 2.5}'}, "env.options.max_turns must be an int, got 2.5"),
        ({"env.options": '{"max_turns": true}'}, "env.options.max_turns must be an int, got True"),
        ({"env.options": '{"is_slippery": "yes"}'}, "env.options.is_slippery must be a bool"),
        ({"env.options": '{"size": 3.5}'}, "env.options.size must be an int, got 3.5"),
        ({"env.options": '{"size": 1}'}, "env.options.size must be an int >= 2, got 1"),
        ({"env.max_context_tokens": 8}, "env.max_context_tokens=8"),
        ({"env.advantage_level": "token"}, "env.advantage_level"),
        ({"rollout.group_redundancy": -1}, "rollout.group_redundancy"),
        ({"replay.ratio": 0.5}, "replay.ratio / controller.kind with env.name"),
    ],
)
def test_agentic_config_refuses_fields_it_would_ignore_or_contradict(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        _exp(agentic_frozenlake, **overrides)


def test_rlvr_config_refuses_env_fields_and_redundancy():
    from configs import smoke  # noqa: PLC0415

    c = smoke.get_config()
    c.rollout.group_redundancy = 1
    with pytest.raises(ConfigError, match="group_redundancy=1 needs env.name"):
        ExperimentConfig.from_config_dict(c)
    c = smoke.get_config()
    c.env = {"max_env_restarts": 5}
    with pytest.raises(ConfigError, match="env.max_env_restarts set without env.name"):
        ExperimentConfig.from_config_dict(c)


def test_train_envs_of_one_group_draw_their_own_latencies():
    """Redundancy needs the episodes of one map to straggle independently: each train
    environment's latency stream is seeded by its instance number, not by the map."""
    from jaxflash.envs.latency import LatencyEnv  # noqa: PLC0415
    from jaxflash.runtime.model_setup import load_tokenizer  # noqa: PLC0415
    from jaxflash.runtime.workloads.agentic import EpisodeRollout  # noqa: PLC0415

    exp = _exp(agentic_smoke, **{"env.latency_mean_s": 1.0, "env.latency_std_s": 1.0})
    rollout = EpisodeRollout(
        exp.env,
        load_tokenizer(exp.model),
        rollout=exp.rollout,
        eval=exp.eval,
        advantage=exp.advantage,
        seed=exp.seed,
        model=exp.model,
    )
    envs = [rollout.make_train_env() for _ in range(3)]
    waits = []
    for env in envs:
        assert isinstance(env, LatencyEnv)
        env._sleep = waits.append  # record instead of sleeping
        env.reset(7)  # the same map for all three
        env.step("<answer>Down</answer>")
    assert len(set(waits)) == 3, waits


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agentic_smoke_runs_end_to_end_from_the_launcher(tmp_path):
    """``python launch/tpu_pod.py --config configs/agentic_smoke.py``: two steps of
    FrozenLake with a tiny random model, 2 + 1 episodes per group; the episode books
    add up, redundancy is counted, observation tokens are not trained, and every
    metric written is documented in the README."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "launch", "tpu_pod.py"),
            "--config",
            os.path.join(REPO, "configs", "agentic_smoke.py"),
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "finished 2/2 steps" in proc.stdout
    rows = [json.loads(x) for x in open(tmp_path / "w" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    last = rows[-1]
    ended = sum(last.get(k, 0) for k in EPISODE_ENDS) + last["episodes_running"]
    assert last["episodes_started"] == ended
    assert last["episodes_finished"] == 2 * 2 * 2  # 2 steps x 2 groups x G=2
    assert last["episodes_aborted_redundant"] == 2 * 2  # one spare per group
    assert last["prompt_outcomes"]["trained"] == {"trained": 4}
    assert 0 < last["sampled_tokens_mean"] < last["response_len_mean"]  # observations: mask 0
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in last
    assert not _undocumented(rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_agentic_resume_on_disjoint_slices_trains_no_group_twice(tmp_path):
    """α = 1 on disjoint slices: 2 steps, then the same workdir resumed to 3. Groups in
    flight at the checkpoint are played again (episodes running then are counted
    ``episodes_aborted_on_resume``), no episode is trained twice, the books add up."""
    from jaxflash.runtime import loop as rlvr  # noqa: PLC0415

    c = agentic_smoke.get_config()
    c.mesh.colocated = False
    c.rollout.async_ratio = 1
    c.env.eval_seeds = 0
    c.total_steps = 2
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path))
    first = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    c.total_steps = 3
    rlvr.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path))
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    last = rows[-1]
    ended = sum(last.get(k, 0) for k in EPISODE_ENDS) + last["episodes_running"]
    assert last["episodes_started"] == ended
    # α = 1: the groups of step 3 were admitted before step 2's checkpoint; they are
    # played again from scratch (their episodes then running: episodes_aborted_on_resume).
    assert last["prompts_regenerated_on_resume"] >= 1
    assert first[-1]["prompts_regenerated_on_resume"] == 0
    rollouts = [json.loads(x) for x in open(tmp_path / "rollouts.jsonl")]
    trained = [(r["prompt_id"], r["sample_index"]) for r in rollouts if r["outcome"] == "trained"]
    assert len(trained) == len(set(trained)) == 3 * 2 * 2
    assert all(0 <= r["staleness"] <= 1 for r in rollouts if r["outcome"] == "trained")
