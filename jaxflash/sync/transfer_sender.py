"""The sending end of a cross-program weight transfer (runs in every learner process).

A ``WeightSender`` holds one offer — a versioned param tree, already laid out so
that the receivers' shards exist whole (``transfer_layout.stage_for_layout``) —
and answers receivers over a small control socket (``transfer_wire`` frames):

- ``describe``: the offer's version, its TreeLayout (JSON) and which blocks this
  process holds (a multi-process learner has one sender per process, each
  holding its addressable shards), plus the jax transfer server's address;
- ``delta``: the same blocks as deltas over the previous version's, when the offer
  came with its engine-side view (``offer(..., engine=)``; ``transfer_delta``);
- ``fetch``: a list of (leaf path, block) the receiver wants from this process,
  stamped with the version it expects. Everything is checked before any byte
  moves (version, leaf, block held whole, dtype); then either the shards are
  registered with ``jax.experimental.transfer`` for the receiver to pull
  device to device (``method="transfer"``), or streamed one shard at a time
  through host memory (``method="stream"``, the fallback: no full gather, at
  most one shard on the host at a time).

Thread-free: ``serve(timeout_s)`` handles whatever requests are waiting and
returns; the runtime calls it from its loop or its own thread. A ``fetch`` with
``method="stream"`` blocks ``serve`` while it streams its chunk (receivers ask
for chunks of bounded size, so each call is bounded too).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import selectors
import socket
from typing import Any

import jax
import numpy as np

from jaxflash import failpoints
from jaxflash.sync.publish import check_version
from jaxflash.sync.transfer_delta import SenderDeltas, held_blocks
from jaxflash.sync.transfer_layout import Index, TreeLayout, layout_of
from jaxflash.sync.transfer_wire import (
    TransferError,
    TransferErrorKind,
    expect,
    recv_message,
    send_error,
    send_message,
)
from jaxflash.types import PolicyVersion

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SenderStats:
    """What a sender did (counters only go up).

    Attributes:
      requests: control requests answered (describe + fetch, refused included).
      refused: refused requests by TransferErrorKind value.
      pulls_registered: fetches registered with the jax transfer server.
      shards_sent: shards registered or streamed.
      bytes_streamed: payload bytes written by the stream fallback.
    """

    requests: int = 0
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    pulls_registered: int = 0
    shards_sent: int = 0
    bytes_streamed: int = 0


@dataclasses.dataclass(frozen=True)
class _Offer:
    version: PolicyVersion
    layout: TreeLayout
    held: dict[str, dict[Index, jax.Array]]  # path -> block -> single-device shard


def _index_json(index: Index) -> list[list[int]]:
    return [list(pair) for pair in index]


class WeightSender:
    """Offer versioned params to receivers in other JAX programs.

    Args:
      host: interface for the control socket and the jax transfer server
        (loopback by default; a pod uses the host's address reachable from the
        generation hosts).
      port: control port; 0 picks a free one (read it back from ``address``).
      jax_transfer: start a ``jax.experimental.transfer`` server (primary path);
        False serves the stream fallback only.
      io_timeout_s: per-connection socket timeout, seconds; a receiver that
        stalls longer is dropped (counted as refused, kind "connection").
      bulk_transports: parallel bulk-transport sockets of the jax transfer
        server. Both ends must use the same count: on jax 0.10.2 a mismatch
        aborts the receiving process (a failed CHECK in socket_bulk_transport,
        not an exception), so the count is advertised in ``describe`` and the
        receiver starts its own server with it, or refuses.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        jax_transfer: bool = True,
        io_timeout_s: float = 60.0,
        bulk_transports: int = 1,
    ):
        if bulk_transports < 1:
            raise ValueError(f"WeightSender: bulk_transports must be >= 1, got {bulk_transports}")
        self._bulk_transports = int(bulk_transports)
        self._io_timeout_s = float(io_timeout_s)
        self._listener = socket.create_server((host, port), backlog=64)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._host = host
        self._transfer = None
        if jax_transfer:
            from jax.experimental import transfer  # noqa: PLC0415  (optional backend)

            self._transfer = transfer.start_transfer_server(
                jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"] * bulk_transports
            )
        self._uuids = itertools.count(1)
        self._offer: _Offer | None = None
        self.deltas = SenderDeltas()  # the offers' engine-side blocks (``delta`` requests)
        self.stats = SenderStats()

    @property
    def address(self) -> str:
        """ "host:port" of the control socket (give it to receivers)."""
        return f"{self._host}:{self._listener.getsockname()[1]}"

    @property
    def transfer_address(self) -> str | None:
        """The jax transfer server's address, or None when it is off."""
        return None if self._transfer is None else self._transfer.address()

    @property
    def version(self) -> PolicyVersion | None:
        """Version of the current offer, None before the first ``offer``."""
        return None if self._offer is None else self._offer.version

    def offer(self, params: Any, version: PolicyVersion, *, engine: Any = None) -> TreeLayout:
        """Make ``params`` the tree receivers get, replacing the previous offer.

        Args:
          params: pytree of jax.Array with NamedShardings, laid out so that the
            receivers' shards exist whole (``stage_for_layout`` output). The
            sender keeps references until the next offer: pass buffers nobody
            donates or deletes (``stage_for_layout`` always returns fresh ones).
          version: policy version to stamp; must exceed the previous offer's.
          engine: ``params`` as the engine keeps them (same layout, the engine's
            dtypes); with it, receivers holding the previous version may ask for
            deltas (``transfer_delta``). Without it they pull the full tree.

        Returns:
          The offer's TreeLayout (what ``describe`` sends).

        Raises:
          ValueError: a version that does not increase.
          LayoutMismatchError: a leaf without a NamedSharding.
        """
        check_version(version, self.version)
        layout = layout_of(params)
        held = held_blocks(params)
        if engine is not None:  # first: a delta request never sees a newer offer's base
            self.deltas.advance(engine, version)
        self._offer = _Offer(version=int(version), layout=layout, held=held)
        return layout

    # ----------------------------------------------------------- serving

    def serve(self, timeout_s: float = 0.0) -> int:
        """Answer the requests waiting now (or arriving within ``timeout_s``).

        Returns:
          Number of requests handled (refusals included).
        """
        handled = 0
        wait = float(timeout_s)
        while self._selector.select(wait):
            wait = 0.0
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                continue
            with conn:
                conn.setblocking(True)
                conn.settimeout(self._io_timeout_s)
                self._handle(conn)
            handled += 1
        return handled

    def _handle(self, conn: socket.socket) -> None:
        self.stats.requests += 1
        try:
            header = recv_message(conn)
            if header["type"] == "describe":
                self._describe(conn)
            elif header["type"] == "fetch":
                self._fetch(conn, header)
            elif header["type"] == "delta":
                self.deltas.serve(conn, header, self._require_offer().version)
            else:
                raise TransferError(
                    TransferErrorKind.PROTOCOL, f"unknown request {header['type']!r}"
                )
        except TransferError as err:
            self.stats.refused[err.kind.value] += 1
            log.warning("weight sender: request refused: %s", err)
            send_error(conn, err.kind, str(err))

    def _require_offer(self) -> _Offer:
        if self._offer is None:
            raise TransferError(TransferErrorKind.NO_OFFER, "the sender has no weights offered yet")
        return self._offer

    def _describe(self, conn: socket.socket) -> None:
        offer = self._require_offer()
        reply = {
            "type": "offer",
            "version": offer.version,
            "layout": offer.layout.to_json(),
            "held": {p: [_index_json(i) for i in blocks] for p, blocks in offer.held.items()},
            "transfer_address": self.transfer_address,
            "bulk_transports": self._bulk_transports,
        }
        send_message(conn, reply)

    def _resolve(self, offer: _Offer, items: Any) -> list[jax.Array]:
        """The shards ``items`` ask for, each checked before anything moves."""
        if not isinstance(items, list) or not items:
            raise TransferError(TransferErrorKind.PROTOCOL, "fetch needs a non-empty item list")
        leaves = offer.layout.by_path()
        shards = []
        for item in items:
            try:
                path, index = str(item["path"]), tuple(tuple(map(int, p)) for p in item["index"])
                dtype = str(item["dtype"])
            except (KeyError, TypeError, ValueError) as err:
                raise TransferError(TransferErrorKind.PROTOCOL, f"bad item {item!r}") from err
            leaf = leaves.get(path)
            if leaf is None:
                raise TransferError(TransferErrorKind.LAYOUT_MISMATCH, f"no leaf {path} offered")
            if dtype != leaf.dtype:
                raise TransferError(
                    TransferErrorKind.LAYOUT_MISMATCH,
                    f"leaf {path}: receiver wants {dtype}, the offer is {leaf.dtype}",
                )
            shard = offer.held[path].get(index)
            if shard is None:
                raise TransferError(
                    TransferErrorKind.LAYOUT_MISMATCH,
                    f"leaf {path}: block {_index_json(index)} is not held whole by this process; "
                    f"the offer's layout is {leaf.describe()}",
                )
            shards.append(shard)
        return shards

    def _fetch(self, conn: socket.socket, header: dict[str, Any]) -> None:
        offer = self._require_offer()
        if header.get("version") != offer.version:
            raise TransferError(
                TransferErrorKind.VERSION,
                f"receiver asked for version {header.get('version')}, the offer is now "
                f"version {offer.version}",
            )
        shards = self._resolve(offer, header.get("items"))
        method = header.get("method")
        if method == "transfer":
            if self._transfer is None:
                raise TransferError(
                    TransferErrorKind.UNSUPPORTED, "this sender runs no jax transfer server"
                )
            uuid = next(self._uuids)
            self._transfer.await_pull(uuid, shards)
            self.stats.pulls_registered += 1
            self.stats.shards_sent += len(shards)
            send_message(conn, {"type": "ready", "uuid": uuid, "count": len(shards)})
            failpoints.reach("weight_send")  # the receiver is pulling now
        elif method == "stream":
            send_message(conn, {"type": "stream", "count": len(shards)})
            self._stream(conn, shards)
            expect(recv_message(conn), "done")
        else:
            raise TransferError(TransferErrorKind.PROTOCOL, f"unknown method {method!r}")

    def _stream(self, conn: socket.socket, shards: list[jax.Array]) -> None:
        if shards:
            shards[0].copy_to_host_async()
        for i, shard in enumerate(shards):
            if i + 1 < len(shards):  # overlap the next device->host copy with this send
                shards[i + 1].copy_to_host_async()
            if i == len(shards) // 2:
                failpoints.reach("weight_send")  # the first half of the shards is sent
            host = np.ascontiguousarray(jax.device_get(shard))
            payload = host.reshape(-1).view(np.uint8)
            send_message(conn, {"type": "shard", "i": i, "nbytes": payload.size}, payload)
            self.stats.shards_sent += 1
            self.stats.bytes_streamed += payload.size
        send_message(conn, {"type": "end", "count": len(shards)})

    def close(self) -> None:
        """Stop listening and drop the offer (its buffers are released)."""
        self._selector.close()
        self._listener.close()
        self._offer = None
        self._transfer = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
