"""Delta publish over the transfer wire (one process, a thread serving the sender)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash.sync import TransferError, TransferErrorKind, WeightReceiver, WeightSender
from jaxflash.sync.transfer_delta import ReceiverBase, pull_delta
from jaxflash.sync.transfer_layout import stage_for_layout
from tests.sync.test_transfer import serving

SPECS_L = {"embed_vd": P("fsdp", "tensor"), "layers": {"w_q_ldh": P(None, "fsdp", "tensor")}}
SPECS_G = {"embed_vd": P("tensor"), "layers": {"w_q_ldh": P(None, None, "tensor")}}


def _engine(tree):
    """The engine-side view: matmul weights in bfloat16, the embedding as is."""
    return {
        "embed_vd": tree["embed_vd"],
        "layers": {"w_q_ldh": tree["layers"]["w_q_ldh"].astype(jnp.bfloat16)},
    }


@pytest.fixture(scope="module")
def world():
    d = jax.devices()
    learner = Mesh(np.asarray(d[:4]).reshape(2, 2), ("fsdp", "tensor"))
    gen = Mesh(np.asarray(d[4:6]), ("tensor",))
    rng = np.random.default_rng(0)
    raw = {"embed_vd": rng.standard_normal((64, 32), np.float32),
           "layers": {"w_q_ldh": 0.05 * rng.standard_normal((2, 32, 64), np.float32)}}  # fmt: skip
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(learner, s)), raw, SPECS_L)
    template = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(gen, s)),
        raw,
        SPECS_G,
    )
    return params, template


@jax.jit
def _step(params, key):
    ks = jax.random.split(key, 2)
    w = params["layers"]["w_q_ldh"]
    w = w - 5e-6 * jnp.sign(jax.random.normal(ks[0], w.shape))
    e = params["embed_vd"]
    e = e.at[: e.shape[0] // 2].add(1e-3 * jax.random.normal(ks[1], (e.shape[0] // 2, e.shape[1])))
    return {"embed_vd": e, "layers": {"w_q_ldh": w}}


def _offer(sender, receiver, params, v):
    staged = stage_for_layout(params, receiver.layout)
    sender.offer(staged, v, engine=jax.jit(_engine)(staged))


def _bits_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.sharding.is_equivalent_to(y.sharding, x.ndim)
        assert np.asarray(jax.device_get(x)).tobytes() == np.asarray(jax.device_get(y)).tobytes()


def test_program_deltas_bit_equal_to_full_pull_then_fallbacks(world):
    params, template = world
    receiver, sender = WeightReceiver(template), WeightSender(jax_transfer=False)
    with sender, serving(sender):
        _offer(sender, receiver, params, 0)
        full = receiver.pull([sender.address], method="stream", version=0)
        base = ReceiverBase.of(jax.jit(_engine)(full.params), 0)
        moved = []
        for v in range(1, 7):
            params = _step(params, jax.random.key(v))
            _offer(sender, receiver, params, v)
            base, n = pull_delta(receiver, [sender.address], base, version=v)
            moved.append(n)
            # what a full pull + the engine's cast would hold: bit for bit
            check = WeightReceiver(template).pull([sender.address], method="stream", version=v)
            _bits_equal(base.tree, jax.jit(_engine)(check.params))
        full_bytes = sum(x.nbytes for x in jax.tree.leaves(_engine(params)))
        assert max(moved) < full_bytes  # the bf16 matrix barely changes at lr 5e-6
        assert sender.deltas.deltas_sent == 6 * 2 * 2  # 2 leaves x 2 blocks a version

        # lagging: a base one version behind is refused before any byte moves
        stale = base
        for v in (7, 8):
            params = _step(params, jax.random.key(v))
            _offer(sender, receiver, params, v)
        with pytest.raises(TransferError) as err:
            pull_delta(receiver, [sender.address], stale, version=8)
        assert err.value.kind is TransferErrorKind.STALE_BASE and "lagging" in str(err.value)
        # drifted: the right version, other bits (a restarted receiver rebuilt its base)
        params = _step(params, jax.random.key(9))
        current = WeightReceiver(template).pull([sender.address], method="stream", version=8)
        _offer(sender, receiver, params, 9)
        wrong = ReceiverBase.of(jax.jit(_engine)(jax.tree.map(lambda x: x + 1, current.params)), 8)
        with pytest.raises(TransferError) as err:
            pull_delta(receiver, [sender.address], wrong, version=9)
        assert err.value.kind is TransferErrorKind.STALE_BASE and "drifted" in str(err.value)


def test_corrupted_program_delta_refused_by_digest(world, monkeypatch):
    from jaxflash.sync import delta as codec

    params, template = world
    receiver, sender = WeightReceiver(template), WeightSender(jax_transfer=False)
    with sender, serving(sender):
        _offer(sender, receiver, params, 0)
        base = ReceiverBase.of(
            jax.jit(_engine)(receiver.pull([sender.address], method="stream").params), 0
        )
        params = _step(params, jax.random.key(1))
        _offer(sender, receiver, params, 1)
        real = codec.to_wire

        def corrupt(d):  # one flipped bit in the last byte of every payload
            header, payload = real(d)
            return header, payload[:-1] + bytes([payload[-1] ^ 1]) if payload else payload

        monkeypatch.setattr(codec, "to_wire", corrupt)
        with pytest.raises(TransferError) as err:
            pull_delta(receiver, [sender.address], base, version=1)
        assert err.value.kind is TransferErrorKind.DIGEST
