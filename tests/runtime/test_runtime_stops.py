"""The whole loop on a checkpoint whose turns end with a token that is not its eos.

``tests/data/chat_models/qwen2.5-base`` names ``<|endoftext|>`` (id 0) as eos
while its template ends turns with ``<|im_end|>`` (id 2); its
generation_config.json lists both. Saved here with a tiny random model whose
``<|im_end|>`` logit wins every draw and whose vocabulary is padded past the
tokenizer's (as real checkpoints pad to a multiple of 64 or 128), the run must

* stop every response at ``<|im_end|>`` with finish reason eos (stopping on eos
  alone would run each to max_new_tokens, marked truncated, reward 0 under the
  default truncation penalty), in training and in evaluation;
* record the stop set (ids, tokens, sources) in run_config.json and on the console;
* score evaluation with the run's own custom reward (not 0 for lack of a
  Math-Verify component);
* derive the prompt limits from the data (the byte-level fixture tokenizer makes
  prompts of ~100+ tokens, more than the old fixed 64);
* and, run again when finished, say so and change nothing.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import smoke
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.models.formats.weights_hf import save_hf
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.runtime.console import Console
from jaxflash.runtime.loop import run
from tests.chat_fixtures import build_checkpoint

IM_END, ENDOFTEXT = 2, 0


def _checkpoint(tmp_path) -> str:
    directory = build_checkpoint("qwen2.5-base", tmp_path)
    tokenizer = Tokenizer.from_hf_dir(directory)
    padded = -(-tokenizer.vocab_size // 64) * 64 + 64  # rows no token maps to
    config = get_preset("tiny", vocab_size=padded, max_seq_len=512)
    params = init_params(config, seed=3)
    embed = np.asarray(params["embed_vd"]).copy()
    embed[IM_END] *= 300.0  # tied embeddings: this model ends its turn at once
    params = jax.device_get({**params, "embed_vd": jnp.asarray(embed)})
    save_hf(directory, config, params)  # keeps the fixture's tokenizer and generation_config
    return str(directory)


def _rows(tmp_path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}? Think step by step.", "answer": str(2 * i)})
            + "\n"
            for i in range(20)
        )
    )
    return str(path)


@pytest.mark.timeout(600)
def test_stop_set_reward_and_rerun_end_to_end(tmp_path):
    c = smoke.get_config()
    c.total_steps = 1
    c.model.source, c.model.path = "hf", _checkpoint(tmp_path)
    c.data.task, c.data.path = "file", _rows(tmp_path)
    c.data.eval_size = 2  # 10 % of 20 rows
    c.eval.samples_per_prompt = 2
    c.rollout.truncation = "penalty"  # the default: a truncated answer would score 0
    c.reward.fn = "tests.reward_fixtures:quarter_reward"
    exp = ExperimentConfig.from_config_dict(c)
    assert exp.data.max_prompt_tokens == 0 and exp.rollout.max_prefill_length == 0  # derive
    workdir = tmp_path / "run"
    out = io.StringIO()
    last = run(exp, workdir=str(workdir), console=Console(out, every_s=1.0))

    # Every response, trained or evaluated, ended at <|im_end|>: eos, never truncated.
    rollouts = [json.loads(x) for x in open(workdir / "rollouts.jsonl")]
    assert len(rollouts) == 4 * 2
    for r in rollouts:
        assert r["finish_reason"] == "eos" and r["response_tokens"] == [IM_END]
        assert r["response"] == "" and r["reward"] == 0.25  # not the truncation penalty
    assert last["truncated_frac"] == 0.0 and last["prompts_trained"] == 4
    # Evaluation scored with the run's reward: its score, not 0.
    step0 = json.loads(open(workdir / "metrics.jsonl").readline())
    assert step0["step"] == 0 and step0["eval_prompts"] == 2
    assert step0["eval_accuracy"] == last["eval_accuracy"] == 0.25

    # The stop set and the derived prompt limit, in the workdir and on the console.
    info = json.load(open(workdir / "run_config.json"))
    assert info["stop_set"]["ids"] == [ENDOFTEXT, IM_END]
    assert info["stop_set"]["tokens"] == {"0": "<|endoftext|>", "2": "<|im_end|>"}
    assert any("generation_config" in s for s in info["stop_set"]["sources"]["2"])
    limit = info["experiment"]["data"]["max_prompt_tokens"]
    longest = info["prompt_lengths"]["longest"]
    assert 64 < longest <= limit < 2 * longest and limit & (limit - 1) == 0  # power of two
    assert info["experiment"]["rollout"]["max_prefill_length"] == limit
    console = out.getvalue()
    assert "stop set (ids that end a response): 0 '<|endoftext|>'" in console
    assert "2 '<|im_end|>' <- " in console
    assert f"prompt length limit {limit} tokens" in console
    assert "step 1/1 | elapsed" in console and "finished 1/1 steps" in console
    # The finish line's TensorBoard is the venv's (issue 31: a bare `tensorboard` is not
    # on the PATH of a venv that is not activated).
    venv_tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    if not os.path.relpath(venv_tensorboard).startswith(".."):  # under the working directory
        venv_tensorboard = os.path.relpath(venv_tensorboard)
    assert f"; {venv_tensorboard} --logdir {workdir}/tensorboard" in console

    # Run again: finished, so nothing is loaded, written or appended.
    before = {p: os.path.getsize(workdir / p) for p in ("metrics.jsonl", "rollouts.jsonl")}
    events = sorted(os.listdir(workdir / "tensorboard"))
    again = io.StringIO()
    finished = run(exp, workdir=str(workdir), console=Console(again))
    assert finished["step"] == finished["policy_version"] == 1  # metrics.jsonl's last row
    assert "is finished: its last checkpoint is step 1 and total_steps=1" in again.getvalue()
    assert "--config.total_steps=<more than 1>" in again.getvalue()
    assert {p: os.path.getsize(workdir / p) for p in before} == before
    assert sorted(os.listdir(workdir / "tensorboard")) == events
    # Another config's model in this finished workdir: refused for the model at once, not
    # told "finished ... --config.total_steps=<more>", advice the model check then refused.
    other = dataclasses.replace(exp, model=dataclasses.replace(exp.model, source="random", path=""))
    with pytest.raises(ConfigError, match=r"finished run of another model .*'model.source'"):
        run(other, workdir=str(workdir), console=Console(io.StringIO()))


def test_weights_the_importer_refuses_are_a_config_error_naming_model_path(tmp_path):
    # Found by a new-user trial: an unknown rope_type in config.json was a traceback
    # (exit 1) from the model load; it is input, so it is a one-line config error.
    from jaxflash.runtime.config.experiment import ConfigError
    from jaxflash.runtime.model_setup import load_model, load_tokenizer

    directory = _checkpoint(tmp_path)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        hf_config = json.load(f)
    hf_config["rope_scaling"] = {"rope_type": "yarnx", "factor": 2.0}
    with open(path, "w") as f:
        json.dump(hf_config, f)
    c = smoke.get_config()
    c.model.source, c.model.path = "hf", directory
    exp = ExperimentConfig.from_config_dict(c)
    with pytest.raises(ConfigError, match=r"model.path=.*rope_type='yarnx'"):
        load_model(exp.model, exp.rollout, load_tokenizer(exp.model))


def test_responses_longer_than_the_models_context_are_a_config_error(tmp_path):
    # Found by a new-user trial: max_new_tokens past the checkpoint's context was a
    # traceback from the model load; it is a setting, so it is a one-line config error.
    from jaxflash.runtime.config.experiment import ConfigError
    from jaxflash.runtime.model_setup import load_model, load_tokenizer

    c = smoke.get_config()
    c.model.source, c.model.path = "hf", _checkpoint(tmp_path)  # max_seq_len 512
    c.rollout.max_prefill_length, c.rollout.max_new_tokens = 64, 600
    exp = ExperimentConfig.from_config_dict(c)
    with pytest.raises(ConfigError, match=r"= 664 exceeds the model's max_seq_len=512"):
        load_model(exp.model, exp.rollout, load_tokenizer(exp.model))


def test_a_refused_launch_leaves_the_workdir_as_it_was(tmp_path):
    # Issue 31: the smoke config on a real model's workdir was refused as a traceback,
    # after run_config.json had been replaced by the refused settings.
    from jaxflash.runtime.config.experiment import ConfigError

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "model_config.json").write_text(json.dumps({"d_model": 576, "n_layers": 30}))
    (workdir / "run_config.json").write_text('{"experiment": "the real model\'s run"}')
    before = {p.name: p.read_bytes() for p in workdir.iterdir()}
    c = smoke.get_config()
    c.total_steps = 1
    with pytest.raises(ConfigError, match=r"workdir .* holds a run of a different model"):
        run(ExperimentConfig.from_config_dict(c), workdir=str(workdir))
    assert {p.name: p.read_bytes() for p in workdir.iterdir()} == before
