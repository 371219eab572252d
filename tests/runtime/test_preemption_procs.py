"""SIGTERM (preemption) and SIGINT (Ctrl-C) to a learner whose generation servers are
separate processes.

The whole job runs as on a pod host: ``launch/tpu_pod.py`` is the learner program
(controller in its process) and starts one generation program per slice.

* SIGTERM after the first step: it stops at its next wait (or after the update it
  runs), saves the last trained step, shuts the generation programs down and exits 0.
* SIGINT to the job's process group after the first step (what a terminal's Ctrl-C
  does): it stops at its next safe point and exits 130 within a generous bound (a
  hang detector), without a traceback or gRPC errors, and leaves no process behind.

Run again with the same workdir, each resumes from its last checkpoint, and with
α = 0 the resumed run equals a run that was never interrupted (one reference run
for both): same prompts, same sampled tokens, same losses.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.kill_campaign import wait_gone
from tests.paths import REPO

STEPS = 4
HANG_S = 120  # far above a clean Ctrl-C (seconds); below it, the job is hung


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """XLA's persistent compilation cache, shared by every start in this module."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _launch(workdir: str, cache_dir: str, *extra: str, session: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    return subprocess.Popen(
        [
            sys.executable, os.path.join(REPO, "launch", "tpu_pod.py"),
            "--config", os.path.join(REPO, "configs", "smoke_async.py"),
            "--workdir", workdir,
            f"--config.total_steps={STEPS}",
            "--config.data.eval_size=0",
            "--config.rollout.async_ratio=0",  # deterministic: comparable to a reference run
            "--config.checkpoint.every=100",  # the only mid-run checkpoint is the preemption's
            "--config.mesh.generation_processes=True",
            *extra,
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=session,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> str:
    """An uninterrupted run of the same command."""
    workdir = str(tmp_path_factory.mktemp("reference") / "run")
    out, _ = _launch(workdir, cache_dir).communicate(timeout=900)
    assert "finished 4/4 steps" in out, out
    return workdir


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _rollouts(workdir):
    rows = _rows(os.path.join(workdir, "rollouts.jsonl"))
    return sorted(
        (r["learner_step"], r["prompt_id"], r["sample_index"], r["response"], r["reward"])
        for r in rows
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigterm_saves_the_step_exits_cleanly_and_resumes_exactly(tmp_path, reference, cache_dir):
    run = str(tmp_path / "run")
    proc = _launch(run, cache_dir)
    metrics = _wait_for_a_step(run, proc)
    steps_done = max(r["step"] for r in _rows(metrics))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    saved = sorted(int(n) for n in os.listdir(os.path.join(run, "checkpoints")) if n.isdigit())
    assert len(saved) == 1 and steps_done <= saved[0] < STEPS, (steps_done, saved)
    assert f"preempted (SIGTERM): saved step {saved[0]}" in out, out
    # The generation programs went down with it.
    gen_dir = os.path.join(run, "generation")
    pids = {
        e["pid"]
        for name in ("gen0.jsonl", "gen1.jsonl")
        for e in _rows(os.path.join(gen_dir, name))
        if e["event"] == "up"
    }
    assert len(pids) == 2 and not any(_alive(p) for p in pids)

    out, _ = _launch(run, cache_dir).communicate(timeout=900)
    assert f"resumed from step {saved[0]}" in out and "finished 4/4 steps" in out, out
    _assert_same_run(run, reference)


def _wait_for_a_step(run: str, proc: subprocess.Popen) -> str:
    """Wait until metrics.jsonl has a row; returns its path."""
    metrics = os.path.join(run, "metrics.jsonl")
    end = time.monotonic() + 600
    while time.monotonic() < end and not (os.path.exists(metrics) and _rows(metrics)):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    return metrics


def _assert_same_run(run: str, reference: str) -> None:
    rows = _rows(os.path.join(run, "metrics.jsonl"))
    ref = _rows(os.path.join(reference, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in ("prompts_taken", "prompts_trained", "prompts_failed", "loss", "grad_norm"):
        assert [r.get(key) for r in rows] == [r.get(key) for r in ref], key
    assert _rollouts(run) == _rollouts(reference)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ctrl_c_stops_promptly_and_quietly_and_resumes_exactly(tmp_path, reference, cache_dir):
    run = str(tmp_path / "run")
    every_step = "--config.checkpoint.every=1"  # so that the resume starts mid-run
    proc = _launch(run, cache_dir, every_step, session=True)
    _wait_for_a_step(run, proc)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground process group
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=HANG_S)
        print(f"exited {time.monotonic() - t0:.1f}s after Ctrl-C")
    except subprocess.TimeoutExpired:
        wait_gone(proc.pid, 0.0, kill=True)
        raise AssertionError(f"still running {HANG_S}s after Ctrl-C: hung") from None
    assert proc.returncode == 130, out
    assert "interrupted: " in out, out
    for noise in ("Traceback", "StatusCode", "is down", "died", "Error"):
        assert noise not in out, out  # quiet: a Ctrl-C is not a failure
    left = wait_gone(proc.pid, 30.0, kill=True)
    assert not left, f"processes {left} outlived the job"

    saved = sorted(int(n) for n in os.listdir(os.path.join(run, "checkpoints")) if n.isdigit())
    if saved:  # the exit line names the step the resume below starts from
        assert f"to resume {run} from step {saved[-1]}, its last complete checkpoint" in out
    else:
        assert f"{run} has no complete checkpoint" in out, out
    out, _ = _launch(run, cache_dir, every_step).communicate(timeout=900)
    assert "finished 4/4 steps" in out, out
    assert not saved or f"resumed from step {saved[-1]} of" in out, out
    _assert_same_run(run, reference)
