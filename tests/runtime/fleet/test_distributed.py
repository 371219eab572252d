"""sharding.distributed: the environment decides how a process joins its JAX program;
a 2-process learner on loopback trains like a 1-process one on the same 4 devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxflash.sharding.distributed import DistributedKind, plan_distributed
from tests.proc_helpers import REPO, child_env, free_port


@pytest.mark.parametrize(
    "env,kind",
    [
        ({}, DistributedKind.SINGLE),
        ({"TPU_WORKER_HOSTNAMES": "t0"}, DistributedKind.SINGLE),  # one TPU host
        ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, DistributedKind.TPU),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, DistributedKind.TPU),
        ({"JAXFLASH_DISTRIBUTED": "tpu"}, DistributedKind.TPU),
        ({"JAXFLASH_DISTRIBUTED": "off", "JAX_COORDINATOR_ADDRESS": "h:1"}, DistributedKind.SINGLE),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, DistributedKind.EXPLICIT),
    ],
)
def test_plan_follows_the_environment(env, kind):
    assert plan_distributed(env).kind is kind


def test_plan_explicit_reads_count_and_id():
    plan = plan_distributed(
        {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:8476", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "3", "TPU_WORKER_HOSTNAMES": "a,b"}
    )  # fmt: skip
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == (
        "127.0.0.1:8476",
        4,
        3,
    )
    assert plan.kind is DistributedKind.EXPLICIT  # the explicit address wins


@pytest.mark.parametrize(
    "env,match",
    [
        ({"JAXFLASH_DISTRIBUTED": "yes"}, "JAXFLASH_DISTRIBUTED='yes'"),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1"}, "host:port"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "set JAX_PROCESS_ID"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, "set JAX_NUM_PROCESSES"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
         r"JAX_PROCESS_ID=2 must be in \[0, JAX_NUM_PROCESSES=2\)"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
         "JAX_NUM_PROCESSES='two' must be an integer"),
        ({"JAXFLASH_DISTRIBUTED": "env"}, "needs JAX_COORDINATOR_ADDRESS"),
    ],
)  # fmt: skip
def test_plan_refuses_bad_environments_by_name(env, match):
    with pytest.raises(ValueError, match=match):
        plan_distributed(env)


def _run(env_extra: dict, devices: int) -> subprocess.Popen:
    env = child_env(devices)
    env.update(env_extra)
    script = os.path.join(REPO, "tests", "distributed_child.py")
    return subprocess.Popen(
        ["timeout", "-k", "5", "240", sys.executable, script],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_process_learner_matches_one_process():
    address = f"127.0.0.1:{free_port()}"
    procs = [
        _run({"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
              "JAX_PROCESS_ID": str(i)}, devices=2)
        for i in range(2)
    ]  # fmt: skip
    reference = _run({}, devices=4)
    results = [_result(p) for p in procs]
    ref = _result(reference)
    assert ref["plan"] == "single" and ref["devices"] == 4
    for i, r in enumerate(results):
        assert r["plan"] == "explicit" and r["process_index"] == i and r["process_count"] == 2
        assert (r["devices"], r["local_devices"], r["step"]) == (4, 2, 2)
    # Both processes computed one program: identical results on each.
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["param_sums"] == results[1]["param_sums"]
    # And the same numbers as one process over 4 devices (cross-process reductions
    # run through gloo, so the summation order may differ: float rounding only).
    np.testing.assert_allclose(results[0]["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(results[0]["param_sums"], ref["param_sums"], rtol=1e-5, atol=1e-5)
    assert results[0]["losses"][0] != results[0]["losses"][1]  # it trained
