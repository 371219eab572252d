"""Weight deltas: the XOR of the engine-side bits, zstd-compressed, checked by a digest.

Between consecutive RL steps most engine-side weights are bit-identical (in bfloat16 an
Adam step of lr 5e-6 moves a weight of magnitude 0.05 by 1e-4 of itself, below half a
bfloat16 ulp, 2^-9 of it; see docs/PERF.md for the measured fraction). A ``LeafDelta``
carries, for one tensor (a whole leaf, or one shard of it in a program over several
hosts), the zstd-compressed XOR of its old and new bit patterns (4-byte words by
byte plane: a float whose value moved by a few ulps differs only in its low bytes,
so the high planes are zeros that compress away; the changed bf16 weights of a step
are sparse, so most of their XOR is zero words), plus
``leaf_digest`` of the tensor *after* the change (slime ships the same encoding). When
compression would not make it smaller the new bits go whole (``dense``). ``apply_leaf``
XORs it into the receiver's copy and refuses the result (``DigestMismatchError``)
unless its digest equals the sender's: a receiver that applied a delta to the wrong
base, or got corrupted bytes, never installs them.

Device work is elementwise programs and per-block reductions, compiled once per shape
and reused every step: the sender's (``diff``: the XOR, then per block the changed
count and the new tensor's digest) and the receiver's (base XOR delta, then the
result's digest). Compression runs on the host (zstandard, level 1).

``leaf_digest`` runs where the tensor lives, block by block (one single-device program
per shard, summed on the host: no program spans devices): two uint32 lanes,
``sum_i h_i`` and ``sum_i h_i * (2i + 1)`` with ``h_i = fmix32(bits_i ^ (i * K + S))``
(MurmurHash3's finalizer, a bijection on uint32). Integer sums are exact in any order,
so the digest does not depend on the sharding or the device; changing any one element
changes both lanes (``h_i`` changes, and ``2i + 1`` is odd); independent multi-element
changes collide with probability about 2^-63. It is a check against accidents (a
lost, stale or corrupted delta), not a cryptographic signature: the wire between
learner and generation hosts is trusted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zstandard

_MUL, _SEED = 0x9E3779B9, 0x7F4A7C15
ZSTD_LEVEL = 1  # measured: level 1 on byte planes compresses ~2x better than -1, as fast


class DigestMismatchError(ValueError):
    """A delta whose result differs from the sender's tensor (wrong base or corrupted)."""


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bit patterns as unsigned integers of its width (8-byte dtypes: a trailing
    axis of two uint32 words; bool as uint8)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned)


def _word_layout(shape: tuple[int, ...], dtype: Any) -> tuple[Any, tuple[int, ...]]:
    """(numpy dtype, shape) of ``_words`` of a ``shape`` ``dtype`` tensor."""
    width = np.dtype(dtype).itemsize
    if np.dtype(dtype) == np.bool_:
        return np.dtype(np.uint8), shape
    if width == 8:
        return np.dtype(np.uint32), (*shape, 2)
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32}[width]), shape


def _from_words(w: jax.Array, dtype: Any) -> jax.Array:
    if dtype == jnp.bool_:
        return w != 0
    return jax.lax.bitcast_convert_type(w, dtype)


def _digest_of(x: jax.Array, starts: Any = None, full: tuple[int, ...] | None = None) -> jax.Array:
    """The digest lanes of ``x``, or of ``x`` as the block at ``starts`` (uint32 per
    axis) of a ``full``-shaped tensor (its elements' flat indices in that tensor)."""
    w = _words(x)
    if full is None:
        i = jax.lax.iota(jnp.uint32, w.size).reshape(w.shape)
    else:
        full = (*full, *w.shape[len(full) :])  # 8-byte words: their trailing axis
        strides = [int(v) % 2**32 for v in np.cumprod((1, *full[::-1]))[-2::-1]]
        i = jnp.zeros(w.shape, jnp.uint32)
        for axis, stride in enumerate(strides):
            at = jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis)
            start = starts[axis] if axis < starts.shape[0] else jnp.uint32(0)
            i = i + (at + start) * jnp.uint32(stride)
    h = _fmix32(w.astype(jnp.uint32) ^ (i * jnp.uint32(_MUL) + jnp.uint32(_SEED)))
    return jnp.stack([jnp.sum(h), jnp.sum(h * (i * jnp.uint32(2) + jnp.uint32(1)))])


@functools.partial(jax.jit, static_argnames="full")
def _block_parts(block: jax.Array, starts: jax.Array, full: tuple[int, ...]) -> jax.Array:
    """[count of nonzero words, digest lane 0, lane 1] of one block (single device)."""
    count = jnp.sum(_words(block) != 0, dtype=jnp.uint32)
    return jnp.concatenate([count[None], _digest_of(block, starts, full)])


def _blocks(x: jax.Array) -> list[tuple[jax.Array, np.ndarray]]:
    """Each distinct block of ``x`` this process holds, with its start per axis."""
    out, seen = [], set()
    for shard in x.addressable_shards:
        starts = tuple(s.indices(n)[0] for s, n in zip(shard.index, x.shape, strict=True))
        if starts not in seen:
            seen.add(starts)
            out.append((shard.data, np.asarray(starts, np.uint32)))
    return out


