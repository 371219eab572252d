"""Ctrl-C for the RL loop: the first SIGINT stops the run as SIGTERM does, keeping its work.

Python's default turns SIGINT into a ``KeyboardInterrupt`` wherever the main
thread happens to be, e.g. inside a library holding a lock (tensorboardX's event
queue, taken in ``add_scalar``, stayed locked and its ``close`` then waited for
ever). While the loop runs, ``DeferredInterrupt`` only records the first SIGINT
and says so on stderr; the loop calls ``check`` where stopping is safe (between
its phases and every wait slice of ``RolloutScheduler.next_batch``), which raises
``Interrupted`` (a ``KeyboardInterrupt``) there. Like a SIGTERM, a first Ctrl-C
never throws a trained step away: the loop checks before an update (a step not yet
trained is generated again on resume), and once an update ran it finishes the step
and saves it; a stop in a wait saves the last trained step unless it is on disk
(a terminal Ctrl-C during step 1's generation used to train for 34 s and then exit
unsaved). The loop's ``finally`` shuts everything down in order and the launcher
exits with status 130. A second SIGINT interrupts at once (a plain
``KeyboardInterrupt``, nothing saved), for a shutdown that itself hangs -- possibly
in the middle of a checkpoint write, which is then abandoned: ``interrupted_message``
reads the checkpoint directory as left and says which step a resume starts from.

SIGTERM (preemption; one learner process: ``LearnerProgram`` records it) must not
wait for a long rollout or an evaluation: a TPU VM's notice is about 30 s.
``check_stop`` raises ``Preempted`` for it where the loop waits (each wait slice of
the rollout, each decode step of an evaluation); the loop then saves the last
trained step unless it is on disk, and stops (``runtime.loop``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from jaxflash.checkpoint.storage import steps_on_disk


class Preempted(Exception):  # noqa: N818 (a stop, not an error)
    """SIGTERM arrived: raised by ``DeferredInterrupt.check_stop`` where a wait can end."""


class Interrupted(KeyboardInterrupt):
    """The first Ctrl-C, raised by ``DeferredInterrupt.check`` at a safe point: the loop
    saves the last trained step, as for ``Preempted``, and lets it through (exit 130)."""


class DeferredInterrupt:
    """SIGINT recorded by a handler, raised as ``Interrupted`` by ``check``.

    ``install`` puts the handler in place (main thread only; elsewhere nothing is
    installed and ``check`` never raises); ``restore`` puts the previous one back.
    ``preempted()`` says whether a SIGTERM arrived (``check_stop``); None: never.
    """

    def __init__(self, preempted: Callable[[], bool] | None = None) -> None:
        self._preempted = preempted
        self._requested = threading.Event()
        self._previous: Any = None
        self._installed = False

    def install(self) -> DeferredInterrupt:
        """Handle SIGINT here from now on (a no-op outside the main thread); returns self."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def restore(self) -> None:
        """Put the previous SIGINT handler back (idempotent)."""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    @property
    def requested(self) -> bool:
        """Whether a SIGINT arrived."""
        return self._requested.is_set()

    def check(self) -> None:
        """Raise ``Interrupted`` if a SIGINT arrived (call where stopping is safe).

        Raises:
          Interrupted: a SIGINT arrived since the handler was installed.
        """
        if self._requested.is_set():
            raise Interrupted

    def check_stop(self) -> None:
        """``check``, and raise ``Preempted`` if a SIGTERM arrived (call in waits).

        Raises:
          Interrupted: a SIGINT arrived. Preempted: a SIGTERM arrived.
        """
        self.check()
        if self._preempted is not None and self._preempted():
            raise Preempted

    def _on_sigint(self, signum: int, frame: Any) -> None:
        del signum, frame
        self._requested.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second one: at once
        # os.write, not print: the interrupted code may hold the stderr buffer's lock.
        os.write(
            2,
            b"\nCtrl-C: stopping at the next safe point, keeping the last trained step "
            b"(Ctrl-C again: at once)\n",
        )


def interrupted_message(workdir: str, total_steps: int | None = None) -> str:
    """The launcher's last line after a Ctrl-C: where running the command again starts.

    Read from ``<workdir>/checkpoints`` as the interrupted run left it: the newest
    complete checkpoint is where a resume starts; a later step whose write never
    committed (a second Ctrl-C during the write) is named as abandoned. A run whose last
    step (``total_steps``) is saved is finished: running the command again only says so,
    and does not score an evaluation the Ctrl-C stopped (issue 31: the line promised a
    resume "from step 1" of a 1-step run whose final evaluation was never scored).
    """
    complete, unfinished = steps_on_disk(os.path.join(workdir, "checkpoints"))
    last = complete[-1] if complete else None
    abandoned = [s for s in unfinished if last is None or s > last]
    lost = (
        f"the checkpoint of step {abandoned[-1]} was being written and is abandoned; "
        if abandoned
        else ""
    )
    if last is None:
        return (
            f"interrupted: {lost}{workdir} has no complete checkpoint: running the same "
            "command again starts it from the beginning"
        )
    if total_steps is not None and last >= total_steps:
        return (
            f"interrupted: {lost}{workdir} is finished (its last step, {last}, is saved); "
            "an evaluation the Ctrl-C stopped was not scored, and running the same command "
            "again will not score it: it only says the run is finished"
        )
    return (
        f"interrupted: {lost}run the same command again to resume {workdir} from step "
        f"{last}, its last complete checkpoint"
    )
