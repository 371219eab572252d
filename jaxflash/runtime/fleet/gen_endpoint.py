"""Reaching a generation program: start it (or find it), connect, configure, call.

Two kinds of endpoint:

- ``LocalProgram``: a child process this controller starts (and restarts) on this
  machine: ``python -m jaxflash.runtime.fleet.gen_process`` with its own fake CPU
  devices, told to exit if the controller dies (``--parent_pid``). Its stdout and
  stderr go to a log file, which also carries the "listening" line with its port.
- ``FixedProgram``: a program someone else started (on a pod, the generation
  host's ``launch/tpu_pod.py``), at a fixed ``host:port``. A restart there is the
  host's business; the controller reconnects when it answers again.

``ProgramClient`` holds the gRPC channel to one program: ``connect`` (wait until
it answers, send ``Configure``, read back the receiver's weight layout), the
unary calls, and the event stream.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

import jaxflash
from jaxflash.runtime.fleet import rpc_wire
from jaxflash.runtime.fleet.rpc_wire import Status

# Variables that would make a generation program join the learner's jax.distributed
# job (or think it is a learner) if inherited; and the controller's failpoint.
_LEARNER_ENV = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXFLASH_DISTRIBUTED",
    "JAXFLASH_ROLE", "JAXFLASH_PROGRAM", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
    "JAXFLASH_FAILPOINT",
)  # fmt: skip


class ProgramUnavailableError(ConnectionError):
    """A generation program did not start, answer or accept its configuration in time."""


class LocalProgram:
    """A generation program started by this controller as child processes.

    Args:
      name: for the log file and errors.
      devices: fake CPU devices of the program (its generation mesh's size).
      log_path: process 0's stdout + stderr (its "listening" line is read from
        here); process i > 0 logs to ``<log_path>.host<i>``.
      host: interface it listens on.
      processes: hosts of the program: with more than one, one ``jax.distributed``
        job of that many processes on loopback (``devices / processes`` each, a
        fresh coordinator port per launch), as a multi-host slice would run it.
    """

    restartable = True

    def __init__(
        self,
        name: str,
        *,
        devices: int,
        log_path: str,
        host: str = "127.0.0.1",
        processes: int = 1,
    ):
        if processes < 1 or devices % processes:
            raise ValueError(
                f"generation program {name}: {devices} devices do not split over {processes} hosts"
            )
        self.name, self.devices, self.log_path, self.host = name, int(devices), log_path, host
        self.processes = int(processes)
        self._procs: list[subprocess.Popen] = []
        self._offset = 0  # where this incarnation's lines start in the log

    def launch(self) -> None:
        """Start the children (non-blocking; ``address`` waits for process 0 to listen)."""
        env = {k: v for k, v in os.environ.items() if k not in _LEARNER_ENV}
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={self.devices // self.processes}")
        env["XLA_FLAGS"] = " ".join(flags)
        # The checkout that holds this jaxflash (not a directory level counted from here).
        root = os.path.dirname(os.path.dirname(os.path.abspath(jaxflash.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        if self.processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"{self.host}:{_free_port(self.host)}",
                       JAX_NUM_PROCESSES=str(self.processes))  # fmt: skip
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        self._procs = []
        for i in range(self.processes):
            if self.processes > 1:
                env["JAX_PROCESS_ID"] = str(i)
            path = self.log_path if i == 0 else f"{self.log_path}.host{i}"
            with open(path, "ab") as log:
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "jaxflash.runtime.fleet.gen_process", "--host",
                     self.host, "--port", "0", "--parent_pid", str(os.getpid())],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    # Its own process group: a terminal's Ctrl-C (SIGINT to the foreground
                    # group) reaches the controller only, which shuts the program down.
                    process_group=0,
                ))  # fmt: skip

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._procs[0] if self._procs else None

    @property
    def pid(self) -> int | None:
        """Process 0's pid (the one that speaks for the program)."""
        return None if self._proc is None else self._proc.pid

    def address(self, timeout_s: float) -> str:
        """The child's "host:port" once it listens.

        Raises:
          ProgramUnavailableError: it exited or did not listen within ``timeout_s``
            (the message holds the end of its log).
        """
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for line in self._log_lines():
                if line.startswith("{") and '"listening"' in line:
                    return json.loads(line)["address"]
            if self._proc is None or self._proc.poll() is not None:
                break
            time.sleep(0.05)
        code = None if self._proc is None else self._proc.poll()
        raise ProgramUnavailableError(
            f"generation program {self.name}: not listening after {timeout_s:g}s (exit code "
            f"{code}); its log {self.log_path} ends:\n" + "\n".join(self._log_lines()[-20:])
        )

    def _log_lines(self) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                return f.read().decode(errors="replace").splitlines()
        except OSError:
            return []

    def alive(self) -> bool:
        """Every process of the program runs (a dead host is a dead program)."""
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def kill(self) -> None:
        """SIGKILL every process of the program (those running) and reap them."""
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self._procs:
            p.wait(30)


