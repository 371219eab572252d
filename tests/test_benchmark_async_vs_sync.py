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
    from jaxflash.models.weights_hf import load_hf

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
