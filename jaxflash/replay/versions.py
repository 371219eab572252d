"""The learner's published policy version: a counter that only goes up.

The learner publishes version v+1 after each optimizer step; generators stamp every
token with the version that sampled it, and the staleness gate
(`jaxflash.replay.staleness`) compares those stamps with the published version.
A version that goes backwards (e.g. a checkpoint restored into a running job, or two
learners publishing) would make old samples look fresh, so `publish` refuses it
loudly instead ("Versions only go up", tests/replay/test_staleness.py).

This module holds a lock but starts no threads (threads live in `jaxflash.runtime`).

References: ROLL Flash, arXiv 2510.11345 (per-sample staleness bound, async ratio).
"""

from __future__ import annotations

import threading

from jaxflash.types import PolicyVersion


def _check_version(name: str, version: object) -> int:
    # bool is an int subclass; True as a version is always a bug.
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"{name} must be an int policy version, got {version!r}")
    if version < 0:
        raise ValueError(f"{name} must be >= 0, got {version}")
    return int(version)


class PolicyClock:
    """Thread-safe holder of the learner's latest published policy version.

    Args:
      initial: version of the weights the run starts from (0 = initial weights, or
        the step restored from a checkpoint).

    Raises:
      TypeError / ValueError: `initial` is not a non-negative int.
    """

    def __init__(self, initial: PolicyVersion = 0) -> None:
        self._version = _check_version("PolicyClock initial version", initial)
        self._lock = threading.Lock()

    @property
    def version(self) -> PolicyVersion:
        """The latest published version (a consistent read from any thread)."""
        with self._lock:
            return self._version

    def publish(self, version: PolicyVersion) -> None:
        """Publish a new learner version.

        Args:
          version: the new version; must be strictly greater than the current one.

        Raises:
          ValueError: `version` does not increase (the message names both versions).
          TypeError: `version` is not an int.
        """
        version = _check_version("published version", version)
        with self._lock:
            if version <= self._version:
                raise ValueError(
                    f"policy versions only go up: cannot publish version {version} "
                    f"after version {self._version}"
                )
            self._version = version

    def __repr__(self) -> str:
        return f"PolicyClock(version={self.version})"
