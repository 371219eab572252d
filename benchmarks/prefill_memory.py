"""The engine's prefill temporaries, dense vs O(T) attention, compiled for one TPU chip.

    pip install -e '.[tpu]'
    python benchmarks/prefill_memory.py                                 # the docs/TPU.md row
    python benchmarks/prefill_memory.py --preset tiny --buckets 512 2048 --topology v5e-1

Compiles the engine's prefill program (``engine.kernels.prefill``, ``prefill_rows``
rows as ``EngineConfig`` defaults them) at each bucket twice for an abstract chip:
with ``prefill_dense_max`` at the bucket (dense [T, T] scores per head) and at 0
(``model.attention`` "auto": splash on TPU), and prints XLA's temporaries and peak per
chip. Nothing runs; libtpu's compiler plans the memory (``jaxflash.sizing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported: libtpu only compiles

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2p5_1p5b")
    ap.add_argument("--dtype", default="bfloat16", help="param and compute dtype")
    ap.add_argument("--buckets", type=int, nargs="+", default=[8192])
    ap.add_argument("--topology", default="v5e-1", help="the engine runs on its first chip")
    args = ap.parse_args()

    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES
    from jaxflash.sizing.chips import parse_topology
    from jaxflash.sizing.plan import measure
    from jaxflash.sizing.programs import engine_programs
    from jaxflash.sizing.tpu import topology_devices

    devices = topology_devices(parse_topology(args.topology))
    mesh = make_mesh(devices[:1], {})
    top = max(args.buckets)
    model = get_preset(
        args.preset, param_dtype=args.dtype, compute_dtype=args.dtype, max_seq_len=2 * top
    )
    base = EngineConfig(max_concurrent_decodes=8, max_prefill_length=top, max_target_length=2 * top)
    print(
        f"{args.preset} {args.dtype}, {devices[0].device_kind} (compile only), "
        f"prefill_rows={base.prefill_rows}"
    )
    print(f"{'bucket':>7} {'attention':>10} {'temp GiB':>9} {'peak GiB':>9} {'compile s':>9}")
    for bucket in args.buckets:
        for label, dense_max in (("dense", bucket), ("O(T)", 0)):
            config = dataclasses.replace(base, prefill_dense_max=dense_max)
            (prog, _), _, _ = engine_programs(
                model, config, mesh, GENERATOR_RULES, buckets=[bucket]
            )
            start = time.perf_counter()
            cost = measure(prog)
            took = time.perf_counter() - start
            note = f"  refused: {cost.refused}" if cost.refused else ""
            print(
                f"{bucket:>7} {label:>10} {cost.temp_bytes / GIB:>9.3f} "
                f"{cost.peak_bytes / GIB:>9.3f} {took:>9.0f}{note}"
            )


if __name__ == "__main__":
    main()
