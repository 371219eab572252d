"""The pieces of a generation program over several hosts, in one process (cheap).

The processes themselves run in ``test_gen_hosts_procs.py``; here: the replayed
commands round-trip bit for bit, sender pairing, per-block digests and the
cross-host check that refuses misaligned blocks, the config and launcher
settings (``mesh.generation_hosts``, the 8B preset's layout and its fan-out).
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.specs import ConfigError, MeshSpec
from jaxflash.runtime.fleet.gen_endpoint import LocalProgram
from jaxflash.runtime.fleet.gen_hosts import (
    check_host_shards,
    decode_commands,
    encode_commands,
    paired,
    shard_digests,
)
from jaxflash.runtime.fleet.rpc_wire import decode, encode
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.roles import Topology
from jaxflash.sync.transfer_wire import TransferError, TransferErrorKind
from jaxflash.types import GenerationRequest, SamplingParams
from tests.proc_helpers import REPO


def test_replayed_commands_round_trip_through_the_wire():
    request = GenerationRequest(
        prompt_id=7, sample_index=1, prompt_tokens=np.array([5, 9, 2], np.int32),
        sampling=SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5), seed=3,
    )  # fmt: skip
    commands = [("submit", request), ("abort", [(7, 1), (8, 0)]), ("submit", request)]
    items, arrays = encode_commands(commands)
    header, back_arrays = decode(encode({"commands": items}, arrays))
    back = decode_commands(header["commands"], back_arrays)
    assert [k for k, _ in back] == ["submit", "abort", "submit"]
    assert back[1][1] == [(7, 1), (8, 0)]
    for got in (back[0][1], back[2][1]):
        assert dataclasses.replace(got, prompt_tokens=None) == dataclasses.replace(
            request, prompt_tokens=None
        )
        assert got.prompt_tokens.dtype == np.int32
        assert np.array_equal(got.prompt_tokens, request.prompt_tokens)


def test_host_i_prefers_learner_process_i():
    senders = ["a:1", "b:2", "c:3"]
    assert paired(senders, 0) == senders
    assert paired(senders, 1) == ["b:2", "c:3", "a:1"]
    assert paired(senders, 4) == ["b:2", "c:3", "a:1"]  # more hosts than learner processes
    assert paired(["a:1"], 1) == ["a:1"]


def test_shard_digests_name_every_block_once_and_match_the_bytes():
    import hashlib

    mesh = make_mesh(jax.devices()[:4], {"fsdp": 2, "tensor": 2})
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    tree = {
        "w": jax.device_put(x, NamedSharding(mesh, P("fsdp", None))),  # 2 blocks, 2 copies each
        "b": jax.device_put(x[0], NamedSharding(mesh, P())),  # replicated: 1 block
    }
    d = shard_digests(tree)
    assert sorted(d) == ["['b']@[[0, 6]]", "['w']@[[0, 4], [0, 6]]", "['w']@[[4, 8], [0, 6]]"]
    assert d["['w']@[[4, 8], [0, 6]]"] == hashlib.sha256(x[4:].tobytes()).hexdigest()


def test_cross_host_check_refuses_misaligned_blocks_and_failed_pulls():
    mesh = make_mesh(jax.devices()[:1], {"tensor": 1})
    params = {"b": jax.device_put(np.ones(3, np.float32), NamedSharding(mesh, P()))}
    mine = shard_digests(params)
    ok = {1: {"ok": True, "digests": {**mine, "['w']@[[4, 8]]": "00"}}}
    per_host = check_host_shards(params, ok, digests=True)
    assert per_host[0] == mine and "['w']@[[4, 8]]" in per_host[1]
    assert check_host_shards(params, ok, digests=False) is None
    bad = {1: {"ok": True, "digests": {"['b']@[[0, 3]]": "not the same bytes"}}}
    with pytest.raises(TransferError, match=r"block \['b'\]@\[\[0, 3\]\]: host 0 and host 1"):
        check_host_shards(params, bad, digests=True)
    failed = {1: {"ok": False, "kind": "connection", "error": "sender gone"}}
    with pytest.raises(TransferError, match="generation host 1: sender gone") as err:
        check_host_shards(params, failed, digests=True)
    assert err.value.kind is TransferErrorKind.CONNECTION


def test_generation_hosts_setting_is_checked_by_name():
    base = dict(colocated=False, generation_processes=True, generation={"tensor": 8})
    assert MeshSpec(**base, generation_hosts=2).generation_hosts == 2
    with pytest.raises(ConfigError, match="generation_hosts=3 must be >= 1 and divide the 8"):
        MeshSpec(**base, generation_hosts=3)
    with pytest.raises(ConfigError, match="mesh.generation_hosts=2.*only used with"):
        MeshSpec(colocated=False, generation={"tensor": 2}, generation_hosts=2)
    with pytest.raises(ValueError, match="4 devices do not split over 3 hosts"):
        LocalProgram("g", devices=4, log_path="unused", processes=3)


def test_the_8b_preset_runs_its_engines_as_two_host_programs_and_fans_out():
    from configs import tpu_llama3p1_8b_v5p

    exp = ExperimentConfig.from_config_dict(tpu_llama3p1_8b_v5p.get_config())
    m = exp.mesh
    assert m.generation_processes and m.num_generation_slices == 4
    assert dict(m.generation) == {"tensor": 8} and m.generation_hosts == 2  # 4 v5p chips a host
    # Its topology file: a v5p-64 learner and 4 v5p-16 engines (2 hosts each).
    path = os.path.join(REPO, "configs", "tpu_llama3p1_8b_v5p.topology.json")
    with open(path) as f:
        topology = Topology.from_json(json.load(f))
    assert [p.tpu for p in topology.generation] == [f"rl-gen-v5p-16-{i}" for i in range(4)]
    assert str(path).removeprefix(REPO + "/") in tpu_llama3p1_8b_v5p.__doc__
    command = ["python", "launch/tpu_pod.py", "--config", "configs/tpu_llama3p1_8b_v5p.py"]
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "launch", "gcloud.py"), "--topology", str(path),
         "--zone", "us-east5-a", "--", *command],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout.splitlines()  # fmt: skip
    gens = [x for x in out if "JAXFLASH_ROLE=generation" in x]
    assert len(out) == 5 and len(gens) == 4
    for i, line in enumerate(gens):  # every worker of each slice: one 2-host program each
        assert f"rl-gen-v5p-16-{i}" in line and "--worker=all" in line
        assert "JAXFLASH_DISTRIBUTED=tpu" in line and f"JAXFLASH_PROGRAM=gen{i}" in line


@pytest.mark.slow
def test_the_8b_preset_generation_hosts_start_as_the_fan_out_starts_them():
    """gen0's two hosts as its fan-out line starts them (``launch/tpu_pod.py`` with the
    preset, ``JAXFLASH_PROGRAM=gen0 JAXFLASH_ROLE=generation``; JAX_COORDINATOR_ADDRESS &
    co. in place of ``JAXFLASH_DISTRIBUTED=tpu``, CPU): one program -- process 0 prints
    "listening" only once process 1 joined it -- that a Shutdown stops with exit 0.
    (The 8B engine itself is built at the learner's Configure: not here.)"""
    import grpc

    from jaxflash.runtime.fleet import rpc_wire
    from tests.proc_helpers import free_port

    coord, port = free_port(), free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = []
    for i in range(2):
        env = dict(
            base, JAXFLASH_PROGRAM="gen0", JAXFLASH_ROLE="generation", JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{coord}", JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i), JAXFLASH_HOST="127.0.0.1",
            PYTHONPATH=REPO + os.pathsep + base.get("PYTHONPATH", ""),
        )  # fmt: skip
        command = [sys.executable, os.path.join(REPO, "launch", "tpu_pod.py"),
                   "--config", "configs/tpu_llama3p1_8b_v5p.py", "--port", str(port)]  # fmt: skip
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        procs.append(subprocess.Popen(command, env=env, cwd=REPO, text=True, **out))
    try:
        lines = []
        while not lines or '"listening"' not in lines[-1]:
            lines.append(procs[0].stdout.readline())
            assert lines[-1], f"process 0 ended before listening: {''.join(lines)}"
        assert json.loads(lines[-1])["address"] == f"127.0.0.1:{port}"
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = channel.unary_unary(f"/{rpc_wire.SERVICE}/Shutdown")
        assert rpc_wire.reply_status(stub(rpc_wire.encode({}), timeout=60))[0].value == "ok"
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
