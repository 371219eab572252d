"""Child of test_checkpoint_faults.py: run inside a user + mount namespace whose
checkpoint directory is a small tmpfs (``unshare -rm``), make it read-only or full
for real, and report what the Checkpointer did as one JSON line.

    unshare -rm sh -c 'mount -t tmpfs -o size=3m tmpfs D && python checkpoint_fault_child.py D ro 1'
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxflash.checkpoint import Checkpointer, CheckpointMeta, CheckpointWriteError


def main() -> None:
    directory, fault, async_save = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    n = 500_000  # 1.9 MiB of float32 that does not compress: two do not fit in 3 MiB
    first = {"w": jax.device_put(np.random.default_rng(0).standard_normal(n, np.float32))}
    second = {"w": jax.device_put(np.random.default_rng(1).standard_normal(n, np.float32))}
    ck = Checkpointer(directory, async_save=async_save, retry_backoff_s=0.01)
    ck.save(first, CheckpointMeta(step=1))
    ck.wait()
    if fault == "ro":
        subprocess.run(["mount", "-o", "remount,ro", directory], check=True)
    out = {"error": None}
    try:
        ck.save(second, CheckpointMeta(step=2))
        ck.wait()
    except CheckpointWriteError as err:
        out.update(error=str(err), fault=err.fault.value, path=err.path, step=err.step,
                   previous_step=err.previous_step, attempts=err.attempts)  # fmt: skip
    sds = jax.ShapeDtypeStruct((n,), np.float32, sharding=SingleDeviceSharding(jax.devices()[0]))
    restored, meta = ck.restore(1, {"w": sds})
    out.update(
        steps=ck.all_steps(),
        restored_step=meta.step,
        restored_equal=bool(np.array_equal(np.asarray(restored["w"]), np.asarray(first["w"]))),
        stats={"failed_writes": dict(ck.stats.failed_writes), "retries": ck.stats.retries},
        entries=sorted(os.listdir(directory)),
    )
    try:
        ck.close()
    except CheckpointWriteError:
        pass
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
