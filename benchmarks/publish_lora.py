"""Bytes and seconds of one weight publish, full model vs LoRA adapters, threads vs programs.

    python benchmarks/publish_lora.py                      # SmolLM2-135M GGUF, rank 16, 3 reps
    python benchmarks/publish_lora.py --random --reps 2    # its preset shape, random init

Four paths, each timed per publish after one warm-up (which compiles, and for LoRA
moves the frozen base once):

- full -> thread engine: ``sync.publish.Publisher`` (device-to-device copy onto the
  generation mesh) + ``LlamaEngine.place_params`` (the engine's unstacked layout).
- adapters -> thread engine: ``sync.publish.AdapterPublisher`` (adapters only; the
  engine keeps its base and ``with_adapters`` unstacks them).
- full -> generation program: the learner stages its params for the program's
  layout (``stage_for_layout``) and offers them (``WeightSender``); the program pulls
  them (``WeightReceiver.pull``, ``--method``) and places them (``place_params``).
- adapters -> generation program: the same with the adapters' layout only, installed
  with ``with_adapters`` over the base the program built itself.

The program paths run sender and receiver in this one process (each its own fake
CPU device, the bytes crossing loopback sockets through the transfer wire exactly
as between two programs), so they leave out the gRPC Update call and process
scheduling; ``tests/runtime/fleet/test_gen_processes.py`` runs the real programs. Bytes are what
each publish moved (``AdapterPublisher.last_bytes``, ``WeightReceiver.stats``).
Prints the load average: on a shared 2-core machine seconds are indicative only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _timed(fn, reps: int) -> tuple[float, list[float], int]:
    """(first call s, later calls s, bytes of the last call) of ``fn() -> bytes``."""
    t0 = time.perf_counter()
    fn(0)
    first = time.perf_counter() - t0
    times, moved = [], 0
    for v in range(1, reps + 1):
        t0 = time.perf_counter()
        moved = fn(v)
        times.append(time.perf_counter() - t0)
    return first, times, moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", action="store_true", help="preset shape, random init")
    ap.add_argument("--preset", default="smollm2_135m", help="with --random")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--method", default="transfer", choices=("transfer", "stream"))
    args = ap.parse_args()

    import jax
    import numpy as np

    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.learner.state import param_shardings
    from jaxflash.models.adapters import lora as lora_lib
    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import abstract_params, init_params
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.runtime.model_setup import build_engine
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import LEARNER_RULES
    from jaxflash.sync.publish import AdapterPublisher, Publisher
    from jaxflash.sync.transfer_layout import stage_for_layout
    from jaxflash.sync.transfer_receiver import WeightReceiver
    from jaxflash.sync.transfer_sender import WeightSender

    print(f"load average before: {os.getloadavg()}", flush=True)
    if args.random:
        model, host = get_preset(args.preset), None
        what = f"preset {args.preset}, random init"
    else:
        model, host = load_gguf(smollm2_gguf_path())
        what = "SmolLM2-135M-Instruct GGUF"
    d = jax.devices()
    learner = make_mesh([d[0]], {"fsdp": 1, "tensor": 1})
    gen, prog = make_mesh([d[1]], {"tensor": 1}), make_mesh([d[2]], {"tensor": 1})
    if host is None:
        params = jax.jit(lambda: init_params(model, 0), out_shardings=param_shardings(
            model, learner, LEARNER_RULES))()  # fmt: skip
    else:
        params = jax.device_put(host, param_shardings(model, learner, LEARNER_RULES))
        del host
    lc = lora_lib.LoraConfig(rank=args.rank)  # every projection of every layer, fp32 base
    a_shapes, a_axes = lora_lib.adapter_layout(model, lc)
    a_sh = lora_lib.layout_shardings(a_axes, a_shapes, learner, LEARNER_RULES)
    base = jax.jit(lambda p: lora_lib.quantize_base(p, lc))(params)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(  # nonzero A and B: what a trained step publishes
        lambda s, sh: jax.device_put(0.01 * rng.standard_normal(s.shape, np.float32), sh),
        a_shapes,
        a_sh,
    )
    ec = EngineConfig(max_concurrent_decodes=2, max_prefill_length=16, max_target_length=32)
    rows = []

    # ---------------------------------------------------------------- threads
    engine, shardings = build_engine(model, ec, gen)
    pub = Publisher()

    def full_thread(v):
        out = pub.publish(params, shardings, v).params
        jax.block_until_ready(engine.place_params(out))
        return lora_lib.tree_bytes(params)

    rows.append(("full -> thread engine", *_timed(full_thread, args.reps)))
    lengine, ash = build_engine(model, ec, gen, lora=lc)
    apub = AdapterPublisher(lengine, ash)

    def lora_thread(v):
        jax.block_until_ready(apub.publish(adapters, base, v).params)
        return apub.last_bytes

    rows.append(("adapters -> thread engine", *_timed(lora_thread, args.reps)))
    first_bytes = apub.base_bytes + lora_lib.tree_bytes(adapters)

    # ---------------------------------------------------------------- programs
    def serving(sender, stop):
        while not stop.is_set():
            sender.serve(0.02)

    def program_path(tree, pshard, install):
        template = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree),
            pshard,
        )
        receiver = WeightReceiver(template)
        sender, stop = WeightSender(), threading.Event()
        thread = threading.Thread(target=serving, args=(sender, stop), daemon=True)
        thread.start()

        def one(v):
            before = receiver.stats.bytes
            sender.offer(stage_for_layout(tree, receiver.layout), v)
            got = receiver.pull([sender.address], method=args.method, version=v)
            jax.block_until_ready(install(got.params))
            return receiver.stats.bytes - before

        try:
            return _timed(one, args.reps)
        finally:
            stop.set()
            thread.join(5)
            sender.close()

    pengine, pshard = build_engine(model, ec, prog)
    rows.append(("full -> gen program", *program_path(params, pshard, pengine.place_params)))
    plengine, pash = build_engine(model, ec, prog, lora=lc)
    pbase = plengine.place_base(base)  # the program builds its base once (not timed)
    install = lambda a: plengine.with_adapters(pbase, a)  # noqa: E731
    rows.append(("adapters -> gen program", *program_path(adapters, pash, install)))

    full_bytes = lora_lib.tree_bytes(abstract_params(model))
    print(f"\n{what}, fp32; LoRA rank {args.rank} on {','.join(lc.targets)}; {args.reps} "
          f"publishes after a warm-up; program transfer method {args.method}")  # fmt: skip
    print(f"{'path':28s} {'MB/publish':>11s} {'% of full':>9s} {'s/publish (median, min-max)':>28s}"
          f" {'first s':>8s}")  # fmt: skip
    for name, first_s, times, moved in rows:
        spread = f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"
        print(f"{name:28s} {moved / 1e6:11.1f} {100 * moved / full_bytes:9.1f} {spread:>28s}"
              f" {first_s:8.2f}")  # fmt: skip
    print(f"(the first LoRA thread publish also moved the base: {first_bytes / 1e6:.1f} MB)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
