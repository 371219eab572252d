"""Delta publish: after each step, send a receiver only the weights whose engine-side bits
changed since the version it holds; the full tree when it holds anything else.

Three parts, each usable alone (a program over several hosts runs them per shard):

- ``DeltaSource`` (the sender): the engine-side leaves of the newest version (the
  learner's params cast as the engine keeps them: ``as_engine_dtypes``) and of the one
  before, their ``leaf_digest``s, and the encoded deltas between them (encoded once,
  at the first receiver that needs them; shared by all).
- ``DeltaSink`` (a receiver): the leaves it holds, their version and digests;
  ``state()`` is what it reports to the sender (``ReceiverState``).
- ``DeltaSource.delta_for(state)``: the deltas when the receiver holds exactly the
  previous version (same version *and* same tree digest), else None and why:
  ``new`` (it holds nothing: a new or restarted receiver), ``lagging`` (another
  version: it missed a publish), ``drifted`` (the right version but other bits).
  A delta whose result fails the digest check on the receiver is ``refused``; in
  every case the receiver takes the full tree instead.

The digests reported are those computed when the leaves were installed: a jax.Array
never changes in place, so a receiver that still holds the same arrays holds the same
bits (one that replaced them must ``install_full``).

``DeltaPublisher`` joins them for thread engines (device to device, ``publish``'s
copy for the full tree); ``DeltaStats`` counts what each publish did.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxflash.sync.delta import (
    Diff,
    DigestMismatchError,
    LeafDelta,
    check_applied,
    diff,
    encode,
    leaf_digest,
    start_apply,
    tree_digest,
)
from jaxflash.sync.publish import check_version, publish
from jaxflash.types import PolicyVersion

FALLBACK_REASONS = ("new", "lagging", "drifted", "refused")


@dataclasses.dataclass(frozen=True)
class ReceiverState:
    """What a receiver holds: its version and ``tree_digest`` (None, None: nothing)."""

    version: PolicyVersion | None
    digest: str | None


@dataclasses.dataclass
class DeltaStats:
    """Counters of a delta publisher (they only go up, except ``last_*``).

    Attributes:
      deltas: publishes to a receiver that sent a delta.
      fulls: publishes that sent the full tree (fallbacks included).
      fallbacks: full publishes by reason (``FALLBACK_REASONS``; a receiver's
        first publish counts as ``new``).
      bytes: bytes sent, all publishes (deltas' indices + values, full trees).
      last_bytes: bytes of the last publish to one receiver.
      last_changed, elements: changed elements in the newest version vs the one
        before, and elements of the tree (``last_changed / elements`` is the fraction).
    """

    deltas: int = 0
    fulls: int = 0
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bytes: int = 0
    last_bytes: int = 0
    last_changed: int = 0
    elements: int = 0

    def sync_fields(self) -> dict[str, Any]:
        """``changed_frac``: of the newest version vs the one before; ``full_fallbacks``:
        full publishes so far to a receiver that held weights (lagging, drifted, refused)."""
        return {"changed_frac": self.last_changed / max(self.elements, 1),
                "full_fallbacks": self.fulls - self.fallbacks["new"]}  # fmt: skip


def _devices(leaves: list[Any]) -> list[Any]:
    return [getattr(getattr(x, "sharding", None), "device_set", None) for x in leaves]


def _nbytes(leaves: list[Any]) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))


class DeltaSource:
    """The sender's side: the newest engine-side leaves, the previous version's digests,
    the deltas between them.

    Leaves are jax.Arrays on the sender's devices (one program's whole leaves, or one
    process's shards: the encoding is per array). ``advance`` runs one fused device pass
    per leaf (``delta.diff``: XOR, count, digest) and drops the previous leaves; each
    leaf's delta is compressed once, when the first receiver asks for it, and shared.
    """

    def __init__(self) -> None:
        self.version: PolicyVersion | None = None
        self.leaves: list[Any] = []
        self.digests: list[tuple[int, int]] = []
        self._prev: tuple[PolicyVersion, list[tuple[int, int]]] | None = None
        self._diffs: list[Diff | None] = []
        self._deltas: dict[int, LeafDelta] = {}

    @property
    def digest(self) -> str | None:
        """``tree_digest`` of the newest version (None before the first ``advance``)."""
        return None if self.version is None else tree_digest(self.digests)

    def advance(self, leaves: list[Any], version: PolicyVersion) -> list[int] | None:
        """Make ``leaves`` the newest version; the one before becomes the delta base.

        Returns:
          Changed elements per leaf vs the previous version (None at the first, or
          when the leaves moved to other devices).

        Raises:
          ValueError: a version that does not increase; leaves whose shapes or dtypes
            differ from the previous version's.
        """
        check_version(version, self.version)
        leaves = list(leaves)
        counts, self._prev, diffs = None, None, []
        if self.version is not None and _devices(self.leaves) == _devices(leaves):
            diffs = [diff(a, b) for a, b in zip(self.leaves, leaves, strict=True)]
            counts = [d.changed for d in diffs]
            digests = [d.new_digest for d in diffs]
            self._prev = (self.version, self.digests)
        else:
            # Leaves that moved to other devices (the learner resharded onto a new mesh,
            # ``ThreadFleet.resize``) start a new chain: every receiver takes the full tree.
            digests = [leaf_digest(x) for x in leaves]
        self.version, self.leaves, self.digests = int(version), leaves, digests
        self._diffs, self._deltas = diffs, {}
        return counts

    def delta_for(self, state: ReceiverState) -> tuple[list[LeafDelta] | None, str | None]:
        """(deltas, None) for a receiver holding exactly the previous version, else
        (None, reason): ``new``, ``lagging`` or ``drifted`` (module docstring)."""
        if state.version is None:
            return None, "new"
        if self._prev is None or int(state.version) != self._prev[0]:
            return None, "lagging"
        if state.digest != tree_digest(self._prev[1]):
            return None, "drifted"
        return [self._encoded(i) for i in range(len(self.leaves))], None

    def leaf_delta(
        self, i: int, version: PolicyVersion | None, digest: tuple[int, int] | None
    ) -> tuple[LeafDelta | None, str | None]:
        """``delta_for`` for leaf ``i`` alone (one block of a transfer): the receiver
        holds that leaf at ``version`` with ``digest``."""
        if version is None:
            return None, "new"
        if self._prev is None or int(version) != self._prev[0]:
            return None, "lagging"
        if digest is None or tuple(digest) != tuple(self._prev[1][i]):
            return None, "drifted"
        return self._encoded(i), None

    def _encoded(self, i: int) -> LeafDelta:
        """Leaf ``i``'s delta, compressed once per version (shared by every receiver)."""
        if i not in self._deltas:
            self._deltas[i] = encode(self._diffs[i])
            self._diffs[i] = None  # the device XOR is no longer needed
        return self._deltas[i]


class DeltaSink:
    """A receiver's side: the leaves it holds, their version and digests."""

    def __init__(self) -> None:
        self.version: PolicyVersion | None = None
        self.leaves: list[Any] = []
        self.digests: list[tuple[int, int]] = []

    def state(self) -> ReceiverState:
        """What to report to the sender."""
        if self.version is None:
            return ReceiverState(None, None)
        return ReceiverState(self.version, tree_digest(self.digests))

    def install_full(
        self, leaves: list[Any], version: PolicyVersion, digests: list | None = None
    ) -> None:
        """Hold ``leaves`` as ``version`` (digests computed here unless given)."""
        check_version(version, self.version)
        self.leaves = list(leaves)
        self.digests = [leaf_digest(x) for x in self.leaves] if digests is None else list(digests)
        self.version = int(version)

    def apply(self, deltas: list[LeafDelta], version: PolicyVersion) -> list[Any]:
        """Apply every leaf's delta; install only if all pass their digest check.

        Every leaf's device pass is started before any is checked (the host
        decompresses the next leaf while the device applies this one).

        Raises:
          DigestMismatchError: a leaf's result is not the sender's (names the leaf);
            the sink keeps its leaves and version.
          ValueError: a version that does not increase; a delta count or a leaf's
            shape/dtype that differs.
        """
        check_version(version, self.version)
        if len(deltas) != len(self.leaves):
            raise ValueError(f"DeltaSink: {len(deltas)} deltas for {len(self.leaves)} leaves")
        started = []
        for i, (base, d) in enumerate(zip(self.leaves, deltas, strict=True)):
            try:
                started.append(start_apply(base, d))
            except DigestMismatchError as err:
                raise DigestMismatchError(f"leaf {i}: {err}") from err
        for i, ((out, digest), d) in enumerate(zip(started, deltas, strict=True)):
            try:
                check_applied(out, digest, d, self.digests[i])
            except DigestMismatchError as err:
                raise DigestMismatchError(f"leaf {i}: {err}") from err
        out = [o for o, _ in started]
        self.install_full(out, version, [tuple(d.digest) for d in deltas])
        return out


class DeltaPublisher:
    """Delta publish to thread engines: one source, a ``DeltaSink`` per engine.

    Args:
      engine_view: learner params -> the tree as the engine keeps it (same structure,
        the matmul weights cast to the engine's dtype, ``as_engine_dtypes``), on the
        learner's devices; jitted by the caller or here (once).

    Exact: the engine-side values are the same cast of the same learner values that
    ``LlamaEngine.place_params`` computes from a full publish, so the receiver's
    tree is bit-identical to a full publish's (tests/sync/test_delta_publish.py).
    """

    def __init__(self, engine_view: Callable[[Any], Any]) -> None:
        self._view = jax.jit(engine_view)
        self.source = DeltaSource()
        self.stats = DeltaStats()
        self._treedef: Any = None

    def advance(self, params: Any, version: PolicyVersion) -> None:
        """The learner's params as the newest version (once per version, any slots)."""
        leaves, self._treedef = jax.tree.flatten(self._view(params))
        counts = self.source.advance(leaves, version)
        self.stats.elements = int(sum(np.prod(x.shape) for x in leaves))
        self.stats.last_changed = self.stats.elements if counts is None else sum(counts)

    def publish(self, sink: DeltaSink, target_shardings: Any, version: PolicyVersion) -> Any:
        """The newest version onto ``sink``'s engine (a delta when it holds the previous
        one, else the full tree, device to device); returns the engine-side params tree.

        Raises:
          ValueError: ``version`` is not the source's newest (``advance`` first), or
            does not exceed the sink's.
        """
        if version != self.source.version:
            raise ValueError(
                f"DeltaPublisher: publishing version {version}, the newest is "
                f"{self.source.version} (call advance first)"
            )
        check_version(version, sink.version)
        deltas, reason = self.source.delta_for(sink.state())
        if deltas is not None:
            try:
                leaves = sink.apply(deltas, version)
                sent = sum(d.nbytes for d in deltas)
                self.stats.deltas += 1
                self._count(sent)
                return jax.tree.unflatten(self._treedef, leaves)
            except DigestMismatchError:
                reason = "refused"
        tree = jax.tree.unflatten(self._treedef, self.source.leaves)
        moved = publish(tree, target_shardings, version).params
        sink.install_full(jax.tree.leaves(moved), version, self.source.digests)
        self.stats.fulls += 1
        self.stats.fallbacks[reason] += 1
        self._count(_nbytes(self.source.leaves))
        return moved

    def _count(self, sent: int) -> None:
        self.stats.last_bytes = sent
        self.stats.bytes += sent
