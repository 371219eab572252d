"""A seeded SIGKILL campaign: kill one job again and again, restart it, check its books.

One workdir; the job (``launch/tpu_pod.py``, its own session so that its reward
workers and generation programs are found by session id) is started, killed at
the next point of a seeded plan, and started again with the same command, until
the plan is used up; a last start runs it to the end. A kill is either

* a failpoint (``jaxflash.failpoints``): ``JAXFLASH_FAILPOINT=<point>:<n>`` makes
  the job's process SIGKILL itself the n-th time it reaches ``point`` (its
  children must then exit on their own), or
* a time kill: SIGKILL to the whole session (every process of the job at once,
  as when a machine dies) a seeded delay after the start (imports, restore, set-up)
  or after the first step line (somewhere in the loop), for the places nobody named.

After every kill: the process died of SIGKILL at that point, and no process of
its session outlives it (a generation program or reward worker left behind is
an orphan). After every start that trained a step: it said it resumed from the
last checkpoint committed before it started. Restarts reuse XLA's persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR``), so each costs the imports, the
tokenizer and the model set-up, not the compiles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME = "time"  # the plan's name for a kill after a delay instead of at a failpoint


@dataclasses.dataclass(frozen=True)
class Kill:
    """One kill of the plan: at the n-th arrival at a failpoint, or ``delay_s`` after
    the start (``after_step`` False) or after the start's first step line."""

    point: str
    n: int = 0
    delay_s: float = 0.0
    after_step: bool = False

    def describe(self) -> str:
        if self.point != TIME:
            return f"{self.point}:{self.n}"
        return f"time {self.delay_s:.1f}s after {'a step' if self.after_step else 'start'}"


FIRST = ("rollouts_write", "metrics_written", "checkpoint_commit")
"""Failpoints that at n = 1 leave records of step 1 on disk and no checkpoint."""


def draw_plan(
    seed: int,
    caps: dict[str, int],
    *,
    kills: int,
    time_kills: int,
    time_window_s: tuple[float, float],
    step_window_s: tuple[float, float],
    each: int = 2,
) -> list[Kill]:
    """A seeded plan: every failpoint of ``caps`` ``each`` times, the rest drawn at random.

    The first kill is one of ``FIRST`` at n = 1: a fresh workdir holding rows of a
    start that never committed a checkpoint is a case of its own.

    Args:
      caps: failpoint -> the largest arrival n drawn for it (n is uniform in [1, cap]).
      kills: failpoint kills (the first included); time_kills: time kills, half
        after a delay uniform in ``time_window_s`` from the start, half uniform in
        ``step_window_s`` after the first step line.
    """
    rng = random.Random(seed)
    points = sorted(caps) * each
    points += [rng.choice(sorted(caps)) for _ in range(max(0, kills - 1 - len(points)))]
    plan = [Kill(p, rng.randint(1, caps[p])) for p in points]
    for i in range(time_kills):
        window = step_window_s if i % 2 else time_window_s
        plan.append(Kill(TIME, delay_s=round(rng.uniform(*window), 2), after_step=bool(i % 2)))
    rng.shuffle(plan)
    first = [p for p in FIRST if p in caps]
    return [Kill(rng.choice(first), 1), *plan] if first else plan


def committed_steps(workdir: str) -> list[int]:
    """Steps with a committed checkpoint (Orbax renames ``<step>.orbax-checkpoint-tmp``)."""
    directory = os.path.join(workdir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n) for n in names if n.isdigit())


def session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            out.append(int(name))
    return out


@dataclasses.dataclass
class Attempt:
    """One start of the job: how it was meant to end and how it did."""

    kill: Kill | None
    start_step: int  # last committed step when it started
    end_step: int  # last committed step after it ended
    returncode: int
    wall_s: float
    log: str


