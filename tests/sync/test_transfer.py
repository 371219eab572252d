"""sync.transfer_*: layout descriptors, refusals and both transfer paths in one process.

The cross-process versions (separate JAX programs, a killed sender) are in
test_transfer_procs.py; here a thread runs the sender's ``serve`` loop.
"""

import contextlib
import json
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash.sync import (
    LayoutMismatchError,
    TransferError,
    TransferErrorKind,
    TreeLayout,
    WeightReceiver,
    WeightSender,
    check_receivable,
    layout_of,
    stage_for_layout,
)
from jaxflash.sync.transfer_layout import LeafLayout
from jaxflash.sync.transfer_wire import connect, recv_message, send_message


def _mesh(devices, shape, names):
    return Mesh(np.asarray(devices).reshape(shape), names)


def _raw(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed_vd": rng.standard_normal((16, 8)).astype(np.float32),
        "layers": {
            "w_q_ldnh": rng.standard_normal((2, 8, 4, 2)).astype(jnp.bfloat16),
            "norm_ld": rng.standard_normal((2, 8)).astype(np.float32),
        },
        "step": np.int32(7),
    }


LEARNER_SPECS = {
    "embed_vd": P("fsdp", "tensor"),
    "layers": {"w_q_ldnh": P(None, "fsdp", "tensor"), "norm_ld": P()},
    "step": P(),
}
GEN_SPECS = {
    "embed_vd": P("tensor"),
    "layers": {"w_q_ldnh": P(None, None, "tensor"), "norm_ld": P()},
    "step": P(),
}


def _place(raw, mesh, specs):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), raw, specs)


def _template(raw, mesh, specs):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, s)),
        raw,
        specs,
    )


@pytest.fixture
def meshes():
    d = jax.devices()
    learner = _mesh(d[:4], (2, 2), ("fsdp", "tensor"))
    gen = _mesh(d[4:6], (2,), ("tensor",))
    return learner, gen


@contextlib.contextmanager
def serving(sender):
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            sender.serve(0.02)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield sender
    finally:
        stop.set()
        t.join(5)


def _bit_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        xh, yh = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
        assert xh.dtype == yh.dtype and xh.shape == yh.shape
        assert xh.tobytes() == yh.tobytes()


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "shape,names,spec",
    [
        ((2, 4), ("data", "fsdp"), P("fsdp")),
        ((2, 4), ("data", "fsdp"), P(("data", "fsdp"))),
        ((2, 4), ("data", "fsdp"), P(("fsdp", "data"))),
        ((2, 2, 2), ("a", "b", "c"), P("c", ("a", "b"))),
        ((8,), ("x",), P(None, "x")),
        ((2, 4), ("data", "fsdp"), P()),
    ],
)
def test_block_arithmetic_matches_jax(shape, names, spec):
    mesh = _mesh(jax.devices(), shape, names)
    sds = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, spec))
    leaf = layout_of({"w": sds}).leaves[0]  # raises if it disagrees with devices_indices_map
    jax_map = sds.sharding.devices_indices_map((16, 8))
    for p, dev in enumerate(mesh.devices.flat):
        assert leaf.shard_index(p) == tuple(
            s.indices(n)[:2] for s, n in zip(jax_map[dev], (16, 8), strict=True)
        )


def test_layout_json_round_trip_and_strictness(meshes):
    learner, _ = meshes
    layout = layout_of(_place(_raw(), learner, LEARNER_SPECS))
    text = json.dumps(layout.to_json())
    assert TreeLayout.from_json(json.loads(text)) == layout
    bad = json.loads(text)
    bad["leaves"][0]["extra"] = 1
    with pytest.raises(ValueError, match="needs keys"):
        TreeLayout.from_json(bad)
    with pytest.raises(ValueError, match="format"):
        TreeLayout.from_json({"format": 99, "leaves": []})
    with pytest.raises(ValueError, match="not divisible"):
        LeafLayout(path="w", shape=(3,), dtype="float32", mesh_axes=("x",), mesh_shape=(2,),
                   spec=("x",))  # fmt: skip
    with pytest.raises(ValueError, match="not in mesh"):
        LeafLayout(path="w", shape=(4,), dtype="float32", mesh_axes=("x",), mesh_shape=(2,),
                   spec=("y",))  # fmt: skip


def test_check_receivable_refuses_mismatched_sharding_naming_leaf_and_layouts(meshes):
    learner, gen = meshes
    raw = _raw()
    offered = layout_of(_place(raw, learner, LEARNER_SPECS))
    wanted = layout_of(_template(raw, gen, GEN_SPECS))
    with pytest.raises(LayoutMismatchError) as err:
        check_receivable(offered, wanted)
    msg = str(err.value)
    assert err.value.path == "['embed_vd']"
    assert "mesh (tensor=2) spec P('tensor', None)" in msg
    assert "mesh (fsdp=2, tensor=2) spec P('fsdp', 'tensor')" in msg  # the sender's too
    # Same layout on the sender: accepted.
    check_receivable(layout_of(_place(raw, gen, GEN_SPECS)), wanted)


