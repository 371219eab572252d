"""sharding.roles (which hosts run which program) and launch/gcloud.py (the TPU fan-out)."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from jaxflash.sharding.distributed import DistributedKind, plan_distributed
from jaxflash.sharding.roles import ProgramSpec, Topology
from tests.proc_helpers import REPO

TPU_TOPOLOGY = {
    "programs": [
        {"name": "learner", "role": "learner", "tpu": "rl-v5p-16"},
        {"name": "gen0", "role": "generation", "tpu": "rl-v5e-8-a"},
        {"name": "gen1", "role": "generation", "tpu": "rl-v5e-8-b"},
    ]
}
HOST_TOPOLOGY = {
    "programs": [
        {"name": "learner", "role": "learner", "hosts": ["gpu0", "gpu1"], "coordinator_port": 9000},
        {"name": "gen0", "role": "generation", "hosts": ["gpu2"]},
    ]
}


def test_topology_round_trip_and_process_env_drives_distributed():
    topo = Topology.from_json(HOST_TOPOLOGY)
    assert Topology.from_json(topo.to_json()) == topo
    assert topo.learner.name == "learner" and [p.name for p in topo.generation] == ["gen0"]
    program, pid = topo.locate("gpu1")
    assert (program.name, pid) == ("learner", 1)
    env = topo.process_env("learner", 1)
    plan = plan_distributed(env)
    assert plan.kind is DistributedKind.EXPLICIT
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == ("gpu0:9000", 2, 1)
    assert env["JAXFLASH_ROLE"] == "learner" and env["JAXFLASH_PROGRAM"] == "learner"
    assert plan_distributed(topo.process_env("gen0", 0)).num_processes == 1
    tpu = Topology.from_json(TPU_TOPOLOGY)
    assert plan_distributed(tpu.process_env("gen1")).kind is DistributedKind.TPU


@pytest.mark.parametrize(
    "programs,match",
    [
        ([{"name": "a", "role": "learner", "tpu": "x"}], "at least one generation"),
        ([{"name": "a", "role": "generation", "tpu": "x"}], "exactly one learner"),
        ([{"name": "a", "role": "learner", "tpu": "x"}, {"name": "b", "role": "generation",
          "tpu": "x"}], "tpu x is in programs 'a' and 'b'"),
        ([{"name": "a", "role": "learner", "hosts": ["h"]}, {"name": "b", "role": "generation",
          "hosts": ["h"]}], "host h is in programs 'a' and 'b'"),
        ([{"name": "a", "role": "learner", "tpu": "x"}, {"name": "a", "role": "generation",
          "tpu": "y"}], "unique"),
        ([{"name": "a", "role": "trainer", "tpu": "x"}], "role 'trainer'"),
        ([{"name": "a", "role": "learner"}], "exactly one of 'tpu'"),
        ([{"name": "a", "role": "learner", "tpu": "x", "hosts": ["h"]}], "exactly one of 'tpu'"),
        ([{"name": "a", "role": "learner", "hosts": ["h", "h"]}], "listed twice"),
        ([{"name": "a", "role": "learner", "hosts": ["h"], "coordinator_port": 0}], "1..65535"),
        ([{"name": "a", "role": "learner", "tpu": "x", "slots": 4}], r"unknown keys \['slots'\]"),
        ([{"role": "learner", "tpu": "x"}], r"missing keys \['name'\]"),
    ],
)  # fmt: skip
def test_topology_refuses_bad_assignments_by_name(programs, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_json({"programs": programs})


def test_unknown_program_and_process():
    topo = Topology.from_json(HOST_TOPOLOGY)
    with pytest.raises(KeyError, match="no program 'gen9'"):
        topo.process_env("gen9")
    with pytest.raises(ValueError, match="processes 0..1, not 2"):
        topo.process_env("learner", 2)
    with pytest.raises(ValueError, match="topology is"):
        Topology.from_json({"programs": [], "zone": "z"})
    assert ProgramSpec(name="g", role="generation", hosts=["a"]).hosts == ("a",)


def _gcloud(*args):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "launch", "gcloud.py"), *args],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_gcloud_prints_one_fanout_per_tpu_slice(tmp_path):
    cmd = ["python", "launch/tpu_pod.py", "--config", "configs/x.py", "--workdir", "gs://b/r 1"]
    (line,) = _gcloud("--tpu", "my-v5p", "--zone", "us-east5-a", "--project", "p", "--", *cmd)
    argv = shlex.split(line)
    assert argv[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p", "--zone=us-east5-a"]
    assert argv[7:9] == ["--project=p", "--worker=all"]
    remote = argv[9].removeprefix("--command=")
    assert remote.startswith("cd ~/jaxflash && JAXFLASH_DISTRIBUTED=tpu python launch/tpu_pod.py")
    assert shlex.split(remote.split("&& ", 1)[1])[1:] == cmd  # the command survives quoting
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(TPU_TOPOLOGY))
    lines = _gcloud("--topology", str(path), "--zone", "z", "--", *cmd)
    assert [shlex.split(x)[5] for x in lines] == ["rl-v5p-16", "rl-v5e-8-a", "rl-v5e-8-b"]
    assert "JAXFLASH_PROGRAM=gen1 JAXFLASH_ROLE=generation" in lines[2]
    path.write_text(json.dumps(HOST_TOPOLOGY))
    lines = _gcloud("--topology", str(path), "--zone", "z", "--", *cmd)
    assert lines[1].startswith("# on gpu1: JAXFLASH_DISTRIBUTED=env JAXFLASH_PROGRAM=learner")
    assert "JAX_COORDINATOR_ADDRESS=gpu0:9000" in lines[1] and "JAX_PROCESS_ID=1" in lines[1]
