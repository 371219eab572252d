"""Config conversion, the prompt ledger and the metrics writer."""

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

sys.path.insert(0, REPO)

from configs import rlvr_smollm2_arith, smoke  # noqa: E402
from jaxflash.metrics.writer import MetricsWriter  # noqa: E402
from jaxflash.runtime.config.experiment import ExperimentConfig  # noqa: E402
from jaxflash.runtime.rollout.ledger import LedgerError, PromptLedger  # noqa: E402
from jaxflash.types import FailureReason, PromptOutcome  # noqa: E402


@pytest.mark.parametrize("module", [rlvr_smollm2_arith, smoke])
def test_configs_convert(module):
    exp = ExperimentConfig.from_config_dict(module.get_config())
    assert exp.rollout.sampling.max_new_tokens == module.get_config().rollout.max_new_tokens
    assert exp.learner.loss_kwargs["clip_eps_high"] == 0.28
    assert exp.learner.sampling == exp.rollout.sampling


@pytest.mark.parametrize(
    "name",
    [
        "rlvr_smollm2_arith",
        "smoke",
        "smoke_async",
        "agentic_frozenlake",
        "agentic_scienceworld",
        "replay_smoke",
        "elastic_smoke",
    ],
)
def test_decode_block_can_be_set_from_the_command_line_of_every_config(name):
    # --config.x.y=v overrides only keys the config file defines.
    import importlib

    c = importlib.import_module(f"configs.{name}").get_config()
    assert c.rollout.decode_block == 1
    c.rollout.decode_block = 4
    assert ExperimentConfig.from_config_dict(c).rollout.decode_block == 4


def test_config_errors_name_the_field():
    c = smoke.get_config()
    c.rollout.group_size = 0
    with pytest.raises(ValueError, match="rollout.group_size"):
        ExperimentConfig.from_config_dict(c)
    c = smoke.get_config()
    c.rollout.temperature = 0.0
    with pytest.raises(ValueError, match="temperature"):
        ExperimentConfig.from_config_dict(c)
    c = smoke.get_config().to_dict()
    c["learnr"] = {}
    with pytest.raises(ValueError, match="learnr"):
        ExperimentConfig.from_config_dict(c)


def _smoke(**overrides):
    c = smoke.get_config()
    for key, value in overrides.items():
        section, field = key.split(".")
        c[section][field] = value
    return c


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        ({"rollout.async_ratio": 2}, ("rollout.async_ratio=2", "mesh.colocated")),
        ({"mesh.num_generation_slices": 2}, ("mesh.num_generation_slices", "mesh.colocated")),
        ({"mesh.generation": {"tensor": 16}}, ("mesh.generation", "mesh.colocated")),
        (
            {"mesh.colocated": False, "rollout.partial_rollout": "restart"},
            ("rollout.partial_rollout='restart'", "rollout.async_ratio"),
        ),
        (
            {"mesh.colocated": False, "rollout.stale_policy": "regenerate"},
            ("rollout.stale_policy='regenerate'", "rollout.async_ratio"),
        ),
        (
            {"rollout.truncation": "mask", "rollout.truncation_penalty": -1.0},
            ("rollout.truncation_penalty", "rollout.truncation"),
        ),
        ({"rollout.filter_min_std": 0.0}, ("rollout.filter_min_std",)),
        (
            {"rollout.filter_min_mean": 0.8, "rollout.filter_max_mean": 0.2},
            ("rollout.filter_min_mean", "rollout.filter_max_mean"),
        ),
        ({"reward.format_weight": 0.5}, ("reward.format_weight", "reward.fn")),
        ({"rollout.decode_block": 0}, ("rollout.decode_block must be >= 1",)),
        # the exact mode is not bitwise on a sharded learner yet: refused, not approximate
        ({"model.exact_numerics": True}, ("model.exact_numerics", "mesh.learner")),
        # nor on an engine whose weights are split (tensor parallel): refused
        (
            {
                "model.exact_numerics": True,
                "mesh.num_cpu_devices": 2,
                "mesh.learner": {"fsdp": 1},
                "mesh.generation": {"tensor": 2},
            },
            ("model.exact_numerics", "mesh.generation", "tensor"),
        ),
        # a shared prompt changes the learner's summation order: refused in exact mode
        (
            {
                "model.exact_numerics": True,
                "mesh.num_cpu_devices": 1,
                "mesh.learner": {"fsdp": 1},
                "learner.packing": True,
                "learner.prefix_sharing": True,
            },
            ("model.exact_numerics", "learner.prefix_sharing"),
        ),
        (
            {"mesh.delta_publish": True, "learner.lora": {"rank": 4}},
            ("mesh.delta_publish", "learner.lora.rank"),
        ),
    ],
)
def test_silently_ignored_settings_are_refused_naming_the_fields(overrides, fields):
    with pytest.raises(ValueError) as err:
        ExperimentConfig.from_config_dict(_smoke(**overrides))
    for field in fields:
        assert field in str(err.value)


def test_exact_mode_accepted_on_a_one_device_learner():
    c = _smoke(**{"model.exact_numerics": True, "mesh.num_cpu_devices": 1})
    c.mesh.learner = {"fsdp": 1}
    c.mesh.generation = {"tensor": 1}
    assert ExperimentConfig.from_config_dict(c).model.exact_numerics
    c.mesh.num_cpu_devices = 3  # learner 1 + an engine with its slots over data=2
    c.mesh.colocated = False
    c.mesh.generation = {"data": 2, "tensor": 1}
    assert ExperimentConfig.from_config_dict(c).mesh.generation["data"] == 2


