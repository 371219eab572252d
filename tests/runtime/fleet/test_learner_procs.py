"""A learner program of 2 processes (``jax.distributed`` on loopback) + 2 generation programs.

Four processes, as on a pod with a 2-host learner: ``launch/tpu_pod.py`` twice
(process 0 runs the controller and posts every learner call to process 1, which
follows), each with 3 fake CPU devices, the learner mesh fsdp 3 x tensor 2 spanning
both; process 0 starts one generation program per slice, which pull every
version from BOTH learner processes' weight senders (each serves its own shards).
Compared with the same run by one learner process (6 of its 8 fake devices):
same prompts and sampled tokens, the same losses to float32 rounding (gloo
collectives may sum in another order), every version installed by both programs.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.proc_helpers import REPO, free_port

ARGS = [
    "--config", os.path.join(REPO, "configs", "smoke_async.py"),
    "--config.data.eval_size=0",
    "--config.rollout.async_ratio=0",  # deterministic: comparable between the two runs
    "--config.mesh.generation_processes=True",
]  # fmt: skip


def _launch(workdir, devices, env_extra=None, *, steps=2, checkpoint_every=1):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **(env_extra or {}))
    return subprocess.Popen(
        ["timeout", "-k", "5", "800", sys.executable, os.path.join(REPO, "launch", "tpu_pod.py"),
         "--workdir", workdir, *ARGS, f"--config.mesh.num_cpu_devices={devices}",
         f"--config.total_steps={steps}", f"--config.checkpoint.every={checkpoint_every}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_process_learner_with_generation_programs_matches_one_process(tmp_path):
    one = str(tmp_path / "one")
    out, _ = _launch(one, 8).communicate(timeout=900)
    assert "finished 2/2 steps" in out, out

    two = str(tmp_path / "two")
    port = free_port()
    procs = [
        _launch(
            two,
            3,
            {
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
        )
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
        assert b[key]["reward"] == row["reward"], key
    for x, y in zip(
        _rows(os.path.join(one, "metrics.jsonl")),
        _rows(os.path.join(two, "metrics.jsonl")),
        strict=True,
    ):
        assert y["tokens"] == x["tokens"] and y["prompts_trained"] == x["prompts_trained"]
        for key in ("loss", "pg_loss", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (x["step"], key)
    # Both generation programs installed every version, pulled from both learner
    # processes (a pull needs every sender's shards), and the checkpoints are complete.
    for name in ("gen0", "gen1"):
        events = _rows(os.path.join(two, "generation", f"{name}.jsonl"))
        assert [e["version"] for e in events if e["event"] == "installed"] == [0, 1, 2]
    assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["1", "2"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigterm_on_the_second_learner_host_saves_on_every_host_and_resumes(tmp_path):
    """Preemption of one learner host: JAX's preemption service spreads the notice,
    every process reaches the same sync step, saves it and exits 0; a restart of
    both resumes there and finishes."""
    run = str(tmp_path / "run")
    port = free_port()

    def launch():
        env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
        return [
            _launch(run, 3, {**env, "JAX_PROCESS_ID": str(i)}, steps=4, checkpoint_every=100)
            for i in range(2)
        ]

    procs = launch()
    metrics = os.path.join(run, "metrics.jsonl")
    end = time.monotonic() + 600
    while time.monotonic() < end and not (os.path.exists(metrics) and _rows(metrics)):
        assert all(p.poll() is None for p in procs), [p.stdout.read() for p in procs]
        time.sleep(0.05)
    steps_done = max(r["step"] for r in _rows(metrics))
    # To the learner process itself: ``timeout`` would pass SIGTERM on but SIGKILL it 5 s
    # later (its -k), before a preemption save could finish.
    with open(f"/proc/{procs[1].pid}/task/{procs[1].pid}/children") as f:
        (learner_pid,) = (int(p) for p in f.read().split())
    os.kill(learner_pid, signal.SIGTERM)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    saved = sorted(int(n) for n in os.listdir(os.path.join(run, "checkpoints")) if n.isdigit())
    assert len(saved) == 1 and steps_done <= saved[0] < 4, (steps_done, saved, outs[0])
    assert f"preempted (SIGTERM): saved step {saved[0]}" in outs[0], outs[0]

    procs = launch()
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert f"resumed from step {saved[0]}" in outs[0] and "finished 4/4 steps" in outs[0]
    rows = _rows(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    ends = ("prompts_trained", "prompts_filtered", "prompts_stale", "prompts_failed")
    assert last["prompts_taken"] == sum(last[k] for k in ends) + last["prompts_in_flight"]
    assert last["prompts_trained"] == 4 * 4  # 4 steps x 4 prompts, none lost or repeated
