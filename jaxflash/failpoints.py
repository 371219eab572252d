"""Failpoints: named places where a fault test makes this process SIGKILL itself.

    JAXFLASH_FAILPOINT=checkpoint_commit:2 python launch/tpu_pod.py --config ... --workdir W

kills the process with a real ``SIGKILL`` (no ``finally``, no ``atexit``, no flush
of anything not yet written) the 2nd time it reaches ``checkpoint_commit``; run
the same command again without the variable and the job must resume as if the
kill never happened (``tests/runtime/test_kill_campaign.py`` does that at 20+ seeded
points). The idea is etcd's gofail and TiKV's fail-rs: the fault happens at an
exact place in the code, not at a moment a poller happened to see.

Unset (every real run) a point costs one comparison. Generation programs
started by the controller do not inherit the variable (``gen_endpoint``): a
failpoint kills the controller's process, whose children then exit on their own.

Just before the kill one line goes to stderr, ``failpoint <point>:<n>: SIGKILL
(pid P)``, so a test can tell which point ended a run. This module imports
nothing from jaxflash: every layer may call ``reach``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

ENV = "JAXFLASH_FAILPOINT"

POINTS: dict[str, str] = {
    "rollout_scored": "a sample was scored and added to its group (mid rollout: some "
    "samples of the step are generated, nothing of it is trained)",
    "rollouts_write": "rollouts.jsonl is being appended: half of the step's rows and half "
    "of the next row are on disk (a torn last line)",
    "learner_step": "the jitted learner step returned: the state in memory is updated, "
    "nothing about the step is written",
    "weight_transfer": "weights are being published to an in-process generation mesh: "
    "staged on the learner's devices, not yet copied",
    "weight_send": "a generation program is pulling a version from this learner process: "
    "part of it sent (stream) or registered for its pull (jax transfer)",
    "metrics_written": "the step's metrics.jsonl row is on disk, its checkpoint is not",
    "checkpoint_write": "a checkpoint save was started: the arrays are copied off the "
    "devices, the background write into the step's temporary directory is running",
    "checkpoint_commit": "every byte of a checkpoint is written, the rename that commits "
    "it has not happened",
    "checkpoint_committed": "a checkpoint was just committed (renamed into place)",
}
"""Every failpoint: name -> where it is and what a kill there interrupts."""


def parse(spec: str) -> tuple[str, int] | None:
    """``"<point>:<n>"`` -> (point, n); "" -> None.

    Raises:
      ValueError: an unknown point or an n that is not an integer >= 1 (naming
        ``JAXFLASH_FAILPOINT`` and the points there are).
    """
    if not spec:
        return None
    point, _, count = spec.rpartition(":")
    if point not in POINTS or not count.isdigit() or int(count) < 1:
        raise ValueError(
            f"{ENV}={spec!r}: expected <point>:<n> with n >= 1 and point one of {sorted(POINTS)}"
        )
    return point, int(count)


_armed = parse(os.environ.get(ENV, ""))  # a bad value fails at import, before any work
_hits = 0
_lock = threading.Lock()


def armed() -> str | None:
    """The armed point's name (None: no failpoint is set, the normal case)."""
    return None if _armed is None else _armed[0]


def reach(point: str, before_kill: Callable[[], None] | None = None) -> None:
    """Count one arrival at ``point``; SIGKILL this process at the armed arrival.

    Args:
      point: a key of ``POINTS``.
      before_kill: run just before the kill (e.g. to put on disk what a kill at
        this point can leave there); only when the kill happens.

    Raises:
      ValueError: armed, and ``point`` is not a key of ``POINTS`` (a misspelt
        call site would otherwise never fire).
    """
    if _armed is None:
        return
    if point not in POINTS:
        raise ValueError(f"failpoints.reach: unknown point {point!r}; known: {sorted(POINTS)}")
    if point != _armed[0]:
        return
    global _hits
    with _lock:  # points are reached from several threads (pump, Orbax's writer)
        _hits += 1
        if _hits != _armed[1]:
            return
        sys.stderr.write(f"failpoint {point}:{_armed[1]}: SIGKILL (pid {os.getpid()})\n")
        sys.stderr.flush()
        if before_kill is not None:
            before_kill()
        os.kill(os.getpid(), signal.SIGKILL)
