"""Start-up cost side by side: time to the first generated token, and import times.

    python benchmarks/startup.py                                  # this checkout only
    git worktree add --detach /tmp/before 853c151                 # the engine on JetStream
    python benchmarks/startup.py --before /tmp/before --repeats 3

Per tree (this checkout, and ``--before``: an older checkout run with the same
Python), each in fresh processes, alternating between the trees:

- ``first token``: seconds from starting ``python launch/tpu_pod.py --config
  configs/smoke.py --workdir <tmp>`` to the first sampled token on the host (the
  first ``LlamaEngine.start_samples`` returning; the run is then stopped). Interpreter
  start, imports, config, model init, engine build and compile, the first prefill.
- ``import loop``: ``python -X importtime -c "import <the runtime loop>"``, the
  cumulative time of every top-level import (``jaxflash.runtime.loop``;
  ``jaxflash.runtime.rlvr`` in trees older than its rename), and what JetStream took of
  it and TensorFlow of that (``engine_api`` pulls TensorFlow through seqio).

Plus, once: the import of ``jetstream.engine.engine_api`` alone (what the engine paid
while it subclassed ``engine_api.Engine``: it pulls TensorFlow through seqio). The
load average is printed before and after: the machine's other jobs move every number.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs the launcher with LlamaEngine.start_samples wrapped: the first return prints a
# marker. A post-import hook patches the class where it is defined (the engine module
# moved between trees), so nothing imports JAX before the launcher sets its devices.
_FIRST_TOKEN = r"""
import importlib.abc, importlib.util, os, runpy, sys
NAMES = ("jaxflash.generation.engine.llama_engine", "jaxflash.generation.engine")

def patch(module):
    cls = getattr(module, "LlamaEngine", None)
    if cls is None or getattr(cls, "_startup_marked", False):
        return
    start = cls.start_samples
    def first(self, *args, **kwargs):
        out = start(self, *args, **kwargs)
        print("FIRST_TOKEN", module.__file__, flush=True)
        os._exit(0)
    cls.start_samples, cls._startup_marked = first, True

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in NAMES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Hook())
sys.argv = ["launch/tpu_pod.py", "--config", "configs/smoke.py", "--workdir", sys.argv[1]]
runpy.run_path("launch/tpu_pod.py", run_name="__main__")
"""


def _env(tree: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the launcher sets the smoke config's CPU devices
    return env


def first_token_s(tree: str, timeout_s: float) -> float:
    """Seconds from spawning the smoke launch in ``tree`` to its first token."""
    workdir = tempfile.mkdtemp(prefix="startup_")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _FIRST_TOKEN, workdir],
        cwd=tree, env=_env(tree), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("FIRST_TOKEN"):
                took = time.perf_counter() - start
                if not line.split()[1].startswith(os.path.realpath(tree)):
                    raise RuntimeError(f"{tree}: the engine came from {line.split()[1]}")
                return took
            if time.perf_counter() - start > timeout_s:
                break
        raise RuntimeError(f"{tree}: no first token (exit {proc.poll()})")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own children (reward workers) too
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def import_times(tree: str, module: str) -> dict[str, float]:
    """Seconds: total of the top-level imports of ``import module``, and TensorFlow's and
    JetStream's cumulative shares (0 when not imported)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        cwd=tree, env=_env(tree), capture_output=True, text=True, check=True,
    )  # fmt: skip
    total, parts = 0, {"tensorflow": 0, "jetstream": 0}
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)$", line)
        if m is None:
            continue
        cumulative, depth, name = int(m.group(1)), len(m.group(2)), m.group(3)
        if depth == 0:  # a top-level import (importtime indents nested ones)
            total += cumulative
        for key in parts:  # the outermost import of the package holds the others
            if name == key or name.startswith(key + "."):
                parts[key] = max(parts[key], cumulative)
    return {"total": total / 1e6, **{k: v / 1e6 for k, v in parts.items()}}


def loop_module(tree: str) -> str:
    exists = os.path.exists(os.path.join(tree, "jaxflash", "runtime", "loop.py"))
    return "jaxflash.runtime.loop" if exists else "jaxflash.runtime.rlvr"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="", help="an older checkout to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout_s", type=float, default=900.0)
    args = ap.parse_args()
    trees = {"after (this checkout)": HERE}
    if args.before:
        trees = {f"before ({os.path.abspath(args.before)})": os.path.abspath(args.before), **trees}
    load_before = os.getloadavg()
    tokens: dict[str, list[float]] = {name: [] for name in trees}
    imports: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.repeats):  # alternate, so drifting load hits both alike
        for name, tree in trees.items():
            tokens[name].append(first_token_s(tree, args.timeout_s))
            imports[name].append(import_times(tree, loop_module(tree)))
    engine_api = import_times(HERE, "jetstream.engine.engine_api")
    load_after = os.getloadavg()

    def stat(xs):
        return f"median {statistics.median(xs):6.1f} s (min {min(xs):.1f}, max {max(xs):.1f})"

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.repeats} runs each")
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{x:.2f}" for x in load_before))
    for name, tree in trees.items():
        rows = imports[name]
        print(f"\n{name}")
        print(f"  first token, smoke launch: {stat(tokens[name])}")
        print(f"  import {loop_module(tree)}: {stat([r['total'] for r in rows])}")
        for part in ("jetstream", "tensorflow"):  # nested: jetstream pulls tensorflow
            print(f"    of which {part}: {stat([r[part] for r in rows])}")
    print(
        f"\nimport jetstream.engine.engine_api alone: {engine_api['total']:.1f} s "
        f"(tensorflow {engine_api['tensorflow']:.1f} s)"
    )
    print("load average (1, 5, 15 min) after: " + ", ".join(f"{x:.2f}" for x in load_after))


if __name__ == "__main__":
    main()
