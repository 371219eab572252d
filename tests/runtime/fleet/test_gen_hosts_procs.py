"""Generation programs over several hosts (``runtime.fleet.gen_hosts``), as processes on loopback.

Each generation program here is one ``jax.distributed`` job of 2 processes (1 fake
CPU device each, its engine's mesh tensor = 2 across both, gloo collectives), as
a 2-host TPU slice would run it: process 0 serves gRPC and tells process 1 what
to run; each process pulls its own shards of every version.

* Through ``launch/tpu_pod.py`` (``mesh.delta_publish=True`` for the 2-host program:
  deltas after its first full pull; full publishes for the one-process program): a
  2-process learner (3 fake devices each, fsdp 3 x tensor 2 across both) publishing to
  one 2-host generation program, against
  the same run with one learner process and a one-process generation program of
  the same mesh (tensor = 2 on 2 devices): α = 0, same prompts, sampled tokens and
  rewards, losses to float32 rounding (gloo may sum the learner's gradients in
  another order); every block each generation host installed has the SHA-256 of
  the block the learner staged for it (``learner_blocks.p<i>.jsonl``), the two
  hosts hold different halves of every sharded leaf, and both processes of the
  program have exited at the end.
* A SIGKILL of process 1 of a generation program that holds samples: process 0
  reports it down and exits, the controller re-routes its samples to the other
  program, restarts both processes and resyncs them; the run completes with
  every prompt accounted for.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from tests.proc_helpers import REPO, free_port

ARGS = [
    "--config", os.path.join(REPO, "configs", "smoke_async.py"),
    "--config.data.eval_size=0",
    "--config.rollout.async_ratio=0",  # deterministic: comparable between the two runs
    "--config.mesh.generation_processes=True",
    "--config.mesh.generation_digests=True",
    "--config.mesh.generation.tensor=2",
    "--config.mesh.num_generation_slices=1",
    "--config.total_steps=2",
]  # fmt: skip


def _launch(workdir, devices, extra, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **(env_extra or {}))
    return subprocess.Popen(
        ["timeout", "-k", "5", "800", sys.executable, os.path.join(REPO, "launch", "tpu_pod.py"),
         "--workdir", workdir, *ARGS, f"--config.mesh.num_cpu_devices={devices}", *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_host_generation_program_under_two_process_learner_equals_one_process(tmp_path):
    one = str(tmp_path / "one")
    out, _ = _launch(one, 8, []).communicate(timeout=900)
    assert "finished 2/2 steps" in out, out

    two, port = str(tmp_path / "two"), free_port()
    procs = [
        _launch(
            two,
            3,
            ["--config.mesh.generation_hosts=2", "--config.mesh.delta_publish=True"],
            {
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "finished 2/2 steps" in outs[0], outs[0]

    def by_key(workdir):
        rows = _rows(os.path.join(workdir, "rollouts.jsonl"))
        return {(r["learner_step"], r["prompt_id"], r["sample_index"]): r for r in rows}

    a, b = by_key(one), by_key(two)
    assert sorted(a) == sorted(b) and len(a) == 16
    for key, row in a.items():
        assert b[key]["response_tokens"] == row["response_tokens"], key
        assert b[key]["reward"] == row["reward"] and b[key]["staleness"] == 0, key
    for x, y in zip(
        _rows(os.path.join(one, "metrics.jsonl")),
        _rows(os.path.join(two, "metrics.jsonl")),
        strict=True,
    ):
        assert y["tokens"] == x["tokens"] and y["prompts_trained"] == x["prompts_trained"]
        for key in ("loss", "pg_loss", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (x["step"], key)

    # Per-shard weights: every block each host installed is the learner's, bit for bit.
    gen = os.path.join(two, "generation")
    staged: dict = {}
    for p in (0, 1):
        for r in _rows(os.path.join(gen, f"learner_blocks.p{p}.jsonl")):
            for key, digest in r["blocks"].items():
                staged.setdefault((r["version"], key), set()).add(digest)
    installed = [e for e in _rows(os.path.join(gen, "gen0.jsonl")) if e["event"] == "installed"]
    assert [e["version"] for e in installed] == [0, 1, 2]
    # Delta publish on for the 2-host program: version 0 is the full tree, versions 1
    # and 2 deltas (no fallback); the digests below are of the result.
    assert [e.get("pull_delta", 0) for e in installed] == [0, 1, 2], installed
    assert [e.get("pull_full", 0) for e in installed] == [1, 1, 1], installed
    for e in installed:
        host0, host1 = e["shard_digests"]
        for blocks in (host0, host1):
            assert blocks and all(staged[(e["version"], k)] == {d} for k, d in blocks.items()), e[
                "version"
            ]
        only0, only1 = set(host0) - set(host1), set(host1) - set(host0)
        assert only0 and only1  # the hosts hold different halves of the sharded leaves
    with open(os.path.join(gen, "gen0.log")) as f:
        pid0 = next(json.loads(x)["pid"] for x in f if '"listening"' in x)
    end = time.monotonic() + 30
    while time.monotonic() < end and _alive(pid0):
        time.sleep(0.1)
    assert not _alive(pid0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_one_generation_host_takes_its_program_down_and_recovers(tmp_path):
    from configs import smoke_async
    from jaxflash.runtime import loop as rlvr
    from jaxflash.runtime.config.experiment import ExperimentConfig
    from jaxflash.runtime.console import Console
    from jaxflash.runtime.fleet import rpc_wire

    workdir = str(tmp_path / "run")
    gen = os.path.join(workdir, "generation")
    killed: dict = {}

    def stats_of(address):
        with grpc.insecure_channel(address) as channel:
            stats = channel.unary_unary(f"/{rpc_wire.SERVICE}/Stats")
            return rpc_wire.reply_status(stats(rpc_wire.encode({}), timeout=10))

    def kill_host1_of_gen0_while_it_holds_samples():
        end = time.monotonic() + 600
        while time.monotonic() < end and not killed:
            log = os.path.join(gen, "gen0.jsonl")
            if not os.path.exists(log) or not any(e["event"] == "up" for e in _rows(log)):
                time.sleep(0.05)
                continue
            with open(os.path.join(gen, "gen0.log")) as f:
                address = next(json.loads(x)["address"] for x in f if '"listening"' in x)
            try:
                status, fields = stats_of(address)
            except grpc.RpcError:
                continue
            if status is rpc_wire.Status.OK and fields["stats"]["queued_or_running"] > 0:
                (pid,) = fields["program"]["host_pids"].values()
                os.kill(int(pid), signal.SIGKILL)
                killed.update(pid=int(pid), pid0=fields["program"]["pid"], t=time.time())
            time.sleep(0.005)

    def restarted_gen0_delivered() -> bool:
        with open(os.path.join(gen, "gen0.log")) as f:
            lines = [json.loads(x) for x in f if '"listening"' in x]
        try:
            status, fields = stats_of(lines[-1]["address"]) if len(lines) > 1 else (None, {})
        except grpc.RpcError:
            return False
        return status is rpc_wire.Status.OK and fields["stats"]["delivered"] > 0

    class WaitForRecovery(Console):
        """Step 3 starts only once the restarted gen0 has served a sample (a restart
        compiles its engine again, longer than a tiny step here)."""

        def background(self, label):
            if label == "step 3/4":
                end = time.monotonic() + 600
                while time.monotonic() < end and not restarted_gen0_delivered():
                    time.sleep(0.2)
            super().background(label)

    c = smoke_async.get_config()  # learner fsdp 3 x tensor 2 here; 2 programs of 2 hosts
    c.total_steps, c.data.eval_size, c.rollout.async_ratio = 4, 0, 2
    c.rollout.max_new_tokens = 32  # each sample holds a slot long enough to be seen
    c.checkpoint.every = 1
    c.mesh.generation_processes = True
    c.mesh.generation.tensor = 2
    c.mesh.generation_hosts = 2
    exp = ExperimentConfig.from_config_dict(c)
    killer = threading.Thread(target=kill_host1_of_gen0_while_it_holds_samples, daemon=True)
    killer.start()
    last = rlvr.run(exp, workdir=workdir, console=WaitForRecovery(None))
    killer.join(1)
    assert killed, "gen0 never held a sample"

    ends = ("prompts_trained", "prompts_filtered", "prompts_stale", "prompts_failed")
    assert last["prompts_taken"] == sum(last[k] for k in ends) + last["prompts_in_flight"]
    assert last["policy_version"] == 4
    assert last["prompts_trained"] == 4 * exp.rollout.prompts_per_step
    assert last.get("server_failures", 0) == 1 and last.get("server_recoveries", 0) == 1
    assert last.get("samples_rerouted", 0) >= 1
    events = _rows(os.path.join(gen, "gen0.jsonl"))
    died = [e for e in events if e["event"] == "died"]
    ups = [e for e in events if e["event"] == "up"]
    assert len(died) == 1 and len(ups) == 2 and ups[1]["pid"] != killed["pid0"]
    assert died[0]["t"] - killed["t"] < 30.0  # process 0 reports its lost host at once
    assert not _alive(killed["pid0"])  # a dead host is a dead program
    installed = [e for e in events if e["event"] == "installed"]
    after = [e["version"] for e in installed if e["t"] >= died[0]["t"]]
    assert after and after[-1] == 4 and after == sorted(after)  # resynced, then followed
    stopped = [e for e in events if e["event"] == "stopped"]
    assert stopped[-1]["delivered"] > died[0]["delivered"]  # the restarted program served