def test_check_receivable_refuses_shape_dtype_and_tree_differences(meshes):
    _, gen = meshes
    raw = _raw()
    wanted = layout_of(_template(raw, gen, GEN_SPECS))
    other = dict(raw, step=np.float32(7))
    with pytest.raises(LayoutMismatchError, match=r"\['step'\].*float32.*int32"):
        check_receivable(layout_of(_template(other, gen, GEN_SPECS)), wanted)
    fewer = {k: v for k, v in raw.items() if k != "step"}
    specs = {k: v for k, v in GEN_SPECS.items() if k != "step"}
    with pytest.raises(LayoutMismatchError, match="missing on the sender"):
        check_receivable(layout_of(_template(fewer, gen, specs)), wanted)


def test_stage_for_layout_makes_shards_whole_and_fresh(meshes):
    learner, gen = meshes
    raw = _raw()
    params = _place(raw, learner, LEARNER_SPECS)
    wanted = layout_of(_template(raw, gen, GEN_SPECS))
    staged = stage_for_layout(params, wanted)
    check_receivable(layout_of(staged), wanted)
    _bit_equal(staged, raw)
    jax.tree.map(lambda x: x.delete(), params)  # as the learner's donation would
    _bit_equal(staged, raw)
    with pytest.raises(LayoutMismatchError, match="not a multiple"):
        three = _mesh(jax.devices()[:3], (3,), ("tensor",))
        stage_for_layout(params_on(three, raw), wanted)


def params_on(mesh, raw):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), raw)


# ------------------------------------------------------- sender <-> receiver


@pytest.mark.parametrize("method", ["transfer", "stream"])
def test_pull_is_bit_equal_versioned_and_refuses_going_back(meshes, method):
    learner, gen = meshes
    raw = _raw(1)
    receiver = WeightReceiver(_template(raw, gen, GEN_SPECS))
    with WeightSender() as sender, serving(sender):
        sender.offer(stage_for_layout(_place(raw, learner, LEARNER_SPECS), receiver.layout), 5)
        got = receiver.pull([sender.address], method=method, chunk_bytes=100)
        assert got.version == 5 and receiver.current is got
        _bit_equal(got.params, raw)
        want = jax.tree.leaves(_template(raw, gen, GEN_SPECS))
        for leaf, tmpl in zip(jax.tree.leaves(got.params), want, strict=True):
            assert leaf.sharding == tmpl.sharding  # the receiver's own sharding
        # The replicated leaf travelled once, not once per receiver device.
        assert receiver.stats.bytes == 16 * 8 * 4 + 2 * 8 * 4 * 2 * 2 + 2 * 8 * 4 + 4
        with pytest.raises(TransferError) as err:
            receiver.pull([sender.address], method=method)
        assert err.value.kind is TransferErrorKind.VERSION
        assert receiver.current is got and receiver.stats.failed["version"] == 1


def test_mismatched_receiver_is_refused_before_any_byte_moves(meshes):
    learner, gen = meshes
    raw = _raw()
    with WeightSender() as sender, serving(sender):
        sender.offer(_place(raw, learner, LEARNER_SPECS), 1)  # not staged for the receiver
        receiver = WeightReceiver(_template(raw, gen, GEN_SPECS))
        for method in ("transfer", "stream"):
            with pytest.raises(TransferError) as err:
                receiver.pull([sender.address], method=method)
            assert err.value.kind is TransferErrorKind.LAYOUT_MISMATCH
            assert "['embed_vd']" in str(err.value)
        assert receiver.current is None
        assert sender.stats.shards_sent == 0 and sender.stats.pulls_registered == 0
        # Refused by the receiver after "describe": no fetch ever reached the sender.
        assert sender.stats.requests == 2 and not sender.stats.refused


def test_sender_checks_every_fetch_itself(meshes):
    learner, _ = meshes
    raw = _raw()
    with WeightSender() as sender, serving(sender):
        sender.offer(_place(raw, learner, LEARNER_SPECS), 3)

        def ask(request):
            with connect(sender.address, 10) as sock:
                send_message(sock, request)
                return recv_message(sock)

        item = {"path": "['embed_vd']", "index": [[0, 16], [0, 8]], "dtype": "float32"}
        for request, kind in [
            ({"type": "fetch", "method": "stream", "version": 3, "items": [item]},
             TransferErrorKind.LAYOUT_MISMATCH),  # the whole array is no learner shard
            ({"type": "fetch", "method": "stream", "version": 2, "items": [item]},
             TransferErrorKind.VERSION),
            ({"type": "fetch", "method": "stream", "version": 3,
              "items": [dict(item, index=[[0, 8], [0, 4]], dtype="bfloat16")]},
             TransferErrorKind.LAYOUT_MISMATCH),
            ({"type": "fetch", "method": "fly", "version": 3,
              "items": [dict(item, index=[[0, 8], [0, 4]])]},
             TransferErrorKind.PROTOCOL),
            ({"type": "dance"}, TransferErrorKind.PROTOCOL),
        ]:  # fmt: skip
            with pytest.raises(TransferError) as err:
                ask(request)
            assert err.value.kind is kind, (request, err.value)
        assert sender.stats.shards_sent == 0
        assert sum(sender.stats.refused.values()) == 5


