"""Delta publish between JAX programs: per block, over the transfer wire.

A ``WeightSender`` offered with ``engine=`` (the offer cast as the engine keeps it)
keeps ``SenderDeltas``: its own process's engine-side blocks (one per distinct shard
index it holds) as a ``delta_publish.DeltaSource``. A receiver holding the previous
version (``ReceiverBase``: its engine-side tree, version and one ``leaf_digest`` per
block) asks with ``pull_delta``: one ``delta`` request per sender process listing the
blocks it needs, each with the digest of the block it holds. The sender answers each
block with a ``delta.to_wire`` frame, or refuses the whole request (kind
``STALE_BASE``: the receiver holds nothing, another version, or other bits) before any
byte moves; the receiver writes every block, checks each result's digest against the
sender's (kind ``DIGEST`` on a mismatch) and installs only when all blocks passed.
On either refusal the caller pulls the full tree (``WeightReceiver.pull``) and builds
a new ``ReceiverBase`` from it.

Blocks are per process and per shard, so a program over several hosts runs the same
exchange per process, paired with the sender processes that hold its blocks (the
receiver's ``plan``).
"""

from __future__ import annotations

import collections
import dataclasses
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxflash.sync import delta as codec
from jaxflash.sync.delta_publish import DeltaSource
from jaxflash.sync.publish import VersionedParams
from jaxflash.sync.transfer_layout import Index, layout_of, normalize_index
from jaxflash.sync.transfer_wire import (
    TransferError,
    TransferErrorKind,
    connect,
    expect,
    recv_into,
    recv_message,
    send_message,
)
from jaxflash.types import PolicyVersion


def held_blocks(tree: Any) -> dict[str, dict[Index, jax.Array]]:
    """This process's blocks of ``tree``: path -> shard index -> single-device array
    (the first replica of each index)."""
    held: dict[str, dict[Index, jax.Array]] = {}
    me = jax.process_index()
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        blocks: dict[Index, jax.Array] = {}
        for shard in x.addressable_shards:
            if shard.device.process_index == me:
                blocks.setdefault(normalize_index(shard.index, x.shape), shard.data)
        held[jax.tree_util.keystr(kp)] = blocks
    return held


def _key_json(path: str, index: Index) -> dict[str, Any]:
    return {"path": path, "index": [list(p) for p in index]}


def _key(item: dict[str, Any]) -> tuple[str, Index]:
    try:
        return str(item["path"]), tuple(tuple(map(int, p)) for p in item["index"])
    except (KeyError, TypeError, ValueError) as err:
        raise TransferError(TransferErrorKind.PROTOCOL, f"bad item {item!r}") from err


class SenderDeltas:
    """A sender process's engine-side blocks, as a ``DeltaSource`` (one leaf a block).

    Attributes:
      deltas_sent, bytes_sent: blocks answered with a delta frame, and their payload bytes.
      refused: requests refused (``STALE_BASE``).
    """

    def __init__(self) -> None:
        self.source = DeltaSource()
        self._pos: dict[tuple[str, Index], int] = {}
        self._lock = threading.Lock()  # the learner offers while a thread serves
        self.deltas_sent = self.bytes_sent = self.refused = 0

    def advance(self, engine: Any, version: PolicyVersion) -> None:
        """``engine`` (the offer in the engine's dtypes, the offer's layout) as ``version``."""
        keys, leaves = [], []
        for path, blocks in held_blocks(engine).items():
            for index, block in blocks.items():
                keys.append((path, index))
                leaves.append(block)
        pos = {k: i for i, k in enumerate(keys)}
        with self._lock:
            if pos != self._pos:  # other blocks: a new chain (receivers take the full tree)
                self.source, self._pos = DeltaSource(), pos
            self.source.advance(leaves, version)

    def _resolve(self, header: dict[str, Any], offer_version: int) -> list[Any]:
        """The deltas a request asks for; every check before anything is sent."""
        if header.get("version") != offer_version or self.source.version != offer_version:
            raise TransferError(
                TransferErrorKind.VERSION,
                f"delta for version {header.get('version')}: the offer is {offer_version}, "
                f"its engine-side view {self.source.version}",
            )
        items = header.get("items")
        if not isinstance(items, list) or not items:
            raise TransferError(TransferErrorKind.PROTOCOL, "delta needs a non-empty item list")
        deltas = []
        for item in items:
            key = _key(item)
            if key not in self._pos:
                raise TransferError(
                    TransferErrorKind.LAYOUT_MISMATCH, f"block {item!r} is not held here"
                )
            digest = item.get("digest")
            d, why = self.source.leaf_delta(self._pos[key], header.get("base_version"), digest)
            if d is None:
                self.refused += 1
                raise TransferError(
                    TransferErrorKind.STALE_BASE, f"{why}: block {key[0]} {list(key[1])}"
                )
            deltas.append(d)
        return deltas

    def serve(self, conn: socket.socket, header: dict[str, Any], offer_version: int) -> None:
        """Answer one ``delta`` request (every check before any frame is sent).

        Raises:
          TransferError: VERSION (not the current offer, or no engine-side view of
            it), STALE_BASE (a block whose base the receiver does not hold),
            LAYOUT_MISMATCH (a block this process does not hold), PROTOCOL.
        """
        with self._lock:
            deltas = self._resolve(header, offer_version)
        send_message(conn, {"type": "deltas", "count": len(deltas)})
        for i, d in enumerate(deltas):
            head, payload = codec.to_wire(d)
            send_message(conn, {"type": "delta", "i": i, **head}, payload)
            self.deltas_sent += 1
            self.bytes_sent += len(payload)
        send_message(conn, {"type": "end", "count": len(deltas)})


