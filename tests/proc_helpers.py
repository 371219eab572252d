"""Start real child processes for multi-process tests (loopback only).

Every child runs under ``timeout -k`` (JAX catches SIGTERM, so a plain terminate
may not end it; ``timeout`` escalates to SIGKILL) and prints JSON lines on
stdout that the test reads with a deadline.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port free on loopback right now (for addresses that must be known up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Child:
    """A child process whose stdout lines are JSON events."""

    def __init__(self, script: str, args: list[str], *, devices: int, limit_s: int = 240):
        cmd = ["timeout", "-k", "5", str(limit_s), sys.executable, script, *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=child_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._buf = b""
        self.events: list[dict] = []
        self.pid: int | None = None  # the python process (not ``timeout``), from its "hello"

    def next_event(self, kind: str, deadline_s: float = 180.0) -> dict:
        """Wait for the next event of type ``kind`` (earlier other events are kept).

        Reads the pipe with ``os.read`` and splits lines itself: a buffered
        ``readline`` can hold a complete line that ``select`` no longer sees.
        """
        end = time.monotonic() + deadline_s
        fd = self.proc.stdout.fileno()
        while time.monotonic() < end:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # library chatter on stdout
                self.events.append(event)
                if event.get("event") == "hello":
                    self.pid = int(event["pid"])
                if event.get("event") == kind:
                    return event
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self._buf += chunk
                    continue
            if self.proc.poll() is not None and not ready:
                break
            if ready and not chunk:  # EOF
                break
        raise AssertionError(
            f"no {kind!r} event (rc={self.proc.poll()}); events {self.events}; stderr:\n"
            + self.stderr_tail()
        )

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return (self.proc.stderr.read() or b"").decode(errors="replace")[-4000:]

    def sigkill(self) -> None:
        """SIGKILL the python process itself (not the ``timeout`` wrapper)."""
        assert self.pid is not None, "child has not said hello"
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)

    def wait(self, timeout_s: float = 120.0) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.pid is not None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait(30)


def emit(event: str, **fields) -> None:
    """Print one JSON event line (used by the child scripts)."""
    print(json.dumps({"event": event, **fields}), flush=True)
