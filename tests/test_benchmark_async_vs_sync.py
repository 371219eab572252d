"""The benchmark's length-controlled model: P(EOS) per token is what was asked for."""

import importlib.util
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "async_vs_sync.py")


def _bench():
    spec = importlib.util.spec_from_file_location("async_vs_sync", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~20-60 s: tokenizer from the GGUF, 49152-word forward passes
def test_eos_probability_matches_target_and_model_loads_through_hf(tmp_path):
    from jaxflash.models.formats.weights_hf import load_hf

    cal = _bench().build_length_model(str(tmp_path / "m"), eos_prob=0.0625, max_len=96, seed=0)
    # Full softmax at every position of a 96-token forward pass: within 1 % of 1/16.
    assert 0.0625 * 0.99 < cal["p_min"] <= cal["p_max"] < 0.0625 * 1.01
    config, params = load_hf(str(tmp_path / "m"))
    assert (config.vocab_size, config.d_model, config.max_seq_len) == (49152, 64, 96)
    norm = np.asarray(params["final_norm_d"])
    assert norm[0] == 1.0 and not norm[1:].any()  # only dimension 0 reaches the logits
    assert os.path.exists(tmp_path / "m" / "tokenizer.json")


def test_bad_eos_probability_is_named(tmp_path):
    with pytest.raises(ValueError, match="--eos_prob"):
        _bench().build_length_model(str(tmp_path / "m"), eos_prob=1.0, max_len=96, seed=0)


def _write(path, rows):
    import json

    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _step(step, trained_at, n):
    return {
        "step": step,
        "trained_at_s": trained_at,
        "num_samples": n,
        "train_time_s": 1.0,
        "gen_tokens": 40,
        "gen_tokens_per_s": 20.0,
        "response_len_max": 4,
        "gen_slot_occupancy": 0.5,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "learner_wait_s": 0.5,
        "gen_idle_frac": 0.25,
        "prompt_outcomes": {"stale": {"stale": 1}},
    }


def _row(step, outcome="trained", masked=False, length=3):
    return {"learner_step": step, "outcome": outcome, "loss_masked": masked, "response_len": length}


def test_summary_discards_whole_warmup_steps_and_counts_trained_outcomes(tmp_path):
    steps = [
        {"step": 0, "eval_accuracy": 0.1},
        _step(1, 30.0, 2),
        _step(2, 40.0, 2),
        _step(3, 52.0, 1),
    ]
    rows = [_row(1), _row(1)]  # warm-up: not counted
    rows += [_row(2), _row(2, length=5), _row(2, "stale"), _row(2, "trained", masked=True)]
    rows += [_row(3), _row(3, "failed"), _row(3, "regenerated")]
    _write(tmp_path / "metrics.jsonl", steps)
    _write(tmp_path / "rollouts.jsonl", rows)
    s = _bench().summarize(str(tmp_path), warmup=1)
    assert s["trained_samples"] == 3 and s["wall_s"] == 22.0  # end of step 1 -> end of step 3
    assert s["samples_per_s"] == pytest.approx(3 / 22.0)
    assert (s["len_mean"], s["len_max"]) == (pytest.approx(11 / 3), 5.0)
    assert s["learner_idle"] == pytest.approx(1.0 / 22.0) and s["dropped_stale"] == 1
    assert s["s_per_decode_step"] == 0.5  # 2 busy seconds over a 4-token longest response
    # Warm-up 0: from the first request (trained_at_s is measured from it).
    assert _bench().summarize(str(tmp_path), warmup=0)["wall_s"] == 52.0
    # Rows that disagree with the metrics are refused, not averaged over.
    _write(tmp_path / "rollouts.jsonl", rows[:-3])
    with pytest.raises(RuntimeError, match="1 samples with loss|trained rows"):
        _bench().summarize(str(tmp_path), warmup=1)
