"""benchmarks/consistency.py --tiny: the exact-mode row reads exactly 0 gap and k3 (and
correlation 1) from a real learner step on engine samples; the MoE row runs in the
default mode with finite metrics; the JSON has every documented column."""

import importlib.util
import json
import math
import os
import sys

_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")
sys.path.insert(0, _DIR)
_spec = importlib.util.spec_from_file_location(
    "bench_consistency", os.path.join(_DIR, "consistency.py")
)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_tiny_rows_exact_is_zero_and_moe_is_finite(tmp_path):
    out = tmp_path / "c.json"
    results = bench.main(["--tiny", "--prompts", "4", "--new", "6", "--out", str(out)])
    with open(out, encoding="utf-8") as f:
        assert json.load(f) == json.loads(json.dumps(results))
    exact, moe = results
    assert exact["row"] == "tiny/bfloat16/paged/full/exact" and exact["on_policy_tokens"] > 0
    assert exact["gap_max"] == exact["gap_mean"] == exact["k3"] == exact["miss"] == 0.0
    assert exact["corr"] > 0.9999
    assert moe["row"].startswith("tiny_moe/") and moe["on_policy_tokens"] > 0
    assert all(math.isfinite(v) for v in moe.values() if isinstance(v, float))
