"""Delta publish vs full publish of SmolLM2-135M full fine-tuning, threads and programs.

    python benchmarks/publish_delta.py                 # real GGUF weights, 4 real train steps
    python benchmarks/publish_delta.py --random --steps 2

The learner is the shipped experiment's (configs/rlvr_smollm2_arith.py: lr 5e-6, its
loss and clipping) with ``model.compute_dtype=bfloat16``, so the engine keeps its matmul
weights in bfloat16 (``generation.engine.params.engine_dtypes``). Each step is a real
``make_train_step`` update on a batch of random prompt/response tokens (behaviour
logprobs 0-ish, advantages +-1): the batch is synthetic, the Adam update is real, and
Adam moves every weight by about lr whatever the gradient's scale, so the changed
fraction is what the shipped lr gives. After each step, per publish:

- fraction of engine-side elements whose bits changed (bf16 matmul weights, fp32
  embedding and norm scales), per leaf kind and overall;
- threads: ``sync.publish`` of the fp32 tree + ``place_params`` (today's path) vs
  ``DeltaPublisher.publish`` (delta, device to device) + ``place_params``;
- programs: the stream method's wire (the whole fp32 tree through a loopback socket
  in ``transfer_wire`` frames, as ``WeightSender``'s stream does) vs the delta's wire
  (``delta.to_wire`` frames through the same socket, ``from_wire`` + ``apply_leaf`` on
  the receiving device, then ``place_params``). Sender and receiver are in this one
  process on separate fake CPU devices, so process scheduling and the gRPC Update are
  left out (as in benchmarks/publish_lora.py).

Every delta result is checked bit-equal to a full publish's engine-side tree.
Prints the load average: on a shared 2-core machine seconds are indicative only.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _batch(model, rng, n=8, prompt=24, response=24):
    import numpy as np

    from jaxflash.learner.batching import pack_batch
    from jaxflash.types import FinishReason, Sample

    samples = [
        Sample(
            prompt_id=i,
            sample_index=0,
            prompt_tokens=rng.integers(3, model.vocab_size, prompt).astype(np.int32),
            response_tokens=rng.integers(3, model.vocab_size, response).astype(np.int32),
            behaviour_logprobs=np.full(response, -8.0, np.float32),
            token_versions=np.zeros(response, np.int64),
            start_version=0,
            finish_reason=FinishReason.EOS,
            reward=float(i % 2),
        )  # fmt: skip
        for i in range(n)
    ]
    return pack_batch(samples, [1.0 if i % 2 else -1.0 for i in range(n)], length_multiple=16)


def _wire_pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", action="store_true", help="preset shape, random init")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    import dataclasses

    import jax
    import numpy as np

    sys.path.insert(0, os.path.join(REPO, "configs"))
    import rlvr_smollm2_arith

    from jaxflash.generation.engine.params import as_engine_dtypes
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.learner.state import from_params
    from jaxflash.learner.step import make_train_step
    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import init_params
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.runtime.config.experiment import ExperimentConfig
    from jaxflash.runtime.model_setup import build_engine
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import LEARNER_RULES
    from jaxflash.sync import delta as codec
    from jaxflash.sync.delta_publish import DeltaPublisher, DeltaSink
    from jaxflash.sync.publish import Publisher
    from jaxflash.sync.transfer_wire import recv_into, recv_message, send_message

    print(f"load average before: {os.getloadavg()}", flush=True)
    lc = ExperimentConfig.from_config_dict(rlvr_smollm2_arith.get_config().to_dict()).learner
    if args.random:
        model, host = get_preset("smollm2_135m"), None
    else:
        model, host = load_gguf(smollm2_gguf_path())
    model = dataclasses.replace(model, compute_dtype="bfloat16")
    if host is None:
        host = jax.device_get(init_params(model, 0))
    d = jax.devices()
    learner = make_mesh([d[0]], {"fsdp": 1, "tensor": 1})
    gen, prog = make_mesh([d[1]], {"tensor": 1}), make_mesh([d[2]], {"tensor": 1})
    state = from_params(host, model, lc, learner, LEARNER_RULES)
    del host
    train_step = make_train_step(model, lc, learner, LEARNER_RULES)
    ec = EngineConfig(max_concurrent_decodes=2, max_prefill_length=16, max_target_length=32)
    engine, shardings = build_engine(model, ec, gen)
    pengine, pshard = build_engine(model, ec, prog)
    view = jax.jit(lambda p: as_engine_dtypes(p, model))

    full_pub, dpub, sink = (
        Publisher(),
        DeltaPublisher(lambda p: as_engine_dtypes(p, model)),
        DeltaSink(),
    )
    psink = DeltaSink()
    snd, rcv = _wire_pair()
    rng = np.random.default_rng(0)
    rows: dict[str, list[tuple[float, int]]] = {
        k: [] for k in ("thread_full", "thread_delta", "prog_full", "prog_delta", "delta_encode")
    }
    fractions = []

    def bits(x):
        a = np.asarray(jax.device_get(x))
        return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])

    def same_bits(a, b):
        return all(
            np.array_equal(bits(x), bits(y))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )

    # ------------------------------------------------------------ the wire (one thread)
    def stream_send(leaves):  # the stream method: every fp32 leaf, one frame each
        for x in leaves:
            payload = np.ascontiguousarray(jax.device_get(x)).reshape(-1).view(np.uint8)
            send_message(snd, {"type": "shard", "nbytes": payload.size}, payload)

    def stream_recv(shapes, device):
        out = []
        for s in shapes:
            header = recv_message(rcv)
            host = np.empty(s.shape, s.dtype)
            recv_into(rcv, memoryview(host.reshape(-1).view(np.uint8)))
            assert header["nbytes"] == host.nbytes
            out.append(jax.device_put(host, device))
        return out

    wire_bytes = [0]

    def delta_send(deltas):
        wire_bytes[0] = 0
        for dl in deltas:
            header, payload = codec.to_wire(dl)
            send_message(snd, {"type": "delta", **header}, payload)
            wire_bytes[0] += len(payload)

    def delta_recv(n):
        out = []
        for _ in range(n):
            header = recv_message(rcv)
            buf = bytearray(int(header["nbytes"]))
            recv_into(rcv, memoryview(buf))
            out.append(codec.from_wire(header, bytes(buf)))
        return out

    def over_wire(send, send_arg, recv, *recv_args):
        t = threading.Thread(target=send, args=(send_arg,), daemon=True)
        t.start()
        got = recv(*recv_args)
        t.join()
        return got

    prev_view = None
    for v in range(args.steps + 1):
        if v:
            state, _ = train_step(state, _batch(model, rng))
        params = state.params
        jax.block_until_ready(params)
        new_view = view(params)
        kinds = {}
        if prev_view is not None:
            flat_prev = jax.tree_util.tree_flatten_with_path(prev_view)[0]
            pairs = zip([x for _, x in flat_prev], jax.tree.leaves(new_view), strict=True)
            counts = [codec.diff(a, b).changed for a, b in pairs]
            for (kp, x), c in zip(flat_prev, counts, strict=True):
                name = jax.tree_util.keystr(kp).split("'")[-2]
                k = kinds.setdefault(f"{name} {x.dtype}", [0, 0])
                k[0] += c
                k[1] += x.size
            fractions.append(kinds)
        prev_view = new_view

        # threads: today's full fp32 copy + place, vs the delta + place
        t0 = time.perf_counter()
        full = full_pub.publish(params, shardings, v).params
        placed_full = jax.block_until_ready(engine.place_params(full))
        rows["thread_full"].append(
            (time.perf_counter() - t0, sum(x.nbytes for x in jax.tree.leaves(params)))
        )
        t0 = time.perf_counter()
        dpub.advance(params, v)  # the engine-side cast, the changed counts, the digests
        deltas, reason = dpub.source.delta_for(sink.state())  # encoded once, for all
        encode_s = time.perf_counter() - t0
        rows["delta_encode"].append((encode_s, sum(d.nbytes for d in deltas or ())))
        t0 = time.perf_counter()
        got = dpub.publish(sink, shardings, v)
        placed = jax.block_until_ready(engine.place_params(got))
        rows["thread_delta"].append((encode_s + time.perf_counter() - t0, dpub.stats.last_bytes))
        assert same_bits(placed, placed_full), f"thread delta differs from the full publish at {v}"

        # programs: the stream wire of the full fp32 tree vs the delta frames
        leaves = jax.tree.leaves(params)
        t0 = time.perf_counter()
        pleaves = over_wire(stream_send, leaves, stream_recv, leaves, prog.devices.flat[0])
        ptree = jax.tree.unflatten(jax.tree.structure(params), pleaves)
        pplaced_full = jax.block_until_ready(pengine.place_params(ptree))
        rows["prog_full"].append((time.perf_counter() - t0, sum(x.nbytes for x in leaves)))
        t0 = time.perf_counter()
        deltas, reason = dpub.source.delta_for(psink.state())
        if deltas is None:  # first version: the full engine-side tree
            src = dpub.source.leaves
            got_leaves = over_wire(stream_send, src, stream_recv, src, prog.devices.flat[0])
            psink.install_full(got_leaves, v)
            sent = sum(x.nbytes for x in src)
        else:
            got_d = over_wire(delta_send, deltas, delta_recv, len(deltas))
            psink.apply(got_d, v)
            sent = wire_bytes[0]
        ptree = jax.tree.unflatten(jax.tree.structure(params), psink.leaves)
        pplaced = jax.block_until_ready(pengine.place_params(ptree))
        rows["prog_delta"].append((encode_s + time.perf_counter() - t0, sent))
        assert same_bits(pplaced, pplaced_full), (
            f"program delta differs from the full publish at {v}"
        )
        print(f"version {v} done ({reason or 'delta'})", flush=True)

    what = "random init" if args.random else "SmolLM2-135M-Instruct GGUF"
    print(f"\n{what}, fp32 learner, bf16 engines; lr {lc.lr}; {args.steps} real train steps")
    print("changed fraction per step (engine-side bits), by leaf kind:")
    for kind in fractions[0]:
        per = [f[kind][0] / f[kind][1] for f in fractions]
        print(f"  {kind:28s} " + " ".join(f"{100 * p:7.3f}%" for p in per))
    total = [sum(c for c, _ in f.values()) / sum(n for _, n in f.values()) for f in fractions]
    print(f"  {'all':28s} " + " ".join(f"{100 * p:7.3f}%" for p in total))
    print(
        f"{'path':22s} {'MB/publish (steps)':>20s}"
        f" {'s/publish median (min-max), steps':>36s} {'version 0 s':>12s}"
    )
    for name, vals in rows.items():
        later = vals[2:] if len(vals) > 3 else vals[1:]  # steady state: compiles done
        times = [t for t, _ in later]
        mb = statistics.median(b for _, b in later) / 1e6
        spread = f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"
        print(f"{name:22s} {mb:20.2f} {spread:>36s} {vals[0][0]:12.2f}")
    print("(medians over versions 2.. when --steps >= 3: version 1 compiles the delta programs)")
    print(f"delta stats: {dpub.stats}")
    print("every delta result was bit-equal to the full publish's placed params")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
