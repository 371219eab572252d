"""One device carver for both placements (8 fake CPU devices, tests/conftest.py)."""

import jax
import pytest

from jaxflash.runtime.config.experiment import MeshSpec
from jaxflash.runtime.config.specs import ConfigError
from jaxflash.runtime.fleet.placement import carve


def _ids(mesh):
    return sorted(int(d.id) for d in mesh.devices.flat)


def test_colocated_runs_one_server_on_the_learners_devices():
    p = carve(MeshSpec(learner={"fsdp": 4, "tensor": 2}, generation={"tensor": 2}))
    assert p.colocated and _ids(p.learner) == list(range(8))
    assert [_ids(m) for m in p.generation] == [[0, 1]]
    assert dict(p.learner.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    assert p.describe() == "learner devices 0-7, generation [0-1] (colocated)"


def test_disjoint_slices_follow_the_learner():
    spec = MeshSpec(
        learner={"fsdp": 3, "tensor": 2},
        generation={"tensor": 1},
        colocated=False,
        num_generation_slices=2,
    )
    p = carve(spec)
    assert not p.colocated and _ids(p.learner) == list(range(6))
    assert [_ids(m) for m in p.generation] == [[6], [7]]
    assert p.describe() == "learner devices 0-5, generation [6], [7] (disjoint)"
    # An explicit device list is carved in its order.
    p = carve(spec, devices=list(reversed(jax.devices())))
    assert [_ids(m) for m in p.generation] == [[1], [0]]


def test_too_few_devices_name_both_numbers():
    spec = MeshSpec(learner={"fsdp": 8}, colocated=False, num_generation_slices=2)
    # ConfigError: the launcher prints it as one line ("config error: ...").
    with pytest.raises(ConfigError, match="needs 10 devices .* only 8 are available"):
        carve(spec)
    with pytest.raises(ConfigError, match="mesh.generation .* needs 4 devices .* learner's 2"):
        carve(MeshSpec(learner={"fsdp": 2}, generation={"tensor": 4}))
