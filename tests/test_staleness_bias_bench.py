"""benchmarks/staleness_bias.py --sim --quick: every policy runs in the simulator and
the rows say what the study reads (pace drops nothing; the stats are of real samples)."""

import importlib.util
import json
import os

_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")
_spec = importlib.util.spec_from_file_location(
    "bench_staleness_bias", os.path.join(_DIR, "staleness_bias.py")
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_quick_sim_grid_rows(tmp_path, capsys):
    out = tmp_path / "bias.json"
    assert bench.main(["--sim", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["drop", "regenerate", "pace"]
    by = {r["policy"]: r for r in rows}
    assert by["pace"]["prompts_stale"] == 0 and by["pace"]["prompts_regenerated"] == 0
    assert by["drop"]["prompts_stale"] > 0 and by["regenerate"]["prompts_regenerated"] > 0
    for r in rows:
        t, s = r["trained"], r["started"]
        assert 0 < t["n"] <= s["n"] and t["len_p50"] <= t["len_p99"]
        assert 0.0 <= r["admission_idle"] <= 1.0 and r["samples_per_s"] > 0
    assert by["drop"]["long_share"] < by["pace"]["long_share"]  # drop starves the long tail
    assert capsys.readouterr().out.count("\n| 1 |") == 3


def test_long_share_and_stats():
    assert bench.long_share(list(range(100)), list(range(100))) == 1.0
    assert bench.long_share(list(range(100)), list(range(50))) == 0.0
    st = bench.length_reward_stats([1, 2, 3], [0.0, 1.0, 1.0])
    assert st["len_mean"] == 2.0 and abs(st["reward_mean"] - 2 / 3) < 1e-12
    assert bench.length_reward_stats([], []) == {"n": 0}


def test_compare_reads_each_policy_against_pace(tmp_path):
    """--real --compare: pace's samples are the oracle of the prompts a run took; a run
    that trained only the short half of them has no sample in the started tail."""

    def write(policy, lengths, outcome="trained", taken=0):
        d = tmp_path / f"{policy}_a1"
        d.mkdir(exist_ok=True)
        rows = [
            {"outcome": outcome, "response_len": n, "reward": 0.0, "prompt_id": n,
             "sample_index": 0, "response_tokens": [7] * n}
            for n in lengths
        ]  # fmt: skip
        with open(d / "rollouts.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "prompts_taken": taken}))

    write("pace", range(1, 121), taken=120)
    write("drop", range(1, 51), taken=100)  # took 1..99 (0 is not in pace's): 99 compared
    write("drop", range(51, 61), outcome="stale", taken=100)
    out = tmp_path / "cmp.json"
    argv = ["--real", "--compare", "--workdir", str(tmp_path), "--out", str(out)]
    assert bench.main(argv) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"drop", "pace"} and rows["pace"]["long_share"] == 1.0
    assert rows["drop"]["prompts_compared"] == 99 and rows["drop"]["long_share"] == 0.0
    assert rows["drop"]["trained"]["len_mean"] == 25.5
    assert rows["drop"]["started"]["len_mean"] == 50.0
    assert rows["drop"]["same_as_reference"] == "60/60"
    assert rows["drop"]["capped_frac_trained"] == 0.0
