"""Command line for the dry run of a preset (`launch/tpu_pod.py --dry_run` sizes a config).

    python -m jaxflash.sizing --preset smollm2_135m --learner_mesh fsdp=8 \
        --generation_mesh tensor=2 --batch_size 64 --seq_len 1024
    python -m jaxflash.sizing --preset qwen2p5_1p5b --param_dtype bfloat16 ...
    python -m jaxflash.sizing --platform default ...   # the devices of this host (TPU/GPU)

With ``--platform cpu`` (default) it fakes as many CPU devices as the larger mesh
needs, before JAX is imported, so it runs on a laptop; the memory figures are
then XLA:CPU's (see ``jaxflash.sizing.dry_run``).
"""

from __future__ import annotations

import argparse
import math
import os
import time


def _sizes(text: str) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(  # noqa: B904 (argparse prints only this message)
            f"{text!r}: use axis=size[,axis=size], e.g. fsdp=4,tensor=2"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Compile learner + engine ahead of time; print memory."
    )
    ap.add_argument("--preset", default="smollm2_135m", help="models.config.presets preset name")
    ap.add_argument("--param_dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compute_dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remat", action="store_true", help="rematerialise layers in the backward")
    ap.add_argument("--learner_mesh", type=_sizes, default={"fsdp": 8})
    ap.add_argument("--generation_mesh", type=_sizes, default={"tensor": 1})
    ap.add_argument("--batch_size", type=int, default=64, help="sequences per learner step")
    ap.add_argument("--micro_batch_size", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=1024, help="tokens per training sequence")
    ap.add_argument("--slots", type=int, default=64, help="engine decode slots")
    ap.add_argument("--max_prefill", type=int, default=512)
    ap.add_argument("--max_target", type=int, default=1024)
    ap.add_argument("--platform", default="cpu", choices=["cpu", "default"])
    args = ap.parse_args()
    needed = max(math.prod(args.learner_mesh.values()), math.prod(args.generation_mesh.values()))
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={needed}"
        ).strip()

    import jax

    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.learner.config import LearnerConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES
    from jaxflash.sizing.dry_run import dry_run, format_report

    if jax.device_count() < needed:
        raise SystemExit(f"the meshes need {needed} devices, this host has {jax.device_count()}")
    model = get_preset(
        args.preset,
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
        remat=args.remat,
        max_seq_len=max(args.seq_len, args.max_target),
    )
    learner = LearnerConfig(lr=1e-6, micro_batch_size=args.micro_batch_size)
    engine = EngineConfig(
        max_concurrent_decodes=args.slots,
        max_prefill_length=args.max_prefill,
        max_target_length=args.max_target,
    )
    devices = jax.devices()
    lmesh = make_mesh(devices[: math.prod(args.learner_mesh.values())], args.learner_mesh)
    gmesh = make_mesh(devices[: math.prod(args.generation_mesh.values())], args.generation_mesh)
    start = time.perf_counter()
    reports = dry_run(
        model, learner, engine,
        learner_mesh=lmesh, learner_rules=LEARNER_RULES,
        generation_mesh=gmesh, generation_rules=GENERATOR_RULES,
        batch_size=args.batch_size, seq_len=args.seq_len,
    )  # fmt: skip
    title = (
        f"{args.preset} ({args.param_dtype} params, {args.compute_dtype} compute) on "
        f"{jax.devices()[0].platform}: learner {dict(lmesh.shape)} batch "
        f"[{args.batch_size}, {args.seq_len}] micro {args.micro_batch_size}; generation "
        f"{dict(gmesh.shape)} {args.slots} slots, prefill {args.max_prefill}, "
        f"cache {args.max_target}"
    )
    print(format_report(reports, title=title))
    print(f"compiled in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
