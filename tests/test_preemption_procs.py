"""SIGTERM (preemption) to a learner whose generation servers are separate processes.

The whole job runs as on a pod host: ``launch/tpu_pod.py`` is the learner program
(controller in its process) and starts one generation program per slice. The
learner gets SIGTERM after its first step: it finishes the step it is in, saves
it, shuts the generation programs down and exits 0. Run again with the same
workdir, it resumes from that step, and with α = 0 the resumed run equals a run
that was never interrupted: same prompts, same sampled tokens, same losses.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4


def _launch(workdir: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


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
def test_sigterm_saves_the_step_exits_cleanly_and_resumes_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    out, _ = _launch(reference).communicate(timeout=900)
    assert "finished 4/4 steps" in out, out

    run = str(tmp_path / "run")
    proc = _launch(run)
    metrics = os.path.join(run, "metrics.jsonl")
    end = time.monotonic() + 600
    while time.monotonic() < end and not (os.path.exists(metrics) and _rows(metrics)):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
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

    out, _ = _launch(run).communicate(timeout=900)
    assert f"resumed from step {saved[0]}" in out and "finished 4/4 steps" in out, out
    rows, ref = _rows(metrics), _rows(os.path.join(reference, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in ("prompts_taken", "prompts_trained", "prompts_failed", "loss", "grad_norm"):
        assert [r.get(key) for r in rows] == [r.get(key) for r in ref], key
    assert _rollouts(run) == _rollouts(reference)