@dataclasses.dataclass(frozen=True)
class ReceiverBase:
    """What a receiver holds for deltas: the engine-side tree, its version, a digest per
    distinct block this process holds (path, index) -> ``leaf_digest``."""

    tree: Any
    version: PolicyVersion
    digests: dict[tuple[str, Index], tuple[int, int]]

    @classmethod
    def of(cls, tree: Any, version: PolicyVersion) -> ReceiverBase:
        """The base of ``tree`` (just pulled in full and cast), digests computed here."""
        digests = {
            (path, index): codec.leaf_digest(block)
            for path, blocks in held_blocks(tree).items()
            for index, block in blocks.items()
        }
        return cls(tree, int(version), digests)


def pull_delta(
    receiver: Any,
    senders: Sequence[str],
    base: ReceiverBase,
    *,
    version: int,
    timeout_s: float = 60.0,
) -> tuple[ReceiverBase, int]:
    """The senders' ``version`` as deltas over ``base``: (the new base, payload bytes).

    Args:
      receiver: the ``WeightReceiver`` (its plan: which sender holds which block).
      senders: one address per learner process.
      base: what this receiver holds (``ReceiverBase.of`` after a full pull).
      version: the version the receiver was told to install.

    Raises:
      TransferError: STALE_BASE (a sender refused: pull the full tree), DIGEST (a
        block's result is not the sender's: pull the full tree), or any kind a
        transfer raises; ``base`` is unchanged in every case.
    """
    version, plan, _ = receiver.plan(senders, timeout_s, version)
    blocks = held_blocks(base.tree)
    staged: dict[tuple[str, Index], jax.Array] = {}
    started: list[tuple[tuple[str, Index], Any, codec.LeafDelta]] = []
    moved = 0
    for address, items in plan.items():
        if not items:
            continue
        keys = [(it.path, it.index) for it in items]
        asked = [{**_key_json(*k), "digest": list(base.digests[k])} for k in keys]
        request = {"type": "delta", "version": version, "base_version": base.version}
        request["items"] = asked
        with connect(address, timeout_s) as sock:
            send_message(sock, request)
            expect(recv_message(sock), "deltas")
            for i, key in enumerate(keys):
                head = expect(recv_message(sock), "delta")
                if head.get("i") != i:
                    raise TransferError(TransferErrorKind.PROTOCOL, f"delta {head.get('i')} != {i}")
                buf = bytearray(int(head["nbytes"]))
                recv_into(sock, memoryview(buf))
                try:  # the device applies this block while the next one arrives
                    d = codec.from_wire(head, bytes(buf))
                    staged[key], digest = codec.start_apply(blocks[key[0]][key[1]], d)
                except codec.DigestMismatchError as err:
                    raise TransferError(TransferErrorKind.DIGEST, f"{key[0]}: {err}") from err
                except ValueError as err:
                    raise TransferError(TransferErrorKind.PROTOCOL, f"{key[0]}: {err}") from err
                started.append((key, digest, d))
                moved += len(buf)
            expect(recv_message(sock), "end")
    for key, digest, d in started:
        try:
            codec.check_applied(staged[key], digest, d, base.digests[key])
        except codec.DigestMismatchError as err:
            raise TransferError(TransferErrorKind.DIGEST, f"{key[0]}: {err}") from err
    digests = {key: tuple(d.digest) for key, _, d in started}
    leaves = []
    me = jax.process_index()
    flat, treedef = jax.tree_util.tree_flatten(base.tree)
    for leaf, x in zip(layout_of(base.tree).leaves, flat, strict=True):
        shards = []
        for p, device in enumerate(x.sharding.mesh.devices.flat):
            if device.process_index != me:
                continue
            block = staged[(leaf.path, leaf.shard_index(p))]
            shards.append(block if block.devices() == {device} else jax.device_put(block, device))
        leaves.append(
            jax.make_array_from_single_device_arrays(
                x.shape, x.sharding, shards, dtype=jnp.dtype(x.dtype)
            )
        )
    tree = jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, leaves))
    return ReceiverBase(tree, version, {**base.digests, **digests}), moved


