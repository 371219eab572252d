"""``launch/tpu_pod.py --dry_run``: an experiment's programs compiled ahead of time."""

import pytest

from configs import smoke_async
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.specs import ConfigError
from jaxflash.runtime.dry_run_plan import dry_run_report


def test_the_report_covers_the_configs_meshes_and_batch():
    c = smoke_async.get_config()  # learner fsdp 3 x tensor 2, a 1-device generation slice
    c.data.max_prompt_tokens = 24
    report = dry_run_report(ExperimentConfig.from_config_dict(c))
    lines = {line.split()[0]: line.split() for line in report.splitlines() if line.strip()}
    # Every program the run executes, on the placement's devices (peak: column 5).
    for name in ("prefill_16", "prefill_24", "publish", "install"):
        assert float(lines[name][4]) >= 0 and lines[name][1] in ("1", "6")
    assert lines["train_step"][1] == "6" and lines["decode_block_1"][1] == "1"
    assert float(lines["train_step"][4]) > 0 and float(lines["decode_block_1"][4]) > 0
    assert "learner devices 0-5, generation [6], [7] (disjoint)" in report
    # B x G sequences of prompt + response tokens; the engine's slots and cache.
    assert "batch [8, 32]" in report and "8 slots, prefill 24, cache 32" in report


@pytest.mark.slow  # a second ahead-of-time compile (~25 s on 2 busy cores)
def test_a_derived_prompt_length_is_assumed_and_said():
    c = smoke_async.get_config()
    c.data.max_prompt_tokens = 0
    report = dry_run_report(ExperimentConfig.from_config_dict(c))
    assert "assumes 256 tokens" in report


def test_an_hf_source_is_refused_naming_the_way_out(tmp_path):
    c = smoke_async.get_config()
    c.model.source, c.model.path = "hf", str(tmp_path)
    with pytest.raises(ConfigError, match="--config.model.source=random"):
        dry_run_report(ExperimentConfig.from_config_dict(c))


@pytest.mark.slow  # two more train-step compiles (LoRA, and full fine-tuning to compare)
def test_lora_compiles_the_adapter_step_and_reports_what_it_saves():
    c = smoke_async.get_config()
    c.data.max_prompt_tokens = 24
    c.learner.lora = {"rank": 4, "base_dtype": "int8"}
    report = dry_run_report(ExperimentConfig.from_config_dict(c))
    (saving,) = [x for x in report.splitlines() if x.startswith("learner train_step")]
    assert "LoRA rank 4 over a int8 base" in saving
    # Both steps compiled and were sized (the tiny config's peaks round to the same
    # 0.002 GiB; the saving itself is measured on SmolLM2 and Llama-3.1-8B:
    # benchmarks/results/dry_run_lora.txt).
    lora_peak, full_peak = (float(x.split(" GiB")[0]) for x in saving.split("peak ")[1:3])
    assert lora_peak > 0 and full_peak > 0 and "full fine-tuning" in saving