def test_async_settings_accepted_on_disjoint_slices():
    exp = ExperimentConfig.from_config_dict(
        _smoke(
            **{
                "mesh.colocated": False,
                "rollout.async_ratio": 2,
                "rollout.partial_rollout": "restart",
                "rollout.stale_policy": "regenerate",
                "rollout.filter_min_std": 0.1,
            }
        )
    )
    assert exp.mesh.num_generation_slices == 2 and exp.mesh.learner == {"fsdp": 3, "tensor": 2}
    assert exp.rollout.async_ratio == 2


def test_group_filter_settings_become_the_filter_the_loop_builds():
    exp = ExperimentConfig.from_config_dict(_smoke())
    assert exp.rollout.group_filter_kwargs() is None  # keep every group
    c = _smoke(**{"rollout.filter_zero_variance": True, "rollout.filter_min_std": 0.1})
    assert ExperimentConfig.from_config_dict(c).rollout.group_filter_kwargs() == {
        "zero_variance": True,
        "min_mean": None,
        "max_mean": None,
        "min_std": 0.1,
    }


def test_launcher_refuses_async_ratio_on_the_colocated_config(tmp_path):
    """Done-when of issue 6: the launcher fails at start, naming mesh.colocated."""
    repo = REPO
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(repo, "launch", "tpu_pod.py"),
            "--config",
            os.path.join(repo, "configs", "smoke.py"),
            "--workdir",
            str(tmp_path / "w"),
            "--config.rollout.async_ratio=2",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mesh.colocated" in proc.stderr and "rollout.async_ratio=2" in proc.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was written


def test_ledger_adds_up_and_round_trips():
    ledger = PromptLedger()
    for i in range(6):
        ledger.take(i)
    ledger.close(0, PromptOutcome.TRAINED, "ok")
    ledger.close(1, PromptOutcome.FILTERED, "zero_variance")
    with pytest.raises(TypeError, match="FailureReason"):
        ledger.close(2, PromptOutcome.FAILED, "prompt too long")  # text is not a reason
    ledger.close(2, PromptOutcome.FAILED, FailureReason.PROMPT_TOO_LONG)
    ledger.close(3, PromptOutcome.STALE, "staleness 3 > 2")
    ledger.check()
    assert ledger.metrics() == {
        "prompts_taken": 6,
        "prompts_in_flight": 2,
        "prompts_trained": 1,
        "prompts_filtered": 1,
        "prompts_stale": 1,
        "prompts_failed": 1,
    }
    assert ledger.outcomes["failed"] == {"prompt_too_long": 1}
    with pytest.raises(LedgerError, match="prompt 0"):
        ledger.close(0, PromptOutcome.TRAINED, "again")
    with pytest.raises(LedgerError, match="prompt 4 taken twice"):
        ledger.take(4)
    restored = PromptLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.metrics() == ledger.metrics()
    restored.taken += 1
    with pytest.raises(LedgerError, match="does not add up"):
        restored.check()


def test_metrics_writer(tmp_path):
    with MetricsWriter(str(tmp_path)) as w:
        w.write_rollouts([{"prompt": "p", "response": "r", "reward": 1.0}])
        # No step written yet: no (empty) TensorBoard event file either.
        assert not (tmp_path / "tensorboard").exists()
        row = w.write_step(1, {"reward_mean": 0.5, "nan_metric": float("nan"), "hist": [1, 2]})
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows == [row] == [{"step": 1, "reward_mean": 0.5, "nan_metric": "nan", "hist": [1, 2]}]
    assert json.loads(open(tmp_path / "rollouts.jsonl").read())["reward"] == 1.0
    assert any(f.startswith("events") for f in os.listdir(tmp_path / "tensorboard"))
    MetricsWriter(str(tmp_path)).close()  # a run that writes no step adds no event file
    assert len(os.listdir(tmp_path / "tensorboard")) == 1


_PROGRAMS = {"mesh.generation_processes": True, "mesh.colocated": False}
_TWO_HOSTS = {**_PROGRAMS, "mesh.generation_hosts": 2, "mesh.generation": {"tensor": 2}}
_REMOTE = {**_PROGRAMS, "mesh.generation_addresses": "10.0.0.2:7000,10.0.0.3:7000"}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({}, False),  # thread engines: the full copy is a memcpy
        (_PROGRAMS, False),  # local programs: a loopback socket
        (_TWO_HOSTS, False),  # a program over 2 local processes: loopback too
        ({**_TWO_HOSTS, "mesh.generation_addresses": "10.0.0.2:7000,10.0.0.3:7000"}, True),
        (_REMOTE, True),  # programs on other hosts
        ({**_PROGRAMS, "mesh.generation_addresses": "127.0.0.1:7000,localhost:7001"}, False),
        ({**_PROGRAMS, "mesh.generation_addresses": "[::1]:7000,127.0.0.2:7001"}, False),
        ({**_REMOTE, "learner.lora": {"rank": 4}}, False),  # LoRA moves adapters only
        ({"mesh.delta_publish": True}, True),
        ({"mesh.delta_publish": "ON"}, True),
        ({**_TWO_HOSTS, "mesh.delta_publish": "off"}, False),
    ],
)
def test_delta_publish_auto_is_on_where_publishes_leave_the_machine(overrides, expected):
    assert ExperimentConfig.from_config_dict(_smoke(**overrides)).mesh.delta_publish is expected


def test_delta_publish_refuses_a_word_it_does_not_know():
    with pytest.raises(ValueError, match="mesh.delta_publish"):
        ExperimentConfig.from_config_dict(_smoke(**{"mesh.delta_publish": "sometimes"}))
