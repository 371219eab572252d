"""checkpoint.Checkpointer: sharded TrainState + JSON meta, atomic, re-meshable."""

import os
import random
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxflash.checkpoint import (
    Checkpointer,
    CheckpointMeta,
    numpy_rng_state,
    python_rng_state,
    set_numpy_rng_state,
    set_python_rng_state,
)
from jaxflash.checkpoint.storage import steps_on_disk
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.state import abstract_train_state, create_train_state
from jaxflash.models.config.presets import get_preset
from jaxflash.runtime.interrupt import interrupted_message
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import LEARNER_RULES
from tests.paths import REPO


@pytest.fixture(scope="module")
def setup():
    model_config = get_preset("tiny", n_layers=1)
    learner_config = LearnerConfig(lr=1e-3, kl_coef=0.1)
    mesh = make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    state = create_train_state(model_config, learner_config, mesh, LEARNER_RULES, seed=3)
    return model_config, learner_config, mesh, state


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_roundtrip_state_meta_and_host_rngs(setup, tmp_path):
    model_config, learner_config, mesh, state = setup
    py_rng, np_rng = random.Random(7), np.random.default_rng(7)
    py_rng.random(), np_rng.random()
    meta = CheckpointMeta(
        step=0,
        data_cursor=123,
        policy_version=0,
        counters={"trained": 5, "filtered": 2},
        python_rng=python_rng_state(py_rng),
        numpy_rng=numpy_rng_state(np_rng),
    )
    want_py, want_np = py_rng.random(), np_rng.random()
    with Checkpointer(tmp_path, max_to_keep=2) as ck:
        assert (
            ck.restore_latest(
                abstract_train_state(model_config, learner_config, mesh, LEARNER_RULES)
            )
            is None
        )
        assert ck.save(state, meta)
        ck.wait()
        abstract = abstract_train_state(model_config, learner_config, mesh, LEARNER_RULES)
        restored, got = ck.restore_latest(abstract)
    _assert_trees_equal(restored, state)
    assert restored.ref_params is not None
    assert (
        restored.params["layers"]["w_q_ldnh"].sharding
        == state.params["layers"]["w_q_ldnh"].sharding
    )
    assert (got.step, got.data_cursor, got.counters) == (0, 123, {"trained": 5, "filtered": 2})
    r1, r2 = random.Random(0), np.random.default_rng(0)
    set_python_rng_state(r1, got.python_rng)
    set_numpy_rng_state(r2, got.numpy_rng)
    assert (r1.random(), r2.random()) == (want_py, want_np)


def test_restore_onto_a_different_mesh(setup, tmp_path):
    model_config, learner_config, _, state = setup
    with Checkpointer(tmp_path, max_to_keep=1, async_save=False) as ck:
        ck.save(state, CheckpointMeta(step=0))
        other = make_mesh(jax.devices()[6:8], {"tensor": 2})
        abstract = abstract_train_state(model_config, learner_config, other, LEARNER_RULES)
        restored, _ = ck.restore(0, abstract)
    _assert_trees_equal(restored, state)
    w = restored.params["layers"]["w_gate_ldf"]
    assert set(w.sharding.device_set) == set(jax.devices()[6:8])
    assert w.sharding.spec == abstract.params["layers"]["w_gate_ldf"].sharding.spec


def test_max_to_keep_and_step_checks(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=2, async_save=False) as ck:
        for step in (1, 2, 3):
            ck.save({"w": np.full((2,), step, np.float32)}, CheckpointMeta(step=step))
        assert ck.all_steps() == [2, 3]
        with pytest.raises(ValueError, match="step 3 already saved"):
            ck.save({"w": np.zeros((2,), np.float32)}, CheckpointMeta(step=3))
        with pytest.raises(ValueError, match="no complete checkpoint for step 1"):
            ck.restore(1, {"w": jax.ShapeDtypeStruct((2,), np.float32)})


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    from jaxflash.checkpoint import Checkpointer, CheckpointMeta
    ck = Checkpointer(sys.argv[1], max_to_keep=3, async_save=True)
    ck.save({"w": jnp.full((512, 512), 1.0)}, CheckpointMeta(step=1, data_cursor=10))
    ck.wait()
    ck.save({"w": jnp.full((512, 512), 2.0)}, CheckpointMeta(step=2, data_cursor=20))
    # Killed while step 2 is being written: no finalize, no cleanup handlers.
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_half_written_checkpoint_is_ignored(tmp_path):
    workdir = tmp_path / "checkpoints"  # as in a run directory (for interrupted_message)
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        ["timeout", "-k", "5", "120", sys.executable, "-c", _CHILD, str(workdir)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode in (-9, 137), proc.stderr[-2000:]
    entries = sorted(os.listdir(workdir))
    assert "1" in entries and "2" not in entries, entries
    assert any(e.startswith("2.") and "tmp" in e for e in entries), entries  # half-written
    # What a Ctrl-C's last line reads (a second Ctrl-C during the write leaves the same):
    assert steps_on_disk(str(workdir)) == ([1], [2])
    assert interrupted_message(str(tmp_path)) == (
        "interrupted: the checkpoint of step 2 was being written and is abandoned; run the "
        f"same command again to resume {tmp_path} from step 1, its last complete checkpoint"
    )
    abstract = {"w": jax.ShapeDtypeStruct((512, 512), np.float32)}
    with Checkpointer(workdir, max_to_keep=3) as ck:
        assert ck.all_steps() == [1]
        state, meta = ck.restore_latest(abstract)
        assert (meta.step, meta.data_cursor) == (1, 10)
        np.testing.assert_array_equal(np.asarray(state["w"]), np.ones((512, 512), np.float32))
        # The step can be saved again after the crash.
        ck.save({"w": np.full((512, 512), 3.0, np.float32)}, CheckpointMeta(step=2))
        ck.wait()
        assert ck.all_steps() == [1, 2]


def test_state_without_reference_saves_under_transfer_guard(tmp_path):
    model_config = get_preset("tiny", n_layers=1)
    learner_config = LearnerConfig(lr=1e-3)  # kl_coef 0: no reference params held
    mesh = make_mesh(jax.devices()[:2], {"fsdp": 2})
    state = create_train_state(model_config, learner_config, mesh, LEARNER_RULES, seed=1)
    assert state.ref_params is None
    abstract = abstract_train_state(model_config, learner_config, mesh, LEARNER_RULES)
    with Checkpointer(tmp_path, max_to_keep=1) as ck:
        with jax.transfer_guard("disallow"):
            ck.save(state, CheckpointMeta(step=0, policy_version=0))
            ck.wait()
            restored, meta = ck.restore_latest(abstract)
    assert restored.ref_params is None and meta.step == 0
    _assert_trees_equal(restored, state)
