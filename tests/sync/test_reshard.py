"""Elastic move of a TrainState between learner meshes: bit-equal, no host round trip."""

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl
from jax.sharding import NamedSharding, PartitionSpec

from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.state import create_train_state, state_shardings
from jaxflash.models.config.presets import get_preset
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.sync.reshard import LayoutCache, mesh_layout, reshard, shards_present

# d_model 96 and vocab 576 split over 2, 4 and 6 devices: FSDP shards on every mesh here.
MODEL = get_preset("tiny", d_model=96, d_ff=192, vocab_size=576)
LEARNER = LearnerConfig(lr=1e-3)


@pytest.fixture
def host_reads(monkeypatch):
    """Counts reads of an array's value into host memory (what a host round trip does)."""
    calls = []
    original = ArrayImpl._value

    def counting(self):
        calls.append(self.shape)
        return original.fget(self)

    monkeypatch.setattr(ArrayImpl, "_value", property(counting))
    return calls


def _mesh(ids, **axes):
    return make_mesh([jax.devices()[i] for i in ids], axes or {"fsdp": len(ids)})


def _random_state(mesh):
    """A TrainState with every leaf (params, Adam moments, counters) set to random values."""
    state = create_train_state(MODEL, LEARNER, mesh, LEARNER_RULES, seed=0)
    rng = np.random.default_rng(0)

    def fill(x):
        if np.issubdtype(x.dtype, np.floating):
            value = rng.normal(size=x.shape).astype(x.dtype)
        else:
            value = rng.integers(0, 1000, size=x.shape).astype(x.dtype)
        return jax.device_put(value, x.sharding)

    return jax.tree.map(fill, state)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_four_to_six_to_two_devices_bit_equal_and_device_to_device(host_reads):
    m4, m6, m2 = _mesh([0, 1, 2, 3]), _mesh([2, 3, 4, 5, 6, 7]), _mesh([6, 7])
    state = _random_state(m4)
    before = _host(state)
    host_reads.clear()

    s6, r6 = reshard(state, state_shardings(MODEL, LEARNER, m6, LEARNER_RULES))
    s2, r2 = reshard(s6, state_shardings(MODEL, LEARNER, m2, LEARNER_RULES))
    jax.block_until_ready(s2)
    assert host_reads == []  # nothing was read into host memory on the way

    assert r6.leaves == len(before) and r6.via_replicated > 0  # growing: gather, copy, slice
    assert r2.staged > 0  # shrinking 6 -> 2: staged on the 6 devices, copied whole
    assert r6.bytes == r2.bytes == sum(a.nbytes for a in before)
    want = state_shardings(MODEL, LEARNER, m2, LEARNER_RULES)
    for x, s in zip(jax.tree.leaves(s2), jax.tree.leaves(want), strict=True):
        assert x.sharding == s
    sharded = [x for x in jax.tree.leaves(s2) if not x.sharding.is_fully_replicated]
    assert len(sharded) > 5  # the layouts really differ (FSDP over 2 devices)
    after = _host(s2)
    assert all(
        a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(before, after, strict=True)
    )


def test_same_layout_on_other_devices_is_direct(host_reads):
    a, b = _mesh([0, 1]), _mesh([4, 5])
    state = _random_state(a)
    before = _host(state)
    host_reads.clear()
    moved, report = reshard(state, state_shardings(MODEL, LEARNER, b, LEARNER_RULES))
    jax.block_until_ready(moved)
    assert host_reads == []
    assert report.direct == report.leaves and report.staged == report.via_replicated == 0
    assert all(np.array_equal(x, y) for x, y in zip(before, _host(moved), strict=True))
    assert all({d.id for d in x.devices()} <= {4, 5} for x in jax.tree.leaves(moved))


def test_plain_device_put_would_go_through_the_host(host_reads):
    """The counter detects the slow path the module avoids (the test is not vacuous)."""
    x = jax.device_put(
        np.arange(24.0).reshape(24, 1), NamedSharding(_mesh([0, 1, 2, 3]), PartitionSpec("fsdp"))
    )
    target = NamedSharding(_mesh([2, 3, 4, 5, 6, 7]), PartitionSpec("fsdp"))
    assert not shards_present(x.sharding, target, x.shape)
    host_reads.clear()
    jax.block_until_ready(jax.device_put(x, target))
    assert host_reads, "expected jax.device_put to read the array on the host"
    host_reads.clear()
    y, report = reshard(x, target)
    assert host_reads == [] and report.via_replicated == 1
    np.testing.assert_array_equal(np.asarray(y), np.arange(24.0).reshape(24, 1))


def test_bad_targets_are_named():
    x = jax.device_put(np.zeros((6, 2)), NamedSharding(_mesh([0, 1]), PartitionSpec("fsdp")))
    with pytest.raises(ValueError, match="mirror"):
        reshard({"a": x}, {"b": x.sharding})
    with pytest.raises(ValueError, match="leaf 0 of shape"):
        reshard(x, NamedSharding(_mesh([0, 1, 2, 3]), PartitionSpec("fsdp")))


def test_layout_cache_builds_once_per_layout():
    built = []
    cache = LayoutCache(lambda mesh: built.append(mesh_layout(mesh)) or len(built))
    a, b = _mesh([0, 1, 2, 3]), _mesh([2, 3, 4, 5])
    assert cache(a) == 1 and cache(b) == 2 and cache(_mesh([0, 1, 2, 3])) == 1
    assert cache.builds == 2
    assert cache(_mesh([0, 1, 2, 3], data=2, fsdp=2)) == 3  # same devices, other layout


def test_role_split_plans_whole_slices_and_round_trips():
    from jaxflash.sync.reshard_plan import RoleSplit, plan_role_split

    start = RoleSplit(learner=(0, 1, 2, 3), generation=((4, 5), (6, 7)))
    grow = plan_role_split(start, 6)
    assert grow.to_learner == ((4, 5),) and grow.after.learner == (0, 1, 2, 3, 4, 5)
    assert grow.after.generation == ((6, 7),)
    shrink = plan_role_split(grow.after, 2)
    assert shrink.to_generation == ((2, 3), (4, 5))
    assert shrink.after == RoleSplit(learner=(0, 1), generation=((2, 3), (4, 5), (6, 7)))
    back = plan_role_split(shrink.after, 4)
    assert back.after == RoleSplit(learner=(0, 1, 2, 3), generation=((4, 5), (6, 7)))
    assert not plan_role_split(start, 4).moved
    with pytest.raises(ValueError, match="whole number"):
        plan_role_split(start, 5)
    with pytest.raises(ValueError, match="need >= 1"):
        plan_role_split(start, 8)
    with pytest.raises(ValueError, match="two roles"):
        RoleSplit(learner=(0, 1), generation=((1, 2),))
