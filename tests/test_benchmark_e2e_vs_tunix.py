"""benchmarks/e2e_vs_tunix.py: its rates leave out the same steps for every system, and
its tiny mode runs jaxflash's side end to end and says tunix was skipped (CI never
installs tunix)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import pytest  # noqa: E402
from e2e_report import merge, repeated_prefixes, run_rates, steady_steps  # noqa: E402


def _step(step, wall, cpu, samples=8, tokens=80):
    return {"step": step, "wall_s": wall, "cpu_s": cpu, "samples": samples, "tokens": tokens,
            "sections": {"update": wall / 2}}  # fmt: skip


def test_steady_steps_drop_compile_and_evaluation_steps():
    steps = [_step(k, 10.0 * k, 5.0 * k) for k in range(1, 8)]
    # eval every 3 steps: after steps 3 and 6 -> the intervals of steps 4 and 7 hold one
    assert [s["step"] for s in steady_steps(steps, 3)] == [2, 3, 5, 6]


def test_run_rates_are_samples_over_summed_step_times():
    run = {"per_step": [_step(1, 99.0, 99.0), _step(2, 4.0, 8.0), _step(3, 6.0, 12.0)]}
    r = run_rates(run, eval_every=10)
    assert r["steps"] == [2, 3]
    assert r["samples_per_s"] == 16 / 10.0
    assert r["samples_per_cpu_s"] == 16 / 20.0
    assert r["tokens_per_sample"] == 10.0
    assert r["sections"] == {"update": 2.5}
    assert r["first_step_s"] == 99.0


def test_merge_joins_seeds_of_one_workload_and_refuses_another():
    work = {"steps": 4, "lr": 2e-5}
    a = {"work": work, "runs": {"jaxflash": [{"seed": 0}], "tunix": [{"seed": 0}]}}
    b = {"work": dict(work), "runs": {"tunix": [{"seed": 1}], "jaxflash": [{"seed": 1}]}}
    runs, merged = merge([a, b])
    assert merged == work
    assert {k: [r["seed"] for r in v] for k, v in runs.items()} == {
        "jaxflash": [0, 1], "tunix": [0, 1]}  # fmt: skip
    with pytest.raises(ValueError, match="lr"):
        merge([a, {"work": {**work, "lr": 1e-5}, "runs": {}}])


def test_tiny_mode_runs_jaxflash_and_skips_tunix(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "e2e_vs_tunix.py"), "--tiny",
           "--seeds", "0", "--cache", str(tmp_path), "--tunix_venv", str(tmp_path / "none"),
           "--out", str(tmp_path / "out.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tunix: skipped" in proc.stdout
    import json

    report = json.load(open(tmp_path / "out.json"))["report"]
    rates = report["systems"]["jaxflash"]["rates"][0]
    assert rates["steps"] == [2, 3] and rates["samples_per_s"] > 0
    assert "jaxflash trained the driver's prompt rows: ['yes']" in proc.stdout


def test_untrain_stop_tokens_masks_only_a_final_stop_token(monkeypatch):
    import numpy as np
    from e2e_vs_tunix import untrain_stop_tokens

    from jaxflash.learner import batching
    from jaxflash.types import FinishReason, Sample

    monkeypatch.setattr(batching, "_response_mask", batching._response_mask)  # restored after

    def sample(i, response, reason):
        n = len(response)
        return Sample(prompt_id=i, sample_index=0, prompt_tokens=np.array([5, 6, 7]),
                      response_tokens=np.array(response), behaviour_logprobs=np.zeros(n),
                      token_versions=np.zeros(n, np.int32), start_version=0,
                      finish_reason=reason)  # fmt: skip

    samples = [sample(0, [9, 2], FinishReason.EOS), sample(1, [9, 9, 9], FinishReason.LENGTH),
               sample(2, [2], FinishReason.EOS)]  # fmt: skip
    before = batching.pack_batch(samples, [1.0, -1.0, 0.5], pad_id=0, length_multiple=1)
    counts = untrain_stop_tokens([2])
    after = batching.pack_batch(samples, [1.0, -1.0, 0.5], pad_id=0, length_multiple=1)
    # prompt of 3: response targets sit at columns 2 .. 2 + R - 1
    np.testing.assert_array_equal(before.loss_mask_bt[:, 2:5], [[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    np.testing.assert_array_equal(after.loss_mask_bt[:, 2:5], [[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(after.advantages_bt[0, 2:5], [1.0, 0.0, 0.0])
    assert counts == {"rows": 3, "stop_masked": 2}


def test_repeated_prefixes_compares_the_same_row_with_other_rows_of_the_next_step():
    steps = [[[1, 2], [3, 4], [5]], [[1, 2], [3, 4], [6]], [[7], [3, 4], [1, 2]]]
    r = repeated_prefixes(steps)
    assert r["pairs"] == 6
    assert r["same_row"] == 3 / 6  # rows 0, 1 (step 1) and 1 (step 2)
    assert r["other_rows"] == 1 / 12  # step 2's row 2 equals step 1's row 0


def test_learner_profile_runs_both_layouts_in_a_tiny_mode(capsys):
    from learner_profile import main

    rows = main(["--preset", "tiny", "--reps", "1", "--prompts", "2", "--group", "3",
                 "--prompt_len", "9", "--min_response", "2", "--response", "5"])  # fmt: skip
    # 6 rows of <= 13 columns (T 16) vs 2 group rows of 9 + 3 x 5 = 24 columns
    assert rows["unshared"]["shape"] == (1, 6, 16) and rows["shared"]["shape"] == (1, 2, 24)
    assert all(rows[k][part][0] > 0 for k in rows for part in ("step", "grad", "fwd", "opt"))
    assert "| columns | 96 | 48 | 2.00 |" in capsys.readouterr().out
