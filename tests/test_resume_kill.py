"""SIGKILL a run in the middle of a checkpoint write, restart it, and compare with a
run that was never interrupted: same steps, same data, same sampled tokens."""

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
            sys.executable,
            os.path.join(REPO, "launch", "tpu_pod.py"),
            "--config",
            os.path.join(REPO, "configs", "smoke.py"),
            "--workdir",
            workdir,
            f"--config.total_steps={STEPS}",
            "--config.eval.every=100",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _rollouts(workdir: str) -> list[tuple]:
    rows = [json.loads(x) for x in open(os.path.join(workdir, "rollouts.jsonl"))]
    return sorted(
        (r["learner_step"], r["prompt_id"], r["sample_index"], r["response"]) for r in rows
    )


def _kill_during_checkpoint_write(workdir: str, proc: subprocess.Popen, min_step: int) -> int:
    """Polls the checkpoint directory; SIGKILLs when a save of step >= min_step is in progress."""
    ckpt = os.path.join(workdir, "checkpoints")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before it could be killed:\n{proc.stdout.read()}")
        names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
        for name in names:
            if name.endswith("orbax-checkpoint-tmp") and int(name.split(".")[0]) >= min_step:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return int(name.split(".")[0])
        time.sleep(0.002)
    raise AssertionError("no checkpoint write seen within 600 s")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigkill_during_checkpoint_write_resumes_exactly(tmp_path):
    reference = str(tmp_path / "reference")
    proc = _launch(reference)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out

    killed = str(tmp_path / "killed")
    proc = _launch(killed)
    step_being_written = _kill_during_checkpoint_write(killed, proc, min_step=2)
    # The half-written step is not a checkpoint; the previous one is.
    complete = sorted(
        int(n) for n in os.listdir(os.path.join(killed, "checkpoints")) if n.isdigit()
    )
    assert step_being_written not in complete
    proc = _launch(killed)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert f"resumed from step {complete[-1]}" in out

    rows = [json.loads(x) for x in open(os.path.join(killed, "metrics.jsonl"))]
    assert [r["step"] for r in rows if r["step"] > 0] == list(range(1, STEPS + 1))
    ref_rows = [json.loads(x) for x in open(os.path.join(reference, "metrics.jsonl"))]
    for key in ("prompts_taken", "prompts_trained", "prompts_failed", "loss", "reward_mean"):
        assert [r.get(key) for r in rows if r["step"] > 0] == [
            r.get(key) for r in ref_rows if r["step"] > 0
        ], key
    # Same prompts, same sample indices, same sampled text at every step.
    assert _rollouts(killed) == _rollouts(reference)
