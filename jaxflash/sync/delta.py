"""Weight deltas: only the elements whose bits changed, checked by a digest of the result.

Between consecutive RL steps most engine-side weights are bit-identical (in bfloat16 an
Adam step of lr 5e-6 moves a weight of magnitude 0.05 by 1e-4 of itself, below half a
bfloat16 ulp, 2^-9 of it; see docs/PERF.md for the measured fraction). A ``LeafDelta``
carries, for one tensor (a whole leaf, or one shard of it in a program over several
hosts), the flat indices whose bit pattern changed (int32) and their new values, or
the whole tensor when that is smaller ("dense"), plus ``leaf_digest`` of the tensor
*after* the change. ``apply_leaf`` writes the values into the receiver's copy and
refuses the result (``DigestMismatchError``) unless its digest equals the sender's:
a receiver that applied a delta to the wrong base, or got corrupted bytes, never
installs them.

``leaf_digest`` runs on the device holding the tensor (a jitted reduction, no host
copy): two uint32 lanes, each the wrapping sum over elements i of
``fmix32(bits_i + fmix32(i ^ seed))`` (MurmurHash3's finalizer, a bijection on
uint32). Integer sums are exact in any order, so the digest does not depend on the
sharding or the device; changing any one element changes both lanes (a bijection of a
different input), and independent multi-element changes collide with probability
about 2^-64. It is a check against accidents (a lost, stale or corrupted delta), not a
cryptographic signature: the wire between learner and generation hosts is trusted.

Encoding is on the device too: ``changed_counts`` counts the changed elements of many
leaves in one program (one host sync), then ``encode_leaf`` extracts indices and values
with ``jnp.nonzero(size=cap)``: ``cap`` is the count rounded up to a power of two
(a bounded number of compiled programs), and the padding repeats index 0 with its
new value (writing it is harmless). ``to_wire`` / ``from_wire`` give the bytes for a
socket (``transfer_wire`` frames): the padding is cut there.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_SEEDS = (0x9E3779B9, 0x7F4A7C15)
_INDEX_BYTES = 4  # int32 flat indices (a tensor or shard of < 2^31 elements)


class DigestMismatchError(ValueError):
    """A delta whose result differs from the sender's tensor (wrong base or corrupted)."""


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
    """The flat bit patterns of ``x`` as uint32 (8-byte dtypes: two words an element)."""
    size = x.dtype.itemsize
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


@jax.jit
def _digest(x: jax.Array) -> jax.Array:
    b = _bits(x)
    i = jax.lax.iota(jnp.uint32, b.shape[0])
    return jnp.stack([jnp.sum(_fmix32(b + _fmix32(i ^ jnp.uint32(s)))) for s in _SEEDS])


def leaf_digest(x: Any) -> tuple[int, int]:
    """Digest of one tensor's bit pattern (module docstring), computed where it lives.

    Args:
      x: a jax.Array (any sharding, fully addressable) or numpy array; any dtype of
        1, 2, 4 or 8 bytes.

    Returns:
      Two uint32 lanes as Python ints. Equal for equal bits, shapes being equal; a
      dtype change with the same bits (float32 vs int32) is not seen: compare dtypes too.
    """
    return tuple(int(v) for v in np.asarray(_digest(x)))


def tree_digest(digests: list[tuple[int, int]]) -> str:
    """One hex string for a list of leaf digests, in order (what a receiver reports)."""
    return hashlib.sha256(np.asarray(digests, np.uint32).tobytes()).hexdigest()[:32]


@jax.jit
def _counts(prev: list[jax.Array], new: list[jax.Array]) -> jax.Array:
    pairs = zip(prev, new, strict=True)
    return jnp.stack([jnp.sum(_bits(a) != _bits(b), dtype=jnp.int32) for a, b in pairs])


