"""A decode step's HBM bytes per chip, compiled without a TPU: XLA's count, the HBM walk
and the paper figure (weights per chip + the KV pages in use), per generation layout.

    pip install -e '.[tpu]'
    python benchmarks/decode_bytes.py                       # Qwen2.5-1.5B on v5e-8, 4 layouts
    python benchmarks/decode_bytes.py --mesh "data=4,tensor=2" --top 12
    python benchmarks/decode_bytes.py --preset llama3p1_8b --topology v5p-16 --slots 256 \
        --positions 32768 --pages 65536 --mesh tensor=8      # the 8B preset's engine

Compiles only the engine's decode block (``sizing.programs.engine_programs``, 8 steps,
about 20 s a layout on 2 busy cores) for the Qwen2.5-1.5B preset config's engine:
bf16 compute over fp32 weights, 128 slots of 8,192 positions, a paged pool of
16,384 x 32 = 524,288 tokens, ``paged_attention=auto``. Per layout it prints, per chip
and step: XLA's ``bytes accessed`` (the block's; XLA counts the loop body once), the
HBM walk of the compiled program (``sizing.hbm_traffic``: entry once per block, body x
steps), the weights the engine holds per chip, the KV of the pages in use at a
half-full pool (what the kernel reads; XLA sees nothing inside it), and the ratios
(count + kernel reads) / (weights + in-use KV). ``--src DIR`` imports jaxflash from
another checkout (``git archive <rev> | tar -x -C DIR``) to measure an older engine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ("data=4,tensor=2", "data=8", "data=2,tensor=4", "tensor=8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=";".join(LAYOUTS), help="layouts, ';' between them")
    ap.add_argument("--src", default="", help="import jaxflash from this checkout instead")
    ap.add_argument("--top", type=int, default=0, help="print the largest HBM items")
    ap.add_argument("--preset", default="qwen2p5_1p5b")
    ap.add_argument("--topology", default="v5e-8")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--positions", type=int, default=8192)
    ap.add_argument("--pages", type=int, default=16384, help="pages of 32 positions")
    ap.add_argument("--dump", default="", help="write each layout's compiled HLO to DUMP.<mesh>")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, args.src or ROOT)
    if args.src:  # the walk itself is this checkout's
        sys.path.insert(1, ROOT)
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "hbm_traffic", os.path.join(ROOT, "jaxflash", "sizing", "hbm_traffic.py")
        )
        walk_mod = importlib.util.module_from_spec(spec)
        sys.modules["hbm_traffic"] = walk_mod
        spec.loader.exec_module(walk_mod)
        hbm_traffic = walk_mod.hbm_traffic
    else:
        from jaxflash.sizing.hbm_traffic import hbm_traffic
    import jaxflash
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES
    from jaxflash.sizing import programs
    from jaxflash.sizing.chips import parse_topology
    from jaxflash.sizing.kv_pool import KvPool
    from jaxflash.sizing.tpu import topology_devices

    print(f"jaxflash from {os.path.dirname(jaxflash.__file__)}")
    devices = topology_devices(parse_topology(args.topology))
    model = get_preset(args.preset, compute_dtype="bfloat16", remat=True,
                       remat_policy="full", max_seq_len=args.positions)  # fmt: skip
    engine = EngineConfig(
        max_concurrent_decodes=args.slots, max_prefill_length=1024,
        max_target_length=args.positions, decode_block=8, kv_cache="paged", page_size=32,
        num_pages=args.pages,
    )  # fmt: skip
    steps, gb = engine.decode_block, 1e9
    for layout in args.mesh.split(";"):
        axes = {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}
        n = 1
        for v in axes.values():
            n *= v
        mesh = make_mesh(devices[:n], axes)
        t0 = time.perf_counter()
        (block,), params, state = programs.engine_programs(
            model, engine, mesh, GENERATOR_RULES, buckets=[]
        )
        compiled = block.lower().compile()
        xla = compiled.cost_analysis()["bytes accessed"]
        if args.dump:
            with open(f"{args.dump}.{layout.replace(',', '_')}", "w", encoding="utf-8") as f:
                f.write(compiled.as_text())
        walk = hbm_traffic(compiled.as_text(), trips=steps, xla_bytes=xla, top=args.top)
        kv = KvPool.from_state(state)
        weights = programs.per_device_bytes(params)
        in_use = 0.5 * kv.pool_tokens * kv.token_chip_bytes
        kernel = in_use if kv.attention == "tpu_kernel" else 0.0
        paper = weights + in_use
        hbm = walk.hbm / steps
        mem = compiled.memory_analysis()
        print(
            f"{layout:16s} ({time.perf_counter() - t0:.0f} s) attention {kv.attention}, pool "
            f"{kv.chip_bytes / gb:.2f} GB a chip; args {mem.argument_size_in_bytes / 2**30:.2f} "
            f"GiB, temp {mem.temp_size_in_bytes / 2**30:.2f} GiB\n"
            f"  per chip and step: XLA {xla / gb:.3f} GB, HBM walk {hbm / gb:.3f} GB (walk under "
            f"XLA's rules {walk.xla_rules / gb:.3f}: {'agrees' if walk.agrees else 'DISAGREES'}"
            f"), weights {weights / gb:.3f} GB, in-use KV {in_use / gb:.3f} GB, kernel reads "
            f"{kernel / gb:.3f} GB\n"
            f"  (XLA + kernel) / paper {(xla + kernel) / paper:.2f}; (HBM + kernel) / paper "
            f"{(hbm + kernel) / paper:.2f}",
            flush=True,
        )
        for b, name, op, comp in walk.top:
            print(f"    {b / steps / 1e6:9.1f} MB a step  {op:13s} {name}  ({comp})")


if __name__ == "__main__":
    main()
