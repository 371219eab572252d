"""The receiving end of a cross-program weight transfer (runs in a generation program).

``WeightReceiver(template).pull(sender_addresses)`` brings the senders' current
offer into arrays of the receiver's own sharding:

1. ``describe`` every sender (one per learner process): all must offer the same
   version, newer than the one installed.
2. ``check_receivable(offered, own layout)``: paths, shapes, dtypes and shards
   are checked here, and again by each sender per request, before any byte moves.
3. Plan: every distinct block the receiver's devices need, fetched once from a
   sender process that holds it whole, in chunks of at most ``chunk_bytes``.
4. Fetch each chunk: ``method="transfer"`` pulls the shards device to device
   with ``jax.experimental.transfer`` onto the first receiver device that needs
   them; ``method="stream"`` reads them from the socket one shard at a time and
   ``device_put``s each. Blocks needed on several devices (replicated leaves)
   are copied on the receiver, device to device.
5. Assemble with ``jax.make_array_from_single_device_arrays`` onto the
   template's shardings and wait until every buffer is ready.
6. Install: only now does ``current`` change. Double buffering: until then the
   new weights live in a staging area next to the old ones, so a transfer that
   fails or is cut anywhere in 1-5 leaves the receiver on its old version with
   its old arrays (``TransferError`` says why, as a ``TransferErrorKind``).

Thread-free; ``pull`` blocks. A ``jax.experimental.transfer`` pull has no
working timeout on jax 0.10.2 (checked: a pull of an id never offered waits
until the sender exits), so a sender that stays alive but stops answering can
stall ``method="transfer"``; the protocol never asks for an id the sender has
not registered, and a sender that dies fails the pull. Control and stream
sockets use ``timeout_s``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxflash.sync.publish import VersionedParams, check_version
from jaxflash.sync.transfer_layout import (
    Index,
    LayoutMismatchError,
    LeafLayout,
    TreeLayout,
    check_receivable,
    layout_of,
)
from jaxflash.sync.transfer_wire import (
    TransferError,
    TransferErrorKind,
    connect,
    expect,
    recv_into,
    recv_message,
    send_message,
)

METHODS = ("transfer", "stream")


@dataclasses.dataclass
class ReceiverStats:
    """Counters of a receiver (they only go up).

    Attributes:
      installed: transfers completed and installed.
      failed: transfers that left the receiver unchanged, by TransferErrorKind value.
      bytes: payload bytes received over the network (distinct blocks only).
      last_seconds: wall time of the last installed transfer, describe to install.
    """

    installed: int = 0
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bytes: int = 0
    last_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Item:
    path: str
    index: Index
    leaf: LeafLayout
    device: jax.Device  # first receiver device that needs the block

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.index)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "index": [list(p) for p in self.index], "dtype": self.leaf.dtype}


class WeightReceiver:
    """Pull versioned params from ``WeightSender``s into this program's sharding.

    Args:
      template: pytree of ``jax.ShapeDtypeStruct`` (or arrays) with
        NamedShardings on this program's mesh: the layout the weights must
        arrive in (e.g. the engine's generator param shardings).
      current: weights already installed (e.g. loaded at start), or None.
      host: interface of this receiver's own jax transfer server (started on the
        first ``method="transfer"`` pull).

    Raises:
      LayoutMismatchError: a template leaf without a NamedSharding.
    """

    def __init__(
        self, template: Any, *, current: VersionedParams | None = None, host: str = "127.0.0.1"
    ):
        self._layout = layout_of(template)
        flat, self._treedef = jax.tree_util.tree_flatten(template)
        self._shardings = [x.sharding for x in flat]
        self._host = host
        self._transfer = None
        self._bulk_transports = 0
        self._connections: dict[str, Any] = {}
        self._current = current
        self.stats = ReceiverStats()

    @property
    def layout(self) -> TreeLayout:
        """This receiver's layout (send it to the learner: ``layout.to_json()``)."""
        return self._layout

    @property
    def current(self) -> VersionedParams | None:
        """The installed weights and their version (never a partial transfer)."""
        return self._current

    def release(self) -> None:
        """Drop the installed arrays, keep their version (a caller that keeps its own
        copy, e.g. ``transfer_delta.DeltaPuller``; later pulls still need a newer one)."""
        if self._current is not None:
            self._current = VersionedParams(params=None, version=self._current.version)

    def pull(
        self,
        senders: Sequence[str],
        *,
        method: str = "transfer",
        chunk_bytes: int = 64 << 20,
        timeout_s: float = 60.0,
        progress: Callable[[int, int], None] | None = None,
        version: int | None = None,
    ) -> VersionedParams:
        """Fetch the senders' offer and install it.

        Args:
          senders: control addresses ("host:port") of every sender process of the
            learner program (one for a single-process learner).
          method: "transfer" (jax.experimental.transfer, device to device where
            the platform allows) or "stream" (host-staged, one shard at a time).
          chunk_bytes: upper bound of one fetch (a single larger shard is its own
            chunk); smaller chunks bound the sender's blocking time per request.
          timeout_s: socket timeout of every control and stream operation, seconds.
          progress: called after each chunk with (bytes received, bytes total).
          version: install only this version: an offer of any other version is
            refused (VERSION) before any byte moves. None: whatever is offered.

        Returns:
          The new ``current``.

        Raises:
          TransferError: the transfer was refused or failed (``kind`` says which:
            LAYOUT_MISMATCH names the leaf and both layouts; VERSION; CONNECTION
            when a sender vanished part-way; ...). ``current`` is unchanged.
          ValueError: bad arguments (an unknown method, no senders, chunk_bytes < 1).
        """
        if method not in METHODS:
            raise ValueError(f"pull: method must be one of {METHODS}, got {method!r}")
        if not senders or chunk_bytes < 1:
            raise ValueError(f"pull: need sender addresses and chunk_bytes >= 1, got {senders}")
        start = time.perf_counter()
        try:
            try:
                version, plan, remotes = self.plan(list(senders), timeout_s, version)
            except (KeyError, TypeError) as err:  # a describe reply missing its fields
                raise TransferError(TransferErrorKind.PROTOCOL, f"bad offer: {err!r}") from err
            fetch = (
                (lambda a, c: self._fetch_transfer(remotes[a], a, c, version, timeout_s))
                if method == "transfer"
                else (lambda a, c: self._fetch_stream(a, c, version, timeout_s))
            )
            staged = self._fetch_all(plan, fetch, chunk_bytes, progress)
            arrays = jax.block_until_ready(self._assemble(staged))
        except TransferError as err:
            self.stats.failed[err.kind.value] += 1
            raise
        except LayoutMismatchError as err:
            self.stats.failed[TransferErrorKind.LAYOUT_MISMATCH.value] += 1
            raise TransferError(TransferErrorKind.LAYOUT_MISMATCH, str(err)) from err
        except jax.errors.JaxRuntimeError as err:  # a jax pull whose sender went away
            self._connections.clear()  # a restarted sender gets a new connection
            self.stats.failed[TransferErrorKind.CONNECTION.value] += 1
            raise TransferError(
                TransferErrorKind.CONNECTION, f"jax transfer failed: {err}"
            ) from err
        self._current = VersionedParams(
            params=jax.tree_util.tree_unflatten(self._treedef, arrays), version=version
        )
        self.stats.installed += 1
        self.stats.last_seconds = time.perf_counter() - start
        return self._current

    # ------------------------------------------------------------ planning

    def _describe(self, address: str, timeout_s: float) -> dict[str, Any]:
        with connect(address, timeout_s) as sock:
            send_message(sock, {"type": "describe"})
            return expect(recv_message(sock), "offer")

    def plan(
        self, senders: list[str], timeout_s: float, expected: int | None
    ) -> tuple[int, dict[str, list[_Item]], dict[str, tuple[str | None, int]]]:
        """(version, items per sender, (jax transfer address, bulk transports) per sender):
        every distinct block this process needs, from a sender process holding it whole
        (``pull``'s steps 1-3; ``transfer_delta.pull_delta`` asks the same senders).

        Raises:
          TransferError: VERSION, LAYOUT_MISMATCH, PROTOCOL, CONNECTION (module docstring).
        """
        offers = [self._describe(a, timeout_s) for a in senders]
        versions = {int(o["version"]) for o in offers}
        if len(versions) != 1:
            raise TransferError(
                TransferErrorKind.VERSION, f"sender processes offer different versions {versions}"
            )
        (version,) = versions
        if expected is not None and version != int(expected):
            raise TransferError(
                TransferErrorKind.VERSION, f"the senders offer version {version}, not {expected}"
            )
        previous = None if self._current is None else self._current.version
        try:
            check_version(version, previous)
        except ValueError as err:
            raise TransferError(TransferErrorKind.VERSION, str(err)) from err
        offered = TreeLayout.from_json(offers[0]["layout"])
        if any(TreeLayout.from_json(o["layout"]) != offered for o in offers[1:]):
            raise TransferError(
                TransferErrorKind.PROTOCOL, "sender processes offer different layouts"
            )
        check_receivable(offered, self._layout)
        held = [
            {p: {tuple(tuple(pair) for pair in i) for i in idx} for p, idx in o["held"].items()}
            for o in offers
        ]
        plan: dict[str, list[_Item]] = {a: [] for a in senders}
        me = jax.process_index()
        for leaf, sharding in zip(self._layout.leaves, self._shardings, strict=True):
            seen: set[Index] = set()
            for p, device in enumerate(sharding.mesh.devices.flat):
                index = leaf.shard_index(p)
                if device.process_index != me or index in seen:
                    continue
                seen.add(index)
                source = next((a for a, h in zip(senders, held, strict=True)
                               if index in h.get(leaf.path, ())), None)  # fmt: skip
                if source is None:
                    raise TransferError(
                        TransferErrorKind.LAYOUT_MISMATCH,
                        f"leaf {leaf.path}: no sender process holds block {list(index)}",
                    )
                plan[source].append(_Item(leaf.path, index, leaf, device))
        remotes = {
            a: (o["transfer_address"], int(o.get("bulk_transports", 1)))
            for a, o in zip(senders, offers, strict=True)
        }
        return version, plan, remotes

    # ------------------------------------------------------------ fetching

    def _fetch_all(self, plan, fetch, chunk_bytes, progress):
        total = sum(it.leaf.shard_nbytes for items in plan.values() for it in items)
        done = 0
        staged: dict[tuple[str, Index], jax.Array] = {}
        for address, items in plan.items():
            for chunk in _chunks(items, chunk_bytes):
                arrays = fetch(address, chunk)
                for it, arr in zip(chunk, arrays, strict=True):
                    staged[(it.path, it.index)] = arr
                done += sum(it.leaf.shard_nbytes for it in chunk)
                if progress is not None:
                    progress(done, total)
        self.stats.bytes += total
        return staged

    def _fetch_transfer(self, remote, address, chunk, version, timeout_s) -> list[jax.Array]:
        remote, bulk = remote
        if remote is None:
            raise TransferError(
                TransferErrorKind.UNSUPPORTED, f"sender {address} runs no jax transfer server"
            )
        server = self._transfer_server(bulk)
        request = {"type": "fetch", "method": "transfer", "version": version,
                   "items": [it.to_json() for it in chunk]}  # fmt: skip
        with connect(address, timeout_s) as sock:
            send_message(sock, request)
            ready = expect(recv_message(sock), "ready")
        avals = [
            jax.ShapeDtypeStruct(
                it.shape, jnp.dtype(it.leaf.dtype), sharding=SingleDeviceSharding(it.device)
            )
            for it in chunk
        ]
        connection = self._connections.get(remote)
        if connection is None:
            # One connection per sender, reused: each connect sets up bulk transports.
            connection = self._connections[remote] = server.connect(remote)
        return list(connection.pull(int(ready["uuid"]), avals))

    def _transfer_server(self, bulk_transports: int) -> Any:
        """This receiver's jax transfer server, started with the senders' transport count."""
        if self._transfer is None:
            from jax.experimental import transfer  # noqa: PLC0415  (optional backend)

            self._transfer = transfer.start_transfer_server(
                jax.local_devices()[0].client,
                f"{self._host}:0",
                [f"{self._host}:0"] * bulk_transports,
            )
            self._bulk_transports = bulk_transports
        if bulk_transports != self._bulk_transports:
            # Checked here because jax 0.10.2 can abort the process on a mismatch.
            raise TransferError(
                TransferErrorKind.UNSUPPORTED,
                f"sender uses {bulk_transports} bulk transports, this receiver's transfer "
                f"server {self._bulk_transports}; start all senders with the same count",
            )
        return self._transfer

    def _fetch_stream(self, address, chunk, version, timeout_s) -> list[jax.Array]:
        request = {"type": "fetch", "method": "stream", "version": version,
                   "items": [it.to_json() for it in chunk]}  # fmt: skip
        out = []
        with connect(address, timeout_s) as sock:
            send_message(sock, request)
            expect(recv_message(sock), "stream")
            for i, it in enumerate(chunk):
                header = expect(recv_message(sock), "shard")
                host = np.empty(it.shape, jnp.dtype(it.leaf.dtype))
                if header.get("i") != i or header.get("nbytes") != host.nbytes:
                    raise TransferError(
                        TransferErrorKind.PROTOCOL,
                        f"leaf {it.path}: shard header {header} != item {i} of {host.nbytes} bytes",
                    )
                recv_into(sock, memoryview(host.reshape(-1).view(np.uint8)))
                out.append(jax.device_put(host, it.device))
            expect(recv_message(sock), "end")
            send_message(sock, {"type": "done"})
        return out

    # ------------------------------------------------------------ assembling

    def _assemble(self, staged: dict[tuple[str, Index], jax.Array]) -> list[jax.Array]:
        arrays = []
        me = jax.process_index()
        for leaf, sharding in zip(self._layout.leaves, self._shardings, strict=True):
            shards = []
            for p, device in enumerate(sharding.mesh.devices.flat):
                if device.process_index != me:
                    continue
                block = staged[(leaf.path, leaf.shard_index(p))]
                # A block needed on several devices arrived once: copy it on this side.
                shards.append(
                    block if block.devices() == {device} else jax.device_put(block, device)
                )
            arrays.append(
                jax.make_array_from_single_device_arrays(
                    leaf.shape, sharding, shards, dtype=jnp.dtype(leaf.dtype)
                )
            )
        return arrays


def _chunks(items: list[_Item], chunk_bytes: int) -> list[list[_Item]]:
    chunks: list[list[_Item]] = []
    size = 0
    for it in items:
        if not chunks or size + it.leaf.shard_nbytes > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(it)
        size += it.leaf.shard_nbytes
    return chunks
