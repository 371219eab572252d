"""Bytes/s of cross-program weight transfer: jax.experimental.transfer vs the host stream.

    python benchmarks/weight_transfer.py                    # SmolLM2-135M tree, 3 reps
    python benchmarks/weight_transfer.py --preset tiny --reps 2 --bulk_transports 4

A learner program (a child process, its own JAX client with 4 fake CPU devices)
holds random params of the preset's shapes laid out with LEARNER_RULES on
(fsdp=2, tensor=2), staged for the generation layout; this process is the
generation program (2 fake devices, GENERATOR_RULES on tensor=2) and pulls them
with ``WeightReceiver.pull``, alternating the two methods (after one warm-up pull
each) so machine noise hits both alike. Bytes are the distinct blocks received
(a replicated leaf counts once); time is the whole ``pull`` (describe, checks,
fetch, assembly, install). Prints the load average before and after: on a
shared 2-core machine absolute speeds are pessimistic, the ratio is the result.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _abstract(preset: str, mesh_sizes: dict[str, int], rules_name: str):
    import jax

    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import abstract_params, logical_axes
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES, logical_to_shardings

    n = 1
    for v in mesh_sizes.values():
        n *= v
    mesh = make_mesh(jax.devices()[:n], mesh_sizes)
    config = get_preset(preset)
    rules = {"learner": LEARNER_RULES, "generator": GENERATOR_RULES}[rules_name]
    shapes = abstract_params(config)
    shardings = logical_to_shardings(logical_axes(config), mesh, rules, shapes=shapes)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def sender(args) -> None:
    """Child: offer random params; re-offer under the version read from stdin."""
    import json

    import jax
    import numpy as np

    from jaxflash.sync import TreeLayout, WeightSender, stage_for_layout

    abstract = _abstract(args.preset, {"fsdp": 2, "tensor": 2}, "learner")
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: jax.device_put(rng.standard_normal(s.shape, np.float32), s.sharding), abstract
    )
    wanted = TreeLayout.from_json(json.loads(sys.stdin.readline()))
    staged = stage_for_layout(params, wanted)
    del params
    with WeightSender(bulk_transports=args.bulk_transports) as s:
        s.offer(staged, 1)
        print(json.dumps({"address": s.address}), flush=True)
        while True:
            s.serve(0.02)
            if select.select([sys.stdin], [], [], 0)[0]:
                line = sys.stdin.readline()
                if not line:
                    return
                s.offer(staged, int(line))
                print(json.dumps({"version": int(line)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2_135m")
    ap.add_argument("--reps", type=int, default=3, help="timed pulls per method")
    ap.add_argument("--chunk_mib", type=int, default=64)
    ap.add_argument("--bulk_transports", type=int, default=1)
    ap.add_argument("--role", default="main", choices=["main", "sender"])
    args = ap.parse_args()
    if args.role == "sender":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        sender(args)
        return
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import json

    from jaxflash.sync import WeightReceiver, layout_of

    print(f"load average before: {os.getloadavg()}")
    abstract = _abstract(args.preset, {"tensor": 2}, "generator")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    child = subprocess.Popen(
        ["timeout", "-k", "5", "1800", sys.executable, __file__, "--role", "sender",
         "--preset", args.preset, "--bulk_transports", str(args.bulk_transports)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        child.stdin.write(json.dumps(layout_of(abstract).to_json()) + "\n")
        child.stdin.flush()
        address = json.loads(child.stdout.readline())["address"]
        receivers = {m: WeightReceiver(abstract) for m in ("transfer", "stream")}
        rates: dict[str, list[float]] = {m: [] for m in receivers}
        version = 1
        for rep in range(args.reps + 1):  # rep 0 warms up (compiles, starts servers)
            for method, r in receivers.items():
                if r.current is not None and r.current.version >= version:
                    version += 1
                    child.stdin.write(f"{version}\n")
                    child.stdin.flush()
                    json.loads(child.stdout.readline())
                before = r.stats.bytes
                r.pull([address], method=method, chunk_bytes=args.chunk_mib << 20)
                got = r.stats.bytes - before
                rate = got / r.stats.last_seconds
                if rep:
                    rates[method].append(rate)
                print(f"rep {rep} {method:8s} {got / 2**20:8.1f} MiB in "
                      f"{r.stats.last_seconds:6.3f} s = {rate / 2**20:8.1f} MiB/s"
                      f"{'' if rep else '  (warm-up)'}")  # fmt: skip
        tree_mib = layout_of(abstract).nbytes / 2**20
        print(f"\n{args.preset}: {tree_mib:.1f} MiB of params, "
              f"bulk_transports={args.bulk_transports}, chunk {args.chunk_mib} MiB")  # fmt: skip
        for method, rs in rates.items():
            med, lo, hi = (f(rs) / 2**20 for f in (statistics.median, min, max))
            print(
                f"{method:8s} median {med:8.1f} MiB/s (min {lo:.1f}, max {hi:.1f}), {len(rs)} pulls"
            )
        ratio = statistics.median(rates["transfer"]) / statistics.median(rates["stream"])
        print(f"transfer / stream median ratio: {ratio:.2f}")
        print(f"load average after: {os.getloadavg()}")
    finally:
        child.stdin.close()
        child.wait(60)


if __name__ == "__main__":
    main()