def _free_port(host: str) -> int:
    """A port free on ``host`` now (the coordinator of a multi-host program binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class FixedProgram:
    """A generation program at a fixed address, started by someone else (a pod host)."""

    restartable = False

    def __init__(self, name: str, address: str):
        self.name, self._address = name, address

    pid = None

    def launch(self) -> None:
        pass

    def address(self, timeout_s: float) -> str:
        del timeout_s
        return self._address

    def alive(self) -> bool:
        return True

    def kill(self) -> None:
        pass


class ProgramClient:
    """The gRPC channel to one generation program, configured.

    Args:
      endpoint: ``LocalProgram`` (launched here if not yet) or ``FixedProgram``.
      config: the ``Configure`` message (``gen_program`` lists its keys).
      connect_timeout_s: how long ``connect`` waits for the program to start,
        answer and build its engine.
      rpc_timeout_s: deadline of every unary call.

    Raises:
      ProgramUnavailableError: see ``connect``.
    """

    def __init__(
        self,
        endpoint: LocalProgram | FixedProgram,
        config: dict[str, Any],
        *,
        connect_timeout_s: float = 300.0,
        rpc_timeout_s: float = 30.0,
    ):
        self.endpoint, self.config = endpoint, dict(config)
        self.connect_timeout_s, self.rpc_timeout_s = connect_timeout_s, rpc_timeout_s
        self._channel: grpc.Channel | None = None
        self.layout: dict[str, Any] | None = None
        # LoRA: the digest of the base the program built (Configure's reply), and the
        # learner's (set by ``ProcessFleet`` at its first publish): a restarted program
        # whose base differs is refused at connect.
        self.base_digest: str | None = None
        self.expected_base_digest: str | None = None
        self.address = ""
        if isinstance(endpoint, LocalProgram) and not endpoint.alive():
            endpoint.launch()
        self.connect()

    @property
    def name(self) -> str:
        return self.endpoint.name

    def connect(self) -> dict[str, Any]:
        """Wait for the program, send ``Configure``; returns (and keeps) its weight layout.

        Raises:
          ProgramUnavailableError: no answer within ``connect_timeout_s``, or it refused
            the configuration (BAD_CONFIG, with its reason).
        """
        end = time.monotonic() + self.connect_timeout_s
        self.address = self.endpoint.address(self.connect_timeout_s)
        self.close_channel()
        self._channel = grpc.insecure_channel(self.address, options=rpc_wire.GRPC_OPTIONS)
        last: Exception | None = None
        while time.monotonic() < end:
            try:
                left = max(end - time.monotonic(), 0.1)
                grpc.channel_ready_future(self._channel).result(timeout=left)
                status, fields = self.call(
                    "Configure", rpc_wire.encode(self.config), timeout_s=end - time.monotonic()
                )
            except (grpc.FutureTimeoutError, grpc.RpcError) as err:
                last = err
                if not self.endpoint.alive():
                    break
                time.sleep(0.2)
                continue
            if status is not Status.OK:
                raise ProgramUnavailableError(
                    f"generation program {self.name} at {self.address} refused its "
                    f"configuration ({status.value}): {fields.get('error')}"
                )
            self.layout = fields["layout"]
            self.base_digest = fields.get("base_digest")
            self.check_base()
            return self.layout
        raise ProgramUnavailableError(
            f"generation program {self.name} at {self.address} did not answer Configure "
            f"within {self.connect_timeout_s:g}s: {last!r}"
        )

    def check_base(self) -> None:
        """Under LoRA: refuse a program whose frozen base is not the learner's.

        Raises:
          ProgramUnavailableError: the digests differ (naming both).
        """
        want, have = self.expected_base_digest, self.base_digest
        if want and have != want:
            raise ProgramUnavailableError(
                f"generation program {self.name} at {self.address} built a LoRA base with "
                f"digest {have}, but the learner's base has digest {want} (both build it "
                "from model.source/model.path or the seed: do they see the same file?)"
            )

    def call(
        self, method: str, message: bytes, *, timeout_s: float | None = None
    ) -> tuple[Status, dict[str, Any]]:
        """One unary call; (status, reply fields).

        Raises:
          grpc.RpcError: a transport fault (the program is gone or timed out).
          ProgramUnavailableError: the channel is closed.
        """
        if self._channel is None:
            raise ProgramUnavailableError(f"generation program {self.name}: not connected")
        stub = self._channel.unary_unary(f"/{rpc_wire.SERVICE}/{method}")
        raw = stub(message, timeout=self.rpc_timeout_s if timeout_s is None else timeout_s)
        return rpc_wire.reply_status(raw)

    def events(self) -> Any:
        """The event stream: an iterator of messages that is also a call (``cancel()``)."""
        if self._channel is None:
            raise ProgramUnavailableError(f"generation program {self.name}: not connected")
        stub = self._channel.unary_stream(f"/{rpc_wire.SERVICE}/Events")
        return stub(rpc_wire.encode({}))

    @staticmethod
    def decode_events(stream: Any) -> Iterator[tuple[dict[str, Any], dict[str, np.ndarray]]]:
        for message in stream:
            yield rpc_wire.decode(message)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the program to exit (best effort), then make sure a local one is gone."""
        try:
            if self._channel is not None:
                self.call("Shutdown", rpc_wire.encode({}), timeout_s=timeout_s)
        except grpc.RpcError:
            pass
        if isinstance(self.endpoint, LocalProgram):
            end = time.monotonic() + timeout_s
            while self.endpoint.alive() and time.monotonic() < end:
                time.sleep(0.05)
            self.endpoint.kill()
        self.close_channel()

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