def changed_counts(prev: list[Any], new: list[Any]) -> list[int]:
    """Elements whose bits differ, per leaf (one program per device set).

    Raises:
      ValueError: a pair with different shapes or dtypes (names the index).
    """
    for i, (a, b) in enumerate(zip(prev, new, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"changed_counts: leaf {i} was {a.shape} {a.dtype}, is {b.shape} {b.dtype}"
            )
    # One program per device set (a process's blocks live on different devices).
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(new):
        groups.setdefault(frozenset(getattr(x, "devices", lambda: ())()), []).append(i)
    out = [0] * len(new)
    for idx in groups.values():
        counts = np.asarray(_counts([prev[i] for i in idx], [new[i] for i in idx]))
        for i, c in zip(idx, counts, strict=True):
            out[i] = int(c)
    return out


def bucket(count: int) -> int:
    """``count`` rounded up to a power of two (>= 256): few compiled programs per leaf
    shape (each new size compiles the extraction and the write once, about a second
    per leaf on CPU), at most 2x padding on the device path (the wire cuts it)."""
    return max(256, 1 << max(0, count - 1).bit_length())


@functools.partial(jax.jit, static_argnames="cap")
def _extract(prev: jax.Array, new: jax.Array, cap: int) -> tuple[jax.Array, jax.Array]:
    (idx,) = jnp.nonzero(_bits(prev) != _bits(new), size=cap, fill_value=0)
    idx = idx.astype(jnp.int32)
    return idx, new.reshape(-1)[idx]


@dataclasses.dataclass(frozen=True)
class LeafDelta:
    """One tensor's change from the receiver's base to the sender's new value.

    Attributes:
      shape, dtype: the tensor's (the receiver checks its base against them).
      count: elements whose bits changed (the whole size when ``dense``).
      dense: ``values`` is the whole new tensor (a delta would not be smaller).
      indices: int32 [n] flat indices (C order), n >= count (padding repeats index 0);
        None when dense.
      values: [n] new values in ``dtype`` (dense: the tensor, its own shape).
      digest: ``leaf_digest`` of the new tensor.
    """

    shape: tuple[int, ...]
    dtype: Any
    count: int
    dense: bool
    indices: Any
    values: Any
    digest: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes this delta moves (padding included; ``to_wire`` cuts it)."""
        if self.dense:
            return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize
        return int(self.indices.shape[0]) * (_INDEX_BYTES + np.dtype(self.dtype).itemsize)


def encode_leaf(
    prev: Any, new: Any, count: int, digest: tuple[int, int] | None = None
) -> LeafDelta:
    """The delta from ``prev`` to ``new`` (same device and sharding), or ``new`` whole.

    Args:
      prev, new: the base the receiver holds and the new tensor (jax.Array or numpy).
      count: ``changed_counts`` for this pair.
      digest: ``leaf_digest(new)`` if already known.
    """
    n = int(np.prod(new.shape))
    if n >= 2**31:
        raise ValueError(f"encode_leaf: {n} elements exceed int32 indices; send shards")
    itemsize = np.dtype(new.dtype).itemsize
    digest = leaf_digest(new) if digest is None else digest
    cap = min(bucket(count), n)
    if cap * (_INDEX_BYTES + itemsize) >= n * itemsize:
        return LeafDelta(tuple(new.shape), new.dtype, n, True, None, new, digest)
    idx, vals = _extract(prev, new, cap)
    return LeafDelta(tuple(new.shape), new.dtype, int(count), False, idx, vals, digest)


def _write(base: jax.Array, idx: jax.Array, vals: jax.Array) -> jax.Array:
    flat = base.reshape(-1).at[idx].set(vals, mode="promise_in_bounds")
    return flat.reshape(base.shape)


@functools.lru_cache(maxsize=256)
def _scatter(sharding: Any) -> Any:
    """The jitted write, its output kept on ``sharding`` (built once per layout)."""
    return jax.jit(_write, out_shardings=sharding)


def apply_leaf(base: Any, delta: LeafDelta, *, check: bool = True) -> jax.Array:
    """``base`` with ``delta`` written into it, on ``base``'s devices and sharding.

    Args:
      base: the receiver's tensor (jax.Array; numpy goes to the default device).
      delta: from ``encode_leaf`` or ``from_wire`` (its arrays anywhere: they are
        moved next to ``base`` first; dense values are placed like ``base``).
      check: compare the result's digest with ``delta.digest``.

    Raises:
      ValueError: ``base``'s shape or dtype differs from the delta's.
      DigestMismatchError: the result's digest is not the sender's (the base was not
        the sender's base, or the delta was corrupted); ``base`` is unchanged.
    """
    base = jnp.asarray(base) if not isinstance(base, jax.Array) else base
    if tuple(base.shape) != delta.shape or base.dtype != delta.dtype:
        raise ValueError(
            f"apply_leaf: base is {base.shape} {base.dtype}, the delta {delta.shape} {delta.dtype}"
        )
    sharding = base.sharding
    if delta.dense:
        out = jax.device_put(delta.values, sharding)
    elif delta.count == 0:
        out = base
    else:
        replicated = sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        idx, vals = jax.device_put((delta.indices, delta.values), replicated)
        out = _scatter(sharding)(base, idx, vals)
    if check:
        got = leaf_digest(out)
        if got != tuple(delta.digest):
            raise DigestMismatchError(
                f"delta result digest {got} != sender's {tuple(delta.digest)} "
                f"({delta.count} changed of {int(np.prod(delta.shape))})"
            )
    return out


def to_wire(delta: LeafDelta) -> tuple[dict[str, Any], bytes]:
    """(JSON header, payload) of one delta for a ``transfer_wire`` frame (host copy).

    The payload is the indices (int32 little-endian, padding cut) then the values, or
    the dense tensor's bytes.
    """
    values = np.asarray(jax.device_get(delta.values))
    header = {
        "shape": list(delta.shape),
        "dtype": np.dtype(delta.dtype).name,
        "count": delta.count,
        "dense": delta.dense,
        "digest": list(delta.digest),
    }
    if delta.dense:
        payload = np.ascontiguousarray(values).reshape(-1).view(np.uint8).tobytes()
    else:
        idx = np.asarray(jax.device_get(delta.indices))[: delta.count].astype("<i4")
        payload = (
            idx.tobytes() + np.ascontiguousarray(values[: delta.count]).view(np.uint8).tobytes()
        )
    header["nbytes"] = len(payload)
    return header, payload


def from_wire(header: dict[str, Any], payload: bytes) -> LeafDelta:
    """The ``LeafDelta`` of a ``to_wire`` frame (numpy arrays; ``apply_leaf`` moves them).

    Raises:
      ValueError: a payload whose size does not match the header (names both).
    """
    shape = tuple(int(s) for s in header["shape"])
    dtype = jnp.dtype(header["dtype"])
    count, dense = int(header["count"]), bool(header["dense"])
    n = int(np.prod(shape))
    want = n * dtype.itemsize if dense else count * (_INDEX_BYTES + dtype.itemsize)
    if len(payload) != want:
        raise ValueError(f"from_wire: payload of {len(payload)} bytes, the header says {want}")
    digest = tuple(int(d) for d in header["digest"])
    if dense:
        values = np.frombuffer(payload, dtype).reshape(shape)
        return LeafDelta(shape, dtype, n, True, None, values, digest)
    idx = np.frombuffer(payload, "<i4", count).astype(np.int32)
    values = np.frombuffer(payload, dtype, count, offset=count * _INDEX_BYTES)
    if count:  # pad to the bucket by repeating the last write (harmless): few compiles
        pad = min(bucket(count), n) - count
        idx, values = np.pad(idx, (0, pad), mode="edge"), np.pad(values, (0, pad), mode="edge")
    return LeafDelta(shape, dtype, count, False, idx, values, digest)
