"""What is wrong with a checkpoint directory after a failed write (no message parsing).

Orbax reports storage failures in whatever form its backend produces: an
``OSError`` from a directory operation, a TensorStore ``ValueError`` from an array
write, wrapped or not. Rather than read their text, ``diagnose`` asks the file
system itself, after the failure: is the mount read-only (``statvfs``), is there
room for the checkpoint (free bytes vs the state's size), can a small probe file
be written and synced (its ``errno``)? If all is well the fault was transient and
a retry can succeed.
"""

from __future__ import annotations

import enum
import errno
import os


class StorageFault(enum.Enum):
    """Why a checkpoint write failed, as seen from the directory afterwards."""

    READ_ONLY = "read_only"  # the file system is mounted read-only (or EROFS)
    NO_SPACE = "no_space"  # fewer free bytes than the checkpoint needs (or ENOSPC/EDQUOT)
    PERMISSION = "permission"  # EACCES / EPERM on a probe write
    IO_ERROR = "io_error"  # any other errno on a probe write
    TRANSIENT = "transient"  # the directory looks healthy now: retrying may succeed

    @property
    def permanent(self) -> bool:
        """Retrying without outside help cannot succeed."""
        return self is not StorageFault.TRANSIENT


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written; earlier checkpoints are untouched.

    Attributes:
      path: the checkpoint directory.
      step: the step whose save failed.
      fault: StorageFault.
      previous_step: newest complete checkpoint on disk, or None.
      attempts: how many times the write was tried.
    """

    def __init__(
        self,
        *,
        path: str,
        step: int,
        fault: StorageFault,
        previous_step: int | None,
        attempts: int,
        detail: str,
    ):
        kept = (
            "no earlier checkpoint exists"
            if previous_step is None
            else f"the previous checkpoint (step {previous_step}) is intact"
        )
        super().__init__(
            f"checkpoint of step {step} could not be written to {path}: {fault.value} "
            f"after {attempts} attempt(s) ({detail}); {kept}"
        )
        self.path, self.step, self.fault = path, step, fault
        self.previous_step, self.attempts = previous_step, attempts


_ERRNO_FAULTS = {
    errno.EROFS: StorageFault.READ_ONLY,
    errno.ENOSPC: StorageFault.NO_SPACE,
    errno.EDQUOT: StorageFault.NO_SPACE,
    errno.EACCES: StorageFault.PERMISSION,
    errno.EPERM: StorageFault.PERMISSION,
}
_PROBE_BYTES = 4096


TMP_MARK = ".orbax-checkpoint-tmp"
"""Orbax writes step N into ``N.orbax-checkpoint-tmp...`` and renames it ``N`` when
complete (the commit); the name alone says whether a step's checkpoint is complete."""


def steps_on_disk(path: str) -> tuple[list[int], list[int]]:
    """(complete steps, steps whose write never committed) in checkpoint directory
    ``path``, ascending, read from the names alone (no Orbax, no jax; [] if absent).

    An uncommitted step's temporary directory is what a kill or a second Ctrl-C
    during the write leaves; the next start deletes it and resumes from the newest
    complete step.
    """
    if not os.path.isdir(path):
        return [], []
    complete, unfinished = set(), set()
    for name in os.listdir(path):
        step, mark, _ = name.partition(TMP_MARK)
        if step.isdigit():
            (unfinished if mark else complete).add(int(step))
    return sorted(complete), sorted(unfinished - complete)


def _existing(path: str) -> str:
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def diagnose(path: str, *, need_bytes: int = 0) -> StorageFault:
    """Classify the state of checkpoint directory ``path`` after a failed write.

    Args:
      path: the checkpoint directory (its nearest existing parent is probed if
        it is gone).
      need_bytes: bytes the failed checkpoint needs (e.g. the state's size);
        less free space than that is NO_SPACE even if a small probe fits.

    Returns:
      READ_ONLY, NO_SPACE, PERMISSION or IO_ERROR when the directory cannot
      take the checkpoint now; TRANSIENT when it can.
    """
    where = _existing(path)
    st = os.statvfs(where)
    if st.f_flag & os.ST_RDONLY:
        return StorageFault.READ_ONLY
    if need_bytes and st.f_bavail * st.f_frsize < need_bytes:
        return StorageFault.NO_SPACE
    probe = os.path.join(where, f".jaxflash-write-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * _PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        return _ERRNO_FAULTS.get(err.errno, StorageFault.IO_ERROR)
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass
    return StorageFault.TRANSIENT
