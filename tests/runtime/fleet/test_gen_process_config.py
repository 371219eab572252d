"""Config checks of generation in separate processes: refused combinations name the fields."""

import pytest

from configs import smoke_async
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.specs import ConfigError


def _config(**mesh):
    c = smoke_async.get_config()
    c.data.eval_size = 0
    c.mesh.generation_processes = True
    for k, v in mesh.items():
        setattr(c.mesh, k, v)
    return c


def test_a_valid_process_config_keeps_its_addresses():
    exp = ExperimentConfig.from_config_dict(
        _config(generation_addresses="10.0.0.1:8500, 10.0.0.2:8500", weight_transfer="stream")
    )
    assert exp.mesh.generation_addresses == ("10.0.0.1:8500", "10.0.0.2:8500")
    assert exp.mesh.weight_transfer == "stream"


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(colocated=True), "generation_processes=True needs mesh.colocated=False"),
        (dict(generation_addresses="10.0.0.1:8500"), "lists 1 programs but"),
        (dict(generation_addresses="10.0.0.1,10.0.0.2:1"), "'10.0.0.1' is not host:port"),
        (dict(weight_transfer="carrier_pigeon"), "mesh.weight_transfer must be"),
        (
            dict(generation_processes=False, generation_addresses="h:1,h:2"),
            "only used with mesh.generation_processes=True",
        ),
        (
            dict(generation_processes=False, generation_digests=True),
            "mesh.generation_digests=True",
        ),
    ],
)
def test_refused_combinations_name_the_fields(change, match):
    c = _config(**change)
    if change.get("colocated"):
        c.rollout.async_ratio = 0
    with pytest.raises(ConfigError, match=match):
        ExperimentConfig.from_config_dict(c)


def test_evaluation_runs_on_the_generation_programs_too():
    c = _config()
    c.data.eval_size = 8  # evaluated through the programs (runtime.fleet.eval_generation)
    assert ExperimentConfig.from_config_dict(c).data.eval_size == 8