class Job:
    """One job command, started again and again with the same workdir.

    Args:
      config: config file under configs/; args: its overrides.
      workdir: the run directory every start shares.
      cache_dir: XLA's persistent compilation cache, shared with the reference run.
      limit_s: a start that runs longer is a hang (the campaign fails).
    """

    def __init__(
        self, config: str, args: list[str], workdir: str, cache_dir: str, limit_s: float = 600
    ):
        self.workdir, self.limit_s = workdir, limit_s
        self.argv = [
            sys.executable, os.path.join(REPO, "launch", "tpu_pod.py"),
            "--config", os.path.join(REPO, "configs", config), "--workdir", workdir, *args,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXFLASH_FAILPOINT")}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
        self.env = env
        self.attempts: list[Attempt] = []

    def start(self, kill: Kill | None = None) -> Attempt:
        """Run once (killed by ``kill``, or to the end); the ``Attempt`` it made."""
        env = dict(self.env)
        if kill is not None and kill.point != TIME:
            env["JAXFLASH_FAILPOINT"] = f"{kill.point}:{kill.n}"
        start_step = max(committed_steps(self.workdir), default=0)
        os.makedirs(os.path.dirname(self.workdir), exist_ok=True)
        log_path = os.path.join(os.path.dirname(self.workdir), f"attempt{len(self.attempts)}.log")
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                self.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                if kill is not None and kill.point == TIME:
                    if kill.after_step:
                        _wait_for_step_line(log_path, proc, self.limit_s)
                    try:
                        proc.wait(kill.delay_s)
                    except subprocess.TimeoutExpired:
                        _kill_session(proc.pid)  # the whole job at once
                proc.wait(self.limit_s)
                orphans = wait_gone(proc.pid, 60.0)
            finally:  # a hang or a failed check: take the whole job down
                if proc.poll() is None or session_processes(proc.pid):
                    _kill_session(proc.pid)
        with open(log_path) as f:
            text = f.read()
        attempt = Attempt(
            kill, start_step, max(committed_steps(self.workdir), default=0),
            proc.returncode, time.monotonic() - t0, text,
        )  # fmt: skip
        self.attempts.append(attempt)
        assert not orphans, f"processes {orphans} outlived the job ({describe(attempt)})"
        check_resumed(attempt)
        return attempt


def _kill_session(sid: int) -> None:
    """SIGKILL every live process of the session, its leader (the job) included
    (generation programs run in process groups of their own, so a killpg of the
    job's group would miss them)."""
    for pid in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_step_line(log_path: str, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < end:
        with open(log_path) as f:
            if any(line.startswith("step ") and " | elapsed" in line for line in f):
                return
        time.sleep(0.05)


def wait_gone(sid: int, timeout_s: float, *, kill: bool = False) -> list[int]:
    """Wait up to ``timeout_s`` for session ``sid`` to empty; the processes still there
    (SIGKILLed when ``kill``, so that a failed test leaves nothing running)."""
    end = time.monotonic() + timeout_s
    while (left := session_processes(sid)) and time.monotonic() < end:
        time.sleep(0.2)
    if left and kill:
        _kill_session(sid)
    return left


def describe(a: Attempt) -> str:
    what = "to the end" if a.kill is None else f"kill at {a.kill.describe()}"
    return (
        f"{what}: rc {a.returncode}, steps {a.start_step} -> {a.end_step}, {a.wall_s:.0f}s; "
        f"log ends:\n{a.log[-3000:]}"
    )


def check_resumed(a: Attempt) -> None:
    """A start that trained a step said it resumed from the last committed step."""
    if "step " not in a.log or " | elapsed" not in a.log:
        return  # killed before it trained anything
    line = f"resumed from step {a.start_step} of"
    if a.start_step:
        assert line in a.log, f"expected {line!r}: {describe(a)}"
    else:
        assert "resumed from step" not in a.log, describe(a)


def run_campaign(job: Job, plan: list[Kill], total_steps: int, arrivals) -> list[Attempt]:
    """Kill ``job`` at every point of ``plan`` in turn, then run it to the end.

    Args:
      arrivals: (point, remaining steps) -> how many arrivals at ``point`` a start
        with that many steps left surely makes before its last checkpoint
        commits; a drawn n above it is lowered to it (so every kill happens), and
        a point with none left (or a time kill with < 2 steps left) is replaced
        by ``learner_step`` at n = 1.

    Returns:
      Every attempt, the last one the run to the end.
    """
    for kill in plan:
        remaining = total_steps - max(committed_steps(job.workdir), default=0)
        assert remaining >= 1, f"the run finished before its plan did: {job.attempts}"
        if kill.point == TIME and remaining < (4 if kill.after_step else 2):
            kill = Kill("learner_step", 1)  # it could come after the run finished
        elif kill.point != TIME:
            n = min(kill.n, arrivals(kill.point, remaining))
            kill = Kill(kill.point, n) if n >= 1 else Kill("learner_step", 1)
        a = job.start(kill)
        assert a.returncode == -signal.SIGKILL, f"not killed: {describe(a)}"
        if kill.point != TIME:
            assert f"failpoint {kill.point}:{kill.n}: SIGKILL" in a.log, describe(a)
        assert a.end_step >= a.start_step, describe(a)  # a kill never loses a commit
    a = job.start(None)
    assert a.returncode == 0 and f"finished {total_steps}/{total_steps} steps" in a.log, describe(a)
    return job.attempts


def rows(path: str) -> list[dict]:
    """Every JSON line of a file (a line that does not parse fails the test)."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def summary(attempts: list[Attempt]) -> str:
    """One line per attempt, for the test's output."""
    return "\n".join(
        f"{i:2d} {('run to the end' if a.kill is None else a.kill.describe()):26s} "
        f"steps {a.start_step}->{a.end_step} {a.wall_s:5.1f}s"
        for i, a in enumerate(attempts)
    )


def final_ledger(workdir: str, step: int) -> dict:
    """The prompt ledger saved in the checkpoint of ``step``."""
    with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
        return json.load(f)["extra"]["ledger"]


def check_books(workdir: str, total_steps: int, group_size: int, max_in_flight: int) -> dict:
    """Nothing trained twice, nothing lost; returns the last metrics row.

    * metrics.jsonl has one row per step 1..total_steps, in order;
    * rollouts.jsonl has each (prompt, sample) at most once, each prompt at one
      learner step only, and every sample of every trained prompt;
    * the ledger of the last checkpoint balances: every prompt id below
      ``taken`` is trained (seen in rollouts.jsonl), in flight, or counted as
      filtered / stale / failed, and the metrics' counters say the same;
    * at most ``max_in_flight`` prompts are in flight at the end (the admission's
      capacity, (α + 1)·B): a prompt left open by a resume that forgot it would
      stay "in flight" for ever and pile up here.
    """
    metrics = [r for r in rows(os.path.join(workdir, "metrics.jsonl")) if r["step"] > 0]
    assert [r["step"] for r in metrics] == list(range(1, total_steps + 1))
    last = metrics[-1]
    # A stale group regenerated (stale_policy="regenerate") is written once as
    # "regenerated" and again when its new samples are used: count the latter only.
    rollouts = [
        r for r in rows(os.path.join(workdir, "rollouts.jsonl")) if r["outcome"] != "regenerated"
    ]
    keys = [(r["prompt_id"], r["sample_index"]) for r in rollouts]
    assert len(keys) == len(set(keys)), "a sample was written twice"
    step_of: dict[int, int] = {}
    for r in rollouts:
        assert step_of.setdefault(r["prompt_id"], r["learner_step"]) == r["learner_step"], r
    trained = {r["prompt_id"] for r in rollouts if r["outcome"] == "trained"}
    for pid in trained:
        got = sorted(i for p, i in keys if p == pid)
        assert got == list(range(group_size)), (pid, got)

    ledger = final_ledger(workdir, total_steps)
    counted = {kind: sum(v.values()) for kind, v in ledger["outcomes"].items()}
    open_ids = set(ledger["open_ids"])
    assert counted["trained"] == len(trained) and not trained & open_ids
    assert trained | open_ids <= set(range(ledger["taken"]))
    assert ledger["taken"] == sum(counted.values()) + len(open_ids)
    assert len(open_ids) <= max_in_flight, sorted(open_ids)
    assert last["prompts_taken"] == ledger["taken"]
    assert last["prompt_outcomes"] == ledger["outcomes"]
    for kind in ("trained", "filtered", "stale", "failed"):
        assert last[f"prompts_{kind}"] == counted[kind], kind
    return last
