"""Delta publish: bit-equal to a full publish after many deltas, fallbacks, digest refusals."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash.generation.engine.params import as_engine_dtypes
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.sync import delta as codec
from jaxflash.sync.delta_publish import DeltaPublisher, DeltaSink, DeltaSource, ReceiverState
from jaxflash.sync.publish import publish

CONFIG = get_preset("tiny", compute_dtype="bfloat16")


def _bits(x):
    a = np.asarray(jax.device_get(x))
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_tree_bits_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(_bits(x), _bits(y))


@pytest.fixture(scope="module")
def setup():
    devices = np.asarray(jax.devices()[:6])
    learner = Mesh(devices[:4].reshape(2, 2), ("data", "model"))
    gen = Mesh(devices[4:6].reshape(1, 2), ("data", "model"))
    params = init_params(CONFIG, seed=0)

    def lshard(x):
        spec = P(None, "model") if x.ndim >= 2 and x.shape[1] % 2 == 0 else P()
        return NamedSharding(learner, spec)

    params = jax.tree.map(lambda x: jax.device_put(x, lshard(x)), params)
    targets = jax.tree.map(
        lambda x: NamedSharding(
            gen, P(None, "model") if x.ndim >= 2 and x.shape[1] % 2 == 0 else P()
        ),
        params,
    )
    view = functools.partial(as_engine_dtypes, model_config=CONFIG)
    return params, targets, view


@functools.partial(jax.jit, static_argnames="lr")
def _step(params, key, lr):
    """A stand-in Adam step: every weight moves by about lr (sign of noise), as Adam does."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    moved = [
        x - lr * jax.numpy.sign(jax.random.normal(k, x.shape))
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, moved)


def test_receiver_bit_equal_to_full_publish_after_many_deltas(setup):
    params, targets, view = setup
    pub, sink = DeltaPublisher(view), DeltaSink()
    key = jax.random.key(1)
    for v in range(12):
        if v:
            key, sub = jax.random.split(key)
            params = _step(params, sub, 5e-6)
        pub.advance(params, v)
        got = pub.publish(sink, targets, v)
        full = publish(view(params), targets, v).params
        _assert_tree_bits_equal(got, full)
        for x, t in zip(jax.tree.leaves(got), jax.tree.leaves(targets), strict=True):
            assert x.sharding.is_equivalent_to(t, x.ndim)
    assert pub.stats.deltas == 11 and pub.stats.fulls == 1
    assert pub.stats.fallbacks == {"new": 1}
    # bf16 matmul weights mostly do not change at lr 5e-6; fp32 norms and embeddings do
    assert 0 < pub.stats.last_changed < pub.stats.elements
    assert pub.stats.bytes < 12 * sum(x.nbytes for x in jax.tree.leaves(view(params)))


def test_lagging_restarted_and_drifted_receivers_take_the_full_tree(setup):
    params, targets, view = setup
    pub = DeltaPublisher(view)
    steady, lagging = DeltaSink(), DeltaSink()
    pub.advance(params, 0)
    pub.publish(steady, targets, 0)
    pub.publish(lagging, targets, 0)
    for v in (1, 2):
        params = _step(params, jax.random.key(v), 1e-3)
        pub.advance(params, v)
        pub.publish(steady, targets, v)
    got = pub.publish(lagging, targets, 2)  # missed version 1
    assert pub.stats.fallbacks["lagging"] == 1
    _assert_tree_bits_equal(got, publish(view(params), targets, 2).params)
    restarted = DeltaSink()  # a receiver that restarted holds nothing
    pub.publish(restarted, targets, 2)
    assert pub.stats.fallbacks["new"] == 3
    # drifted: the right version, other bits (its reported digest is of what it holds)
    params = _step(params, jax.random.key(3), 1e-3)
    pub.advance(params, 3)
    steady.leaves[0] = steady.leaves[0] + 1
    steady.digests[0] = codec.leaf_digest(steady.leaves[0])
    got = pub.publish(steady, targets, 3)
    assert pub.stats.fallbacks["drifted"] == 1
    _assert_tree_bits_equal(got, publish(view(params), targets, 3).params)