class DeltaPuller:
    """A generation program's pulls: deltas over what it holds when the senders allow,
    the full tree (then the engine's cast) otherwise.

    Args:
      receiver: the program's ``WeightReceiver`` (its template: the learner's tree).
      engine_view: that tree -> the engine's dtypes (``as_engine_dtypes``); jitted here.

    Attributes:
      base: what it holds (None before the first pull).
      counts: ``delta`` and ``full`` pulls, ``fallback_stale_base`` / ``fallback_digest``
        (full pulls after a refused delta: the program missed a version, drifted, or a
        delta failed its digest check).
      last_bytes: payload bytes of the last pull.
    """

    def __init__(self, receiver: Any, engine_view: Callable[[Any], Any]) -> None:
        self.receiver = receiver
        self._view = jax.jit(engine_view)
        self.base: ReceiverBase | None = None
        self.counts: collections.Counter = collections.Counter()
        self.last_bytes = 0

    @property
    def stats(self) -> Any:
        """The receiver's ``ReceiverStats`` (``bytes``: full pulls' and deltas' payloads)."""
        return self.receiver.stats

    @property
    def layout(self) -> Any:
        """The receiver's ``TreeLayout`` (what the learner stages its offers in)."""
        return self.receiver.layout

    @property
    def current(self) -> VersionedParams | None:
        """What it holds, in the engine's dtypes (None before the first pull)."""
        if self.base is None:
            return None
        return VersionedParams(params=self.base.tree, version=self.base.version)

    def pull(
        self, senders: Sequence[str], *, version: int, timeout_s: float, **full: Any
    ) -> VersionedParams:
        """The senders' ``version`` in the engine's dtypes (``full``: ``pull``'s method and
        chunk_bytes for a full pull).

        Raises:
          TransferError: as ``WeightReceiver.pull`` (a refused delta is not raised: the
            full tree is pulled instead).
        """
        if self.base is not None:
            try:
                self.base, self.last_bytes = pull_delta(
                    self.receiver, senders, self.base, version=version, timeout_s=timeout_s
                )
                self.counts["delta"] += 1
                self.receiver.stats.bytes += self.last_bytes
                return VersionedParams(params=self.base.tree, version=self.base.version)
            except TransferError as err:
                if err.kind not in (TransferErrorKind.STALE_BASE, TransferErrorKind.DIGEST):
                    raise
                self.counts[f"fallback_{err.kind.value}"] += 1
        before = self.receiver.stats.bytes
        current = self.receiver.pull(senders, version=version, timeout_s=timeout_s, **full)
        self.base = ReceiverBase.of(self._view(current.params), current.version)
        self.receiver.release()  # the learner's dtypes are not kept beside the engine's
        self.counts["full"] += 1
        self.last_bytes = self.receiver.stats.bytes - before
        return VersionedParams(params=self.base.tree, version=self.base.version)
