"""Failpoints (``jaxflash.failpoints``): a real SIGKILL at the n-th arrival, nothing else.

Each kill runs in a child process (the kill is real); the kill campaign
(tests/runtime/test_kill_campaign.py) drives the points inside the job itself.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from jaxflash import failpoints
from jaxflash.metrics.writer import truncate_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(code: str, spec: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if spec is not None:
        env[failpoints.ENV] = spec
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


ARRIVE_5_TIMES = """
from jaxflash import failpoints
for i in range(1, 6):
    failpoints.reach("metrics_written")  # another point: never counts
    print("before", i, flush=True)
    failpoints.reach("learner_step", before_kill=lambda: print("last words", flush=True))
print("survived", flush=True)
"""


def test_sigkill_at_the_nth_arrival_of_the_armed_point_only():
    out = _child(ARRIVE_5_TIMES, "learner_step:3")
    assert out.returncode == -signal.SIGKILL
    assert out.stdout.split("\n") == ["before 1", "before 2", "before 3", "last words", ""]
    assert "failpoint learner_step:3: SIGKILL (pid " in out.stderr


@pytest.mark.parametrize("spec", [None, "", "learner_step:6", "checkpoint_commit:1"])
def test_no_kill_when_unset_or_never_reached(spec):
    out = _child(ARRIVE_5_TIMES, spec)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("before 5\nsurvived\n") and "last words" not in out.stdout


@pytest.mark.parametrize("spec", ["learner_step", "learner_step:0", "learner_step:x", "nope:1"])
def test_a_bad_spec_is_refused_naming_the_variable(spec):
    with pytest.raises(ValueError, match="JAXFLASH_FAILPOINT"):
        failpoints.parse(spec)
    out = _child("import jaxflash.failpoints", spec)  # at import, before any work
    assert out.returncode == 1 and "JAXFLASH_FAILPOINT" in out.stderr


def test_the_launcher_says_a_bad_spec_in_one_line_and_exits_2(tmp_path):
    """Like any config error: one line, exit 2, no import traceback, no workdir."""
    env = {k: v for k, v in os.environ.items() if k not in (failpoints.ENV, "XLA_FLAGS")}
    env[failpoints.ENV] = "checkpoint_comit:1"
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "launch", "tpu_pod.py"),
            "--config",
            os.path.join(REPO, "configs", "smoke.py"),
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("config error: JAXFLASH_FAILPOINT='checkpoint_comit:1'")
    assert out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "w").exists()


def test_parse_and_armed():
    assert failpoints.parse("") is None
    assert failpoints.parse("weight_send:12") == ("weight_send", 12)
    assert failpoints.armed() is None  # the test process has none


def test_a_misspelt_point_fails_when_armed():
    code = "from jaxflash import failpoints\nfailpoints.reach('learner_stpe')"
    out = _child(code, "learner_step:1")
    assert out.returncode == 1 and "unknown point 'learner_stpe'" in out.stderr


def test_every_point_has_a_call_site_and_every_call_site_a_point():
    called = set()
    for root, _, files in os.walk(os.path.join(REPO, "jaxflash")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    called |= set(re.findall(r'failpoints\.reach\(\s*"(\w+)"', f.read()))
    assert called == set(failpoints.POINTS)


WRITE_ROLLOUTS = """
import sys
from jaxflash.metrics.writer import MetricsWriter
w = MetricsWriter(sys.argv[1])
w.write_rollouts([{"learner_step": 1, "i": i} for i in range(4)])
w.write_rollouts([{"learner_step": 2, "i": i, "text": "x" * 40} for i in range(8)])
"""


def test_a_kill_while_rollouts_are_written_leaves_a_torn_line_that_resume_drops(tmp_path):
    code = WRITE_ROLLOUTS.replace("sys.argv[1]", repr(str(tmp_path)))
    out = _child(code, "rollouts_write:2")
    assert out.returncode == -signal.SIGKILL
    path = tmp_path / "rollouts.jsonl"
    lines = path.read_text().split("\n")
    assert len(lines) == 4 + 4 + 1 and lines[-1].startswith('{"learner_step": 2, "i": 4')
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[-1])  # half of the fifth row of step 2
    assert truncate_jsonl(str(path), "learner_step", 1) == 5  # resume from step 1
    assert [json.loads(x)["learner_step"] for x in path.read_text().splitlines()] == [1] * 4
