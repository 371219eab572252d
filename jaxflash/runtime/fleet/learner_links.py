"""The command channel of a multi-process learner: process 0 tells the others what to run.

A learner over several hosts is one SPMD JAX program: every process must issue
the same jitted computations (train step, resharding for a weight offer, a
checkpoint save) in the same order. Only process 0 runs the controller (the
scheduler, the reward workers, the generation clients), so it *posts* each
learner operation to the other processes before running it itself, and they
*follow* (``runtime.learner_program.follow``).

Transport: one TCP connection from each follower to process 0, framed as in
``sync.transfer_wire`` (JSON header + raw payload; no pickle), each command one
``rpc_wire`` message. Process 0's address reaches the followers through one
``broadcast_one_to_all`` collective at start (works wherever ``jax.distributed``
does, TPU metadata included), so no extra configuration is needed; followers
answer with a hello carrying their own ``WeightSender`` address.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import numpy as np

from jaxflash.runtime.fleet import rpc_wire
from jaxflash.sync.transfer_wire import (
    TransferError,
    connect,
    expect,
    recv_into,
    recv_message,
    send_message,
)

log = logging.getLogger(__name__)
_ADDRESS_BYTES = 256


def _broadcast_address(address: str) -> str:
    """Process 0's ``address`` on every process (one collective; all processes call it)."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    raw = address.encode().ljust(_ADDRESS_BYTES, b"\0")
    if len(raw) > _ADDRESS_BYTES:
        raise ValueError(f"address {address!r} longer than {_ADDRESS_BYTES} bytes")
    out = multihost_utils.broadcast_one_to_all(np.frombuffer(raw, np.uint8))
    return bytes(np.asarray(out)).rstrip(b"\0").decode()


def _send(sock: socket.socket, message: bytes) -> None:
    send_message(sock, {"type": "command", "nbytes": len(message)}, message)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    header = expect(recv_message(sock), "command")
    buf = bytearray(int(header["nbytes"]))
    recv_into(sock, memoryview(buf))
    return rpc_wire.decode(bytes(buf))


class LeaderLinks:
    """Process 0's end: a connection to every other process of its program.

    Used by a multi-process learner and by a generation program over several hosts
    (``runtime.fleet.gen_hosts``); ``post`` is thread-safe.

    Args:
      host: interface to listen on (reachable from the other learner hosts).
      timeout_s: how long to wait for every follower's hello.

    Raises:
      ConnectionError: not every follower connected within ``timeout_s``.
    """

    def __init__(self, *, host: str = "127.0.0.1", timeout_s: float = 300):
        import jax  # noqa: PLC0415

        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(timeout_s)
        _broadcast_address(f"{host}:{self._listener.getsockname()[1]}")
        self._socks: dict[int, socket.socket] = {}
        self._lock = threading.Lock()  # one message at a time on each connection
        self.follower_pids: dict[int, int] = {}  # process index -> its pid (diagnostics)
        senders: dict[int, str] = {}
        try:
            while len(self._socks) < jax.process_count() - 1:
                sock, _ = self._listener.accept()
                sock.settimeout(None)
                hello, _ = _recv(sock)
                self._socks[int(hello["process"])] = sock
                senders[int(hello["process"])] = str(hello["sender"])
                self.follower_pids[int(hello["process"])] = int(hello.get("pid", 0))
        except (OSError, TransferError) as err:
            raise ConnectionError(
                f"only {len(self._socks)} of {jax.process_count() - 1} learner processes "
                f"connected to process 0 within {timeout_s:g}s: {err!r}"
            ) from err
        # The other processes' WeightSender addresses, in process order ("" if none).
        self.follower_senders = tuple(senders[i] for i in sorted(senders))
        self._closed = False

    def post(self, op: str, arrays: dict[str, np.ndarray] | None = None, **fields: Any) -> None:
        """Send one command to every follower (before running it here).

        Raises:
          ConnectionError: a follower is gone (the learner program cannot go on
            without it: its collectives would hang).
        """
        message = rpc_wire.encode({"op": op, **fields}, arrays)
        with self._lock:
            for i, sock in sorted(self._socks.items()):
                try:
                    _send(sock, message)
                except TransferError as err:
                    raise ConnectionError(f"process {i} of the program is gone: {err}") from err

    @property
    def followers(self) -> tuple[int, ...]:
        """The other processes' indices, in order."""
        return tuple(sorted(self._socks))

    def read(self, process: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The next message follower ``process`` sent back (``FollowerLink.send``; blocks).

        One reader per follower at a time.

        Raises:
          ConnectionError: that process is gone.
        """
        try:
            return _recv(self._socks[process])
        except TransferError as err:
            raise ConnectionError(f"process {process} of the program is gone: {err}") from err

    def close(self) -> None:
        """Tell the followers to exit (if not told yet) and close the connections."""
        if self._closed:
            return
        self._closed = True
        try:
            self.post("exit")
        except ConnectionError as err:
            log.warning("could not tell every learner process to exit: %s", err)
        for sock in self._socks.values():
            sock.close()
        self._listener.close()

    def __enter__(self) -> LeaderLinks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FollowerLink:
    """A follower's end: connect to process 0 and read its commands in order.

    Args:
      sender_address: this process's ``WeightSender`` address, sent in the hello.
      timeout_s: connect timeout.
    """

    def __init__(self, *, sender_address: str = "", timeout_s: float = 300):
        import jax  # noqa: PLC0415

        address = _broadcast_address("")
        self._sock = connect(address, timeout_s)
        self._sock.settimeout(None)  # commands come when the controller has them
        hello = {"process": jax.process_index(), "sender": sender_address, "pid": os.getpid()}
        self._lock = threading.Lock()  # replies may come from several threads
        _send(self._sock, rpc_wire.encode(hello))

    def next(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The next command (blocks).

        Raises:
          ConnectionError: process 0 went away without saying exit.
        """
        try:
            return _recv(self._sock)
        except TransferError as err:
            raise ConnectionError(f"learner process 0 is gone: {err}") from err

    def send(self, op: str, arrays: dict[str, np.ndarray] | None = None, **fields: Any) -> None:
        """Send one message back to process 0 (``LeaderLinks.read``); thread-safe.

        Raises:
          ConnectionError: process 0 is gone.
        """
        message = rpc_wire.encode({"op": op, **fields}, arrays)
        with self._lock:
            try:
                _send(self._sock, message)
            except TransferError as err:
                raise ConnectionError(f"process 0 of the program is gone: {err}") from err

    def close(self) -> None:
        self._sock.close()