def test_offer_moving_on_mid_transfer_leaves_the_old_weights(meshes):
    learner, gen = meshes
    old, new, newer = _raw(0), _raw(1), _raw(2)
    receiver = WeightReceiver(_template(old, gen, GEN_SPECS))
    with WeightSender() as sender, serving(sender):
        sender.offer(stage_for_layout(_place(old, learner, LEARNER_SPECS), receiver.layout), 1)
        receiver.pull([sender.address], method="stream")
        sender.offer(stage_for_layout(_place(new, learner, LEARNER_SPECS), receiver.layout), 2)
        calls = []

        def bump(done, total):  # the learner publishes version 3 after the first chunk
            calls.append((done, total))
            if len(calls) == 1:
                staged = stage_for_layout(_place(newer, learner, LEARNER_SPECS), receiver.layout)
                sender.offer(staged, 3)

        with pytest.raises(TransferError) as err:
            receiver.pull([sender.address], method="stream", chunk_bytes=600, progress=bump)
        assert err.value.kind is TransferErrorKind.VERSION and len(calls) == 1
        assert receiver.current.version == 1
        _bit_equal(receiver.current.params, old)  # no leaf of version 2 got in
        assert receiver.pull([sender.address], method="transfer").version == 3
        _bit_equal(receiver.current.params, newer)


def test_unreachable_and_empty_senders():
    sds = jax.ShapeDtypeStruct(
        (4,), jnp.float32, sharding=NamedSharding(_mesh(jax.devices()[:1], (1,), ("x",)), P())
    )
    receiver = WeightReceiver({"w": sds})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
    with pytest.raises(TransferError) as err:
        receiver.pull([dead], timeout_s=5)
    assert err.value.kind is TransferErrorKind.CONNECTION
    with WeightSender(jax_transfer=False) as sender, serving(sender):
        with pytest.raises(TransferError) as err:
            receiver.pull([sender.address])
        assert err.value.kind is TransferErrorKind.NO_OFFER
        sender.offer({"w": jax.device_put(np.arange(4, dtype=np.float32), sds.sharding)}, 0)
        with pytest.raises(TransferError) as err:
            receiver.pull([sender.address], method="transfer")
        assert err.value.kind is TransferErrorKind.UNSUPPORTED
        assert receiver.pull([sender.address], method="stream").version == 0
    with pytest.raises(ValueError, match="method"):
        receiver.pull([dead], method="carrier_pigeon")


def test_silent_sender_is_a_timeout_not_a_hang():
    # "No silent hang": a peer that accepts the connection and never answers.
    sds = jax.ShapeDtypeStruct(
        (4,), jnp.float32, sharding=NamedSharding(_mesh(jax.devices()[:1], (1,), ("x",)), P())
    )
    receiver = WeightReceiver({"w": sds})
    with socket.create_server(("127.0.0.1", 0)) as mute:  # listens, never accepts or replies
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            receiver.pull([address], method="stream", timeout_s=0.5)
        assert time.monotonic() - start < 10
    assert err.value.kind is TransferErrorKind.CONNECTION
    assert receiver.current is None and receiver.stats.failed["connection"] == 1


def test_bulk_transport_counts_must_agree(meshes):
    # jax 0.10.2 can abort the receiving process when the two transfer servers
    # use different bulk-transport counts, so the receiver refuses first.
    _, gen = meshes
    raw = _raw()
    receiver = WeightReceiver(_template(raw, gen, GEN_SPECS))
    with WeightSender() as one, WeightSender(bulk_transports=2) as two:
        with serving(one), serving(two):
            one.offer(_place(raw, gen, GEN_SPECS), 1)
            two.offer(_place(raw, gen, GEN_SPECS), 2)
            assert receiver.pull([one.address]).version == 1
            with pytest.raises(TransferError) as err:
                receiver.pull([two.address])
            assert err.value.kind is TransferErrorKind.UNSUPPORTED
            assert "bulk transports" in str(err.value)
            assert two.stats.pulls_registered == 0 and receiver.current.version == 1
            assert receiver.pull([two.address], method="stream").version == 2
    with pytest.raises(ValueError, match="bulk_transports"):
        WeightSender(bulk_transports=0)