def _sum_parts(x: jax.Array) -> list[Any]:
    """Dispatch ``_block_parts`` on every block of ``x`` (device arrays, summed when
    read): no program spans devices, so none waits on a rendezvous with programs that
    other threads run on the same devices (a generation server's, on a colocated mesh)."""
    full = tuple(int(n) for n in x.shape)
    return [_block_parts(block, starts, full) for block, starts in _blocks(x)]


def _read_parts(parts: list[Any]) -> np.ndarray:
    total = np.zeros(3, np.uint64)
    for p in parts:
        total += np.asarray(p).astype(np.uint64)
    return total % 2**32


def leaf_digest(x: Any) -> tuple[int, int]:
    """Digest of one tensor's bit pattern (module docstring), computed where it lives,
    block by block.

    Args:
      x: a jax.Array (any sharding; this process's blocks must cover it) or numpy
        array; any dtype of 1, 2, 4 or 8 bytes.

    Returns:
      Two uint32 lanes as Python ints. Equal for equal bits, shapes being equal; a
      dtype change with the same bits (float32 vs int32) is not seen: compare dtypes too.
    """
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    return tuple(int(v) for v in _read_parts(_sum_parts(x))[1:])


def tree_digest(digests: list[tuple[int, int]]) -> str:
    """One hex string for a list of leaf digests, in order (what a receiver reports)."""
    return hashlib.sha256(np.asarray(digests, np.uint32).tobytes()).hexdigest()[:32]


_xor = jax.jit(lambda prev, new: _words(prev) ^ _words(new))  # elementwise: per device


@dataclasses.dataclass(frozen=True)
class Diff:
    """The sender's side of one tensor's change, still on its devices (``diff``).

    Attributes:
      xor: old bits XOR new bits (``_words`` of the tensor's shape).
      count, digest: per-block parts of the XOR's and the new tensor's (device
        arrays until read: ``changed`` and ``new_digest``).
      new: the new tensor (sent whole when compression does not pay).
    """

    xor: Any
    count: Any
    digest: Any
    new: Any

    @property
    def changed(self) -> int:
        """Words whose bits changed (elements; 8-byte dtypes count each half)."""
        return int(_read_parts(self.count)[0])

    @property
    def new_digest(self) -> tuple[int, int]:
        """``leaf_digest`` of the new tensor."""
        return tuple(int(v) for v in _read_parts(self.digest)[1:])


def diff(prev: Any, new: Any) -> Diff:
    """The XOR of ``prev`` and ``new`` (same shape, dtype and devices), the changed
    count and the new digest, per block and asynchronously (read ``changed`` and
    ``new_digest`` when needed).

    Raises:
      ValueError: different shapes or dtypes (names both).
    """
    if tuple(prev.shape) != tuple(new.shape) or prev.dtype != new.dtype:
        raise ValueError(
            f"diff: the base is {prev.shape} {prev.dtype}, new {new.shape} {new.dtype}"
        )
    xor = _xor(prev, new)
    return Diff(xor, _sum_parts(xor), _sum_parts(new), new)


# Words of 4+ bytes go by byte plane (every element's byte 0, then byte 1, ...): an fp32
# weight moved by a few ulps differs in its low bytes only, and the zero high planes
# compress away (SmolLM2's fp32 embedding: 38 % of its size vs 50 % interleaved). A
# bf16 XOR is mostly zero words already (1 % changed): interleaved compresses as well,
# and skips two transposes of the tensor on the host.
_PLANES_FROM = 4


def _planes(a: np.ndarray) -> np.ndarray:
    """The bytes zstd compresses: by plane for 4-byte words, else as laid out."""
    width = a.dtype.itemsize
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return flat if width < _PLANES_FROM else np.ascontiguousarray(flat.reshape(-1, width).T)


