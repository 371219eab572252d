"""Framed JSON messages and raw array bytes over a TCP socket (no pickle).

A frame is ``b"JFW1"``, a big-endian uint32 header length, then that many bytes
of UTF-8 JSON (an object). A header with ``"nbytes": n`` is followed by n raw
payload bytes (one array shard, C order). Errors travel as a header
``{"type": "error", "kind": <TransferErrorKind value>, "message": ...}`` and
come out on the other side as ``TransferError`` with the same ``kind``: callers
branch on the enum, never on message text.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from typing import Any

_MAGIC = b"JFW1"
_MAX_HEADER = 64 << 20  # a layout of ~100k leaves; anything larger is a corrupt stream


class TransferErrorKind(enum.Enum):
    """Why a transfer did not happen (the receiver keeps its weights in every case)."""

    LAYOUT_MISMATCH = "layout_mismatch"  # shapes/dtypes/shardings do not line up
    VERSION = "version"  # not newer than what the receiver holds, or the offer moved on
    NO_OFFER = "no_offer"  # the sender has nothing to send yet
    UNSUPPORTED = "unsupported"  # e.g. the sender runs no jax transfer server
    CONNECTION = "connection"  # peer unreachable, vanished or timed out mid-transfer
    PROTOCOL = "protocol"  # a malformed or unexpected message
    STALE_BASE = "stale_base"  # a delta refused: the receiver does not hold its base
    DIGEST = "digest"  # a delta's result differs from the sender's tensor


class TransferError(RuntimeError):
    """A refused or failed transfer.

    Attributes:
      kind: TransferErrorKind.
    """

    def __init__(self, kind: TransferErrorKind, message: str):
        super().__init__(f"[{kind.value}] {message}")
        self.kind = kind


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
      TransferError(CONNECTION): the peer closed the connection or timed out first.
    """
    got = 0
    try:
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise TransferError(
                    TransferErrorKind.CONNECTION,
                    f"peer closed the connection after {got} of {len(view)} bytes",
                )
            got += n
    except OSError as err:  # timeouts and resets
        raise TransferError(TransferErrorKind.CONNECTION, f"receive failed: {err!r}") from err


def send_message(sock: socket.socket, header: dict[str, Any], payload: Any = None) -> None:
    """Send one frame; ``payload`` (bytes-like) requires ``header["nbytes"] == len``.

    Raises:
      TransferError(CONNECTION): the send failed (peer gone, timeout).
    """
    if payload is not None:
        payload = memoryview(payload).cast("B")
        if header.get("nbytes") != len(payload):
            raise ValueError(f"send_message: nbytes={header.get('nbytes')} != {len(payload)}")
    body = json.dumps(header, separators=(",", ":")).encode()
    try:
        sock.sendall(_MAGIC + struct.pack(">I", len(body)) + body)
        if payload is not None:
            sock.sendall(payload)
    except OSError as err:
        raise TransferError(TransferErrorKind.CONNECTION, f"send failed: {err!r}") from err


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """Receive one frame's header (read the payload with ``recv_into``).

    Raises:
      TransferError: CONNECTION if the peer vanished; PROTOCOL for a bad frame;
        the peer's own kind if the header is an error message.
    """
    prefix = _recv_exact(sock, 8)
    if prefix[:4] != _MAGIC:
        raise TransferError(TransferErrorKind.PROTOCOL, f"bad frame magic {prefix[:4]!r}")
    (size,) = struct.unpack(">I", prefix[4:])
    if size > _MAX_HEADER:
        raise TransferError(TransferErrorKind.PROTOCOL, f"header of {size} bytes exceeds limit")
    try:
        header = json.loads(_recv_exact(sock, size))
    except ValueError as err:
        raise TransferError(TransferErrorKind.PROTOCOL, f"header is not JSON: {err}") from err
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise TransferError(TransferErrorKind.PROTOCOL, f"header without a type: {header!r}")
    if header["type"] == "error":
        try:
            kind = TransferErrorKind(header.get("kind"))
        except ValueError:
            kind = TransferErrorKind.PROTOCOL
        raise TransferError(kind, str(header.get("message", "")))
    return header


def expect(header: dict[str, Any], kind: str) -> dict[str, Any]:
    """``header`` if its type is ``kind``, else TransferError(PROTOCOL)."""
    if header.get("type") != kind:
        raise TransferError(
            TransferErrorKind.PROTOCOL, f"expected a {kind!r} message, got {header.get('type')!r}"
        )
    return header


def send_error(sock: socket.socket, kind: TransferErrorKind, message: str) -> None:
    """Tell the peer why its request was refused (best effort: it may be gone)."""
    try:
        send_message(sock, {"type": "error", "kind": kind.value, "message": message})
    except TransferError:
        pass


def parse_address(address: str) -> tuple[str, int]:
    """ "host:port" (IPv6 hosts in brackets) -> (host, port).

    Raises:
      ValueError: no port, or a port that is not an int in [1, 65535].
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} must be host:port")
    return host.strip("[]"), int(port)


def connect(address: str, timeout_s: float) -> socket.socket:
    """A TCP connection to ``address`` with ``timeout_s`` on every operation.

    Raises:
      TransferError(CONNECTION): the peer is not reachable.
    """
    try:
        sock = socket.create_connection(parse_address(address), timeout=timeout_s)
    except OSError as err:
        raise TransferError(
            TransferErrorKind.CONNECTION, f"cannot reach {address}: {err!r}"
        ) from err
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