def test_corrupted_delta_refused_by_digest(setup):
    params, targets, view = setup
    pub, sink = DeltaPublisher(view), DeltaSink()
    pub.advance(params, 0)
    pub.publish(sink, targets, 0)
    params = _step(params, jax.random.key(7), 5e-6)
    pub.advance(params, 1)
    deltas, _ = pub.source.delta_for(sink.state())
    i = next(i for i, d in enumerate(deltas) if not d.dense and d.count)  # a zstd payload
    bad = list(deltas)
    header, payload = codec.to_wire(deltas[i])
    flipped = bytearray(payload)
    flipped[-1] ^= 1  # one bit of the compressed XOR
    bad[i] = codec.from_wire(header, bytes(flipped))
    held = list(sink.leaves)
    with pytest.raises(codec.DigestMismatchError, match=f"leaf {i}"):
        sink.apply(bad, 1)
    assert sink.version == 0 and all(a is b for a, b in zip(sink.leaves, held, strict=True))
    # the publisher counts a refused delta and sends the full tree
    pub.source._deltas = dict(enumerate(bad))
    got = pub.publish(sink, targets, 1)
    assert pub.stats.fallbacks["refused"] == 1 and sink.version == 1
    _assert_tree_bits_equal(got, publish(view(params), targets, 1).params)


def test_wire_round_trip_digest_properties_and_a_wrong_xor_refused():
    rng = np.random.default_rng(0)
    prev = jax.numpy.asarray(rng.standard_normal((64, 48)), dtype=jax.numpy.bfloat16)
    new = prev.at[3, 5].set(7.0).at[60, 1].set(-2.0)
    d = codec.encode_leaf(prev, new)
    assert d.count == 2 and not d.dense and 0 < d.nbytes < prev.nbytes // 10
    header, payload = codec.to_wire(d)
    out = codec.apply_leaf(prev, codec.from_wire(header, payload))
    assert np.array_equal(_bits(out), _bits(new))
    # a payload that decodes (a valid zstd frame) to a wrong XOR: one more bit flipped
    wrong = codec.encode_leaf(prev, new.at[0, 0].set(-new[0, 0]))
    forged = codec.LeafDelta(d.shape, d.dtype, d.count, False, wrong.payload, d.digest)
    with pytest.raises(codec.DigestMismatchError, match="sender's"):
        codec.apply_leaf(prev, forged)
    with pytest.raises(codec.DigestMismatchError, match="does not decode"):
        codec.apply_leaf(prev, dataclasses.replace(d, payload=d.payload[:-3]))
    # nothing changed: no payload; all changed at random: sent whole (dense)
    same = codec.encode_leaf(prev, prev)
    assert same.count == 0 and same.nbytes == 0
    assert codec.apply_leaf(prev, same, codec.leaf_digest(prev)) is prev
    noise, other = (rng.integers(0, 2**32, (64, 48), np.uint32).view(np.float32) for _ in "ab")
    noise, other = jax.numpy.asarray(noise), jax.numpy.asarray(other)
    dense = codec.encode_leaf(noise, other)
    assert dense.dense and dense.nbytes == other.nbytes
    assert np.array_equal(_bits(codec.apply_leaf(noise, dense)), _bits(other))
    # the digest sees any one changed element (any bit), not the layout or the device
    assert codec.leaf_digest(new) != codec.leaf_digest(prev)
    flipped = np.asarray(new).copy().view(np.uint16)
    for bit in range(16):
        one = flipped.copy()
        one[17, 3] ^= 1 << bit
        assert codec.leaf_digest(one.view(new.dtype)) != codec.leaf_digest(new)
    assert codec.leaf_digest(np.asarray(new)) == codec.leaf_digest(new)
    src = DeltaSource()
    src.advance([prev], 0)
    assert src.delta_for(ReceiverState(None, None)) == (None, "new")
    with pytest.raises(ValueError, match="must increase"):
        src.advance([new], 0)
