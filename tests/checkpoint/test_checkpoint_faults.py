"""Storage faults in the checkpoint layer, made to happen.

Real faults: a child process in its own user + mount namespace (``unshare -rm``,
no privileges needed where unprivileged user namespaces are allowed) mounts a
3 MiB tmpfs as the checkpoint directory and then remounts it read-only, or fills
it; chmod would not do as tests may run as root. Skipped, saying so, where
``unshare -rm`` is refused (e.g. AppArmor-restricted user namespaces).

Transient faults: injected at the file-system calls Orbax makes through
etils.epath, ``os.makedirs`` (a step's temporary directory, created inside
``save``) and ``os.rename`` (the finalize, in an async save's background
thread), failing a set number of times with EIO.
"""

import errno
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jaxflash.checkpoint import (
    Checkpointer,
    CheckpointMeta,
    CheckpointWriteError,
    StorageFault,
    diagnose,
)
from tests.proc_helpers import REPO, child_env


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="unshare -rm (user+mount namespace) refused here")
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("fault", ["ro", "full"])
def test_read_only_or_full_directory_fails_loudly_and_keeps_previous(tmp_path, fault, async_save):
    mnt = tmp_path / "ckpt"
    mnt.mkdir()
    script = os.path.join(REPO, "tests", "checkpoint_fault_child.py")
    inner = (
        f"mount -t tmpfs -o size=3m tmpfs {mnt} && exec timeout -k 5 120 "
        f"{sys.executable} {script} {mnt} {fault} {int(async_save)}"
    )
    run = subprocess.run(
        ["timeout", "-k", "5", "150", "unshare", "-rm", "sh", "-c", inner],
        env=child_env(1), cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    want = {"ro": "read_only", "full": "no_space"}[fault]
    assert out["fault"] == want, out
    assert out["path"] == str(mnt) and str(mnt) in out["error"]
    assert "step 2" in out["error"] and "previous checkpoint (step 1) is intact" in out["error"]
    assert out["attempts"] == 1  # permanent: not retried
    assert out["steps"] == [1] and out["restored_step"] == 1 and out["restored_equal"]
    assert out["stats"]["retries"] == 0 and out["stats"]["failed_writes"] == {want: 1}
    if fault == "full":
        assert out["entries"] == ["1"]  # the partial write was removed


class _Flaky:
    """Wrap an ``os`` function to fail with EIO on Orbax's temporary checkpoint paths.

    ``os.makedirs`` creates a step's temporary directory (inside ``save``);
    ``os.rename`` finalizes it (in the background thread of an async save).
    """

    def __init__(self, name: str, failures: int):
        self.failures, self.injected = failures, 0
        self._real = getattr(os, name)

    def __call__(self, path, *args, **kwargs):
        if "orbax-checkpoint-tmp" in str(path) and self.injected < self.failures:
            self.injected += 1
            raise OSError(errno.EIO, "injected I/O error", str(path))
        return self._real(path, *args, **kwargs)


def _state(seed):
    return {"w": jax.device_put(np.random.default_rng(seed).standard_normal(64, np.float32))}


def _restore(ck, step):
    sds = jax.ShapeDtypeStruct((64,), np.float32, sharding=SingleDeviceSharding(jax.devices()[0]))
    state, meta = ck.restore(step, {"w": sds})
    assert meta.step == step
    return np.asarray(state["w"])


def test_transient_fault_is_retried_and_counted(tmp_path, monkeypatch):
    flaky = _Flaky("makedirs", failures=1)
    monkeypatch.setattr(os, "makedirs", flaky)
    with Checkpointer(tmp_path, async_save=False, retry_backoff_s=0.0) as ck:
        assert ck.save(_state(1), CheckpointMeta(step=1))
        assert flaky.injected == 1
        assert ck.stats.retries == 1 and ck.stats.failed_writes == {"transient": 1}
        assert ck.all_steps() == [1]
        np.testing.assert_array_equal(_restore(ck, 1), np.asarray(_state(1)["w"]))


def test_persistent_fault_is_retried_a_bounded_number_of_times(tmp_path, monkeypatch):
    with Checkpointer(tmp_path, async_save=False, max_retries=2, retry_backoff_s=0.0) as ck:
        ck.save(_state(1), CheckpointMeta(step=1))
        flaky = _Flaky("makedirs", failures=100)
        monkeypatch.setattr(os, "makedirs", flaky)
        with pytest.raises(CheckpointWriteError) as err:
            ck.save(_state(2), CheckpointMeta(step=2))
        assert flaky.injected == 3 and err.value.attempts == 3 and ck.stats.retries == 2
        assert err.value.path == str(tmp_path) and str(tmp_path) in str(err.value)
        assert err.value.previous_step == 1 and "injected I/O error" in str(err.value)
        monkeypatch.undo()
        assert ck.all_steps() == [1]
        np.testing.assert_array_equal(_restore(ck, 1), np.asarray(_state(1)["w"]))
        assert ck.save(_state(2), CheckpointMeta(step=2))  # the disk is fine again


def test_async_transient_failure_is_superseded_by_the_next_save(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, async_save=True, retry_backoff_s=0.0)
    ck.save(_state(1), CheckpointMeta(step=1))
    ck.wait()
    flaky = _Flaky("rename", failures=1)
    monkeypatch.setattr(os, "rename", flaky)
    ck.save(_state(2), CheckpointMeta(step=2))  # its finalize fails in the background
    ck.save(_state(3), CheckpointMeta(step=3))  # finds it; writes the newer state instead
    ck.wait()
    assert flaky.injected == 1
    assert ck.all_steps() == [1, 3] and ck.stats.superseded == 1
    assert ck.stats.failed_writes == {"transient": 1}
    np.testing.assert_array_equal(_restore(ck, 3), np.asarray(_state(3)["w"]))
    # At the end of a run nothing newer exists: the failure is raised.
    monkeypatch.setattr(os, "rename", _Flaky("rename", failures=1))
    ck.save(_state(4), CheckpointMeta(step=4))
    with pytest.raises(CheckpointWriteError) as err:
        ck.close()
    assert err.value.step == 4 and err.value.fault is StorageFault.TRANSIENT
    assert err.value.previous_step == 3


def test_diagnose_reads_the_file_system(tmp_path):
    assert diagnose(str(tmp_path)) is StorageFault.TRANSIENT
    assert diagnose(str(tmp_path / "not" / "yet")) is StorageFault.TRANSIENT  # nearest parent
    assert diagnose(str(tmp_path), need_bytes=1 << 62) is StorageFault.NO_SPACE
    assert not os.listdir(tmp_path)  # the probe file is gone
    with pytest.raises(ValueError, match="max_retries"):
        Checkpointer(tmp_path, max_retries=-1)
