"""Child processes of test_transfer_procs.py: a learner-side sender or a generation-side receiver.

Each is its own JAX program (own CPU client and fake devices; a sender may be one
process of a 2-process ``jax.distributed`` learner). Params are the tiny Llama
preset's, deterministic in ``--seed``; the learner lays them out with
LEARNER_RULES, the generation program with GENERATOR_RULES (or, for the refusal
test, a layout the sender was not staged for).

    python tests/transfer_child.py sender --mesh fsdp=2,tensor=2 --seed 1 --version 2 \
        --stage_for layout.json [--coordinator 127.0.0.1:P --num_processes 2 --process_id 0]
    python tests/transfer_child.py receiver --senders A[,B] --method transfer|stream \
        --mesh tensor=2 [--initial_seed 0 --initial_version 1] [--chunk_bytes N --wait_file F]
    python tests/transfer_child.py layout --mesh tensor=2 [--rules learner]  (prints the JSON)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc_helpers import emit  # noqa: E402


def _mesh_sizes(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def _abstract(mesh, rules_name: str):
    import jax

    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import abstract_params, logical_axes
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES, logical_to_shardings

    config = get_preset("tiny")
    rules = {"learner": LEARNER_RULES, "generator": GENERATOR_RULES}[rules_name]
    shapes = abstract_params(config)
    shardings = logical_to_shardings(logical_axes(config), mesh, rules, shapes=shapes)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def _values(abstract, seed: int):
    """Host numpy values, deterministic in seed (every process computes the same)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), abstract)


def _place(abstract, values):
    import jax

    # Each process fills only its own shards (works for multi-process meshes too).
    return jax.tree.map(
        lambda s, v: jax.make_array_from_callback(s.shape, s.sharding, lambda idx: v[idx]),
        abstract,
        values,
    )


def digest(tree) -> dict[str, str]:
    """sha256 of every leaf's bytes, by tree path (addressable data gathered per leaf)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    out = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        host = np.ascontiguousarray(np.asarray(jax.device_get(x)))
        out[jax.tree_util.keystr(kp)] = hashlib.sha256(host.tobytes()).hexdigest()
    return out


def _make_mesh(text: str):
    import jax

    from jaxflash.sharding.mesh import make_mesh

    sizes = _mesh_sizes(text)
    n = 1
    for v in sizes.values():
        n *= v
    return make_mesh(jax.devices()[:n], sizes)


def sender(args) -> None:
    import jax

    if args.coordinator:
        from jaxflash.sharding.distributed import initialize_from_env

        os.environ["JAX_COORDINATOR_ADDRESS"] = args.coordinator
        os.environ["JAX_NUM_PROCESSES"] = str(args.num_processes)
        os.environ["JAX_PROCESS_ID"] = str(args.process_id)
        initialize_from_env()
    from jaxflash.sync import TreeLayout, WeightSender, stage_for_layout

    emit("hello", pid=os.getpid(), process_index=jax.process_index())
    abstract = _abstract(_make_mesh(args.mesh), "learner")
    params = _place(abstract, _values(abstract, args.seed))
    with open(args.stage_for) as f:
        wanted = TreeLayout.from_json(json.load(f))
    staged = stage_for_layout(params, wanted)
    with WeightSender() as s:
        s.offer(staged, args.version)
        emit("ready", address=s.address, digest=digest(params), version=args.version)
        end = time.monotonic() + args.serve_s
        while time.monotonic() < end:
            s.serve(0.1)


def receiver(args) -> None:
    import jax

    from jaxflash.sync import TransferError, VersionedParams, WeightReceiver

    emit("hello", pid=os.getpid())
    abstract = _abstract(_make_mesh(args.mesh), args.rules)
    current = None
    if args.initial_seed is not None:
        current = VersionedParams(
            params=_place(abstract, _values(abstract, args.initial_seed)),
            version=args.initial_version,
        )
    r = WeightReceiver(abstract, current=current)

    def progress(done: int, total: int) -> None:
        emit("chunk", done=done, total=total)
        if args.wait_file:  # hold here until the test has killed the sender
            while not os.path.exists(args.wait_file):
                time.sleep(0.05)

    for method in args.method.split(","):
        try:
            got = r.pull(
                args.senders.split(","),
                method=method,
                chunk_bytes=args.chunk_bytes,
                timeout_s=30,
                progress=progress,
            )
            shardings_ok = all(
                a.sharding == s.sharding
                for a, s in zip(jax.tree.leaves(got.params), jax.tree.leaves(abstract), strict=True)
            )
            emit("result", method=method, version=got.version, error_kind=None,
                 shardings_ok=shardings_ok, bytes=r.stats.bytes)  # fmt: skip
        except TransferError as err:
            emit("result", method=method, error_kind=err.kind.value, error=str(err))
        held = r.current
        emit("state", method=method, version=None if held is None else held.version,
             digest=None if held is None else digest(held.params))  # fmt: skip
        if args.fresh_each:
            r = WeightReceiver(abstract, current=current)


def layout(args) -> None:
    from jaxflash.sync import layout_of

    print(json.dumps(layout_of(_abstract(_make_mesh(args.mesh), args.rules)).to_json()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["sender", "receiver", "layout"])
    p.add_argument("--mesh", required=True)
    p.add_argument("--rules", default="generator", choices=["learner", "generator"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--stage_for")
    p.add_argument("--serve_s", type=float, default=180)
    p.add_argument("--coordinator")
    p.add_argument("--num_processes", type=int, default=1)
    p.add_argument("--process_id", type=int, default=0)
    p.add_argument("--senders")
    p.add_argument("--method", default="transfer")
    p.add_argument("--fresh_each", action="store_true")
    p.add_argument("--initial_seed", type=int)
    p.add_argument("--initial_version", type=int, default=0)
    p.add_argument("--chunk_bytes", type=int, default=64 << 20)
    p.add_argument("--wait_file")
    args = p.parse_args()
    {"sender": sender, "receiver": receiver, "layout": layout}[args.role](args)


if __name__ == "__main__":
    main()