def _unplanes(planes: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    if width < _PLANES_FROM:
        return planes.view(dtype).reshape(shape)
    out = np.empty((planes.size // width, width), np.uint8)
    for k, plane in enumerate(planes.reshape(width, -1)):  # 3x faster than a .T copy
        out[:, k] = plane
    return out.reshape(-1).view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class LeafDelta:
    """One tensor's change from the receiver's base to the sender's new value.

    Attributes:
      shape, dtype: the tensor's (the receiver checks its base against them).
      count: elements whose bits changed.
      dense: ``payload`` is the new tensor's raw bytes (compressing did not pay);
        else the zstd frame of the XOR's byte planes (empty when ``count`` is 0).
      payload: the bytes that move.
      digest: ``leaf_digest`` of the new tensor.
    """

    shape: tuple[int, ...]
    dtype: Any
    count: int
    dense: bool
    payload: bytes
    digest: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes this delta moves."""
        return len(self.payload)


def encode(d: Diff) -> LeafDelta:
    """The ``LeafDelta`` of a ``diff`` (blocks until it is computed; compresses on the
    host)."""
    count, digest = d.changed, d.new_digest
    shape, dtype = tuple(d.new.shape), d.new.dtype
    if count == 0:
        return LeafDelta(shape, dtype, 0, False, b"", digest)
    xor = np.asarray(jax.device_get(d.xor))
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_planes(xor))
    if len(payload) >= xor.nbytes:  # no gain: the new bits, whole (no base needed)
        raw = np.ascontiguousarray(jax.device_get(d.new)).reshape(-1).view(np.uint8)
        return LeafDelta(shape, dtype, count, True, raw.tobytes(), digest)
    return LeafDelta(shape, dtype, count, False, payload, digest)


def encode_leaf(prev: Any, new: Any) -> LeafDelta:
    """``encode(diff(prev, new))``: the delta from ``prev`` to ``new``."""
    return encode(diff(prev, new))


_xor_into = jax.jit(lambda base, xor: _from_words(_words(base) ^ xor, base.dtype))


def start_apply(base: Any, delta: LeafDelta) -> tuple[jax.Array, Any]:
    """``base`` with ``delta`` applied, on ``base``'s devices and sharding, and the
    result's digest (device array; or None when nothing changed); not yet checked
    (``check_applied``). Decompresses on the host; the device pass runs asynchronously.

    Raises:
      ValueError: ``base``'s shape or dtype differs from the delta's.
      DigestMismatchError: a payload that does not decode to the tensor's size.
    """
    base = jnp.asarray(base) if not isinstance(base, jax.Array) else base
    if tuple(base.shape) != delta.shape or base.dtype != delta.dtype:
        raise ValueError(
            f"apply: the base is {base.shape} {base.dtype}, the delta {delta.shape} {delta.dtype}"
        )
    if delta.count == 0 and not delta.dense:
        return base, None
    width = np.dtype(delta.dtype).itemsize
    size = int(np.prod(delta.shape)) * width
    raw = delta.payload
    if not delta.dense:
        try:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=size)
        except zstandard.ZstdError as err:
            raise DigestMismatchError(f"delta payload does not decode: {err}") from err
    if len(raw) != size:
        raise DigestMismatchError(f"delta payload decodes to {len(raw)} bytes, not {size}")
    if delta.dense:
        new = np.frombuffer(raw, np.dtype(delta.dtype)).reshape(delta.shape)
        out = jax.device_put(new, base.sharding)
    else:
        words, shape = _word_layout(delta.shape, delta.dtype)
        xor = _unplanes(np.frombuffer(raw, np.uint8), words, shape)
        out = _xor_into(base, jax.device_put(xor, base.sharding))
    return out, _sum_parts(out)


def check_applied(out: Any, digest: Any, delta: LeafDelta, base_digest: Any = None) -> None:
    """Raise ``DigestMismatchError`` unless the applied result's digest is the sender's
    (``digest`` None: nothing changed, the base's ``base_digest`` must be it)."""
    got = base_digest if digest is None else tuple(int(v) for v in _read_parts(digest)[1:])
    if got is None:
        got = leaf_digest(out)
    if tuple(got) != tuple(delta.digest):
        raise DigestMismatchError(
            f"delta result digest {tuple(got)} != sender's {tuple(delta.digest)} "
            f"({delta.count} changed of {int(np.prod(delta.shape))})"
        )


def apply_leaf(base: Any, delta: LeafDelta, base_digest: Any = None) -> jax.Array:
    """``base`` with ``delta`` applied, checked (``start_apply`` + ``check_applied``).

    Args:
      base_digest: ``leaf_digest(base)`` if known (saves a pass when nothing changed).

    Raises:
      ValueError: ``base``'s shape or dtype differs from the delta's.
      DigestMismatchError: the result's digest is not the sender's (the base was not
        the sender's base, or the delta was corrupted); ``base`` is unchanged.
    """
    out, digest = start_apply(base, delta)
    check_applied(out, digest, delta, base_digest)
    return out


def to_wire(delta: LeafDelta) -> tuple[dict[str, Any], bytes]:
    """(JSON header, payload) of one delta for a ``transfer_wire`` frame."""
    header = {
        "shape": list(delta.shape),
        "dtype": np.dtype(delta.dtype).name,
        "count": delta.count,
        "dense": delta.dense,
        "digest": list(delta.digest),
        "nbytes": len(delta.payload),
    }
    return header, delta.payload


def from_wire(header: dict[str, Any], payload: bytes) -> LeafDelta:
    """The ``LeafDelta`` of a ``to_wire`` frame.

    Raises:
      ValueError: a header missing a field, or a payload whose size is not the
        header's ``nbytes``.
    """
    try:
        shape = tuple(int(s) for s in header["shape"])
        dtype = jnp.dtype(header["dtype"])
        count, dense, nbytes = int(header["count"]), bool(header["dense"]), int(header["nbytes"])
        digest = tuple(int(d) for d in header["digest"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"from_wire: bad header {header!r}") from err
    if len(payload) != nbytes:
        raise ValueError(f"from_wire: payload of {len(payload)} bytes, the header says {nbytes}")
    return LeafDelta(shape, dtype, count, dense, bytes(payload), digest)
