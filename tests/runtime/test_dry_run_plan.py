"""``launch/tpu_pod.py --dry_run``: an experiment's programs compiled ahead of time."""

import dataclasses

import pytest

from configs import smoke_async
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.specs import ConfigError
from jaxflash.runtime.dry_run_plan import dry_run_report


def test_the_report_covers_the_configs_meshes_and_batch():
    c = smoke_async.get_config()  # learner fsdp 3 x tensor 2, a 1-device generation slice
    c.data.max_prompt_tokens = 24
    c.rollout.kv_cache, c.rollout.page_size, c.rollout.num_pages = "paged", 8, 12
    report = dry_run_report(ExperimentConfig.from_config_dict(c))
    lines = {line.split()[0]: line.split() for line in report.splitlines() if line.strip()}
    # Every program the run executes, on the placement's devices (peak: column 5).
    for name in ("prefill_16", "prefill_24", "publish", "install"):
        assert float(lines[name][4]) >= 0 and lines[name][1] in ("1", "6")
    assert lines["train_step"][1] == "6" and lines["decode_block_1"][1] == "1"
    assert float(lines["train_step"][4]) > 0 and float(lines["decode_block_1"][4]) > 0
    assert "learner devices 0-5, generation [6], [7] (disjoint)" in report
    # B x G sequences of prompt + response tokens; the engine's slots and its page pool
    # (12 pages x 8 tokens for 8 slots of 32 positions), per chip as allocated: tiny has
    # 2 layers x 2 KV heads x 16 dims, K and V, fp32 -> 512 B a token, 49,152 B of pool.
    assert "batch [8, 32]" in report and "8 slots, prefill 24, paged KV pool 96 tokens" in report
    assert "(12 pages x 8) for 8 slots of up to 32 positions, attention reference" in report
    # The decode block's bytes: XLA's count against weights + the pages in use.
    (traffic,) = [x for x in report.splitlines() if x.startswith("decode HBM bytes")]
    assert "48 of 96 tokens" in traffic and "(XLA + kernel reads) / paper" in traffic
    assert "gather reads every page of every slot (256 tokens" in report
    assert "forecast" not in report  # CPU devices: no chip figures, no roofline


def test_the_plans_pool_is_what_the_engine_allocates():
    """KvPool of the abstract DecodeState the plan compiles == of the engine's real one."""
    import jax

    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES
    from jaxflash.sizing.kv_pool import KvPool
    from jaxflash.sizing.programs import engine_programs

    model = get_preset("tiny")
    config = EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=16, max_target_length=40,
        kv_cache="paged", page_size=8, num_pages=10,
    )  # fmt: skip
    mesh = make_mesh(jax.devices()[:2], {"tensor": 2})  # 2 KV heads: split 2 ways
    _, _, abstract = engine_programs(model, config, mesh, GENERATOR_RULES, buckets=[])
    planned = KvPool.from_state(abstract)
    real = KvPool.from_state(LlamaEngine(model, config, mesh=mesh, rules=GENERATOR_RULES)
                             .init_decode_state())  # fmt: skip
    assert planned == real
    # 10 pages x 8 tokens x (2 layers x 2 x 2 heads x 16 x 4 B) / 2 chips.
    assert (planned.pool_tokens, planned.token_bytes) == (80, 512)
    assert planned.chip_bytes == 80 * 512 // 2 and planned.split == 2
    assert planned.reserved_tokens == 4 * 5 * 8  # 4 slots x ceil(40 / 8) pages x 8


@pytest.mark.slow  # a second ahead-of-time compile (~25 s on 2 busy cores)
def test_a_derived_prompt_length_is_assumed_and_said():
    c = smoke_async.get_config()
    c.data.max_prompt_tokens = 0
    report = dry_run_report(ExperimentConfig.from_config_dict(c))
    assert "assumes 256 tokens" in report


def test_an_hf_source_is_refused_naming_the_way_out(tmp_path):
    c = smoke_async.get_config()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):  # (not read)
        (tmp_path / name).write_text("{}")
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


# -- the forecast (simulate.forecast) on a stub plan: no compile ------------------------

GIB = 1 << 30
V5E_BW = 819e9  # bytes/s: a program reading V5E_BW * t bytes has a roofline of t seconds


def _stub_plan(attention="reference"):
    from jaxflash.sizing.kv_pool import KvPool
    from jaxflash.sizing.plan import Plan, ProgramCost

    def cost(name, role, seconds, devices, args=GIB, temp=0, flops=0.0):
        return ProgramCost(
            name=name, role=role, devices=devices, argument_bytes=args, temp_bytes=temp,
            flops=flops, bytes_accessed=V5E_BW * seconds,
        )  # fmt: skip

    costs = [
        # 1 s of FLOPs on v5e (197 TFLOP/s) for 16 x 320 tokens on 4 chips, 3/4 of them
        # on paper (what XLA's count of a scan body misses).
        dataclasses.replace(
            cost("train_step", "learner", 0.0, 4, args=2 * GIB, temp=GIB, flops=0.25 * 197e12),
            unseen_flops=0.75 * 197e12,
        ),
        # prefill: 1 ms + 10 us per bucket token.
        *(cost(f"prefill_{b}", "generation", 1e-3 + b * 1e-5, 2) for b in (16, 32, 64)),
        cost("decode_block_4", "generation", 4 * 0.010, 2),  # 10 ms a step
        cost("publish", "learner", 0.005, 4),
        cost("install", "generation", 0.002, 2),
    ]
    kv = KvPool(kind="paged", attention=attention, slots=16, positions=320, page_size=16,
                pages=160, token_bytes=1024, chip_bytes=160 * 16 * 1024 // 2)  # fmt: skip
    return Plan(costs=costs, kv=kv, engine_weight_bytes=10**9, learner_state_bytes=2 * GIB,
                decode_steps=4)  # fmt: skip


def _shape(**kw):
    from jaxflash.runtime.simulate.plan_costs import RunShape
    from jaxflash.sizing.chips import CHIPS

    base = dict(
        slice_chips=8, learner_chips=4, gen_chips=2, slots=16, prompts_per_step=4,
        group_size=4, prompt_tokens=64, max_new_tokens=256, async_ratio=2, packing=False,
        micro_batch_size=4, seq_len=320, hbm_bytes=CHIPS["v5e"].usable_hbm_bytes,
    )  # fmt: skip
    return RunShape(**{**base, **kw})


def test_program_times_are_the_rooflines_of_the_compiled_programs():
    from jaxflash.runtime.simulate.plan_costs import program_times
    from jaxflash.sizing.chips import CHIPS

    t = program_times(_stub_plan(), CHIPS["v5e"], _shape(), context_tokens=100.0)
    assert t.train_step_s == pytest.approx(1.0) and t.train_tokens == 16 * 320
    assert t.prefill_base_s == pytest.approx(1e-3) and t.prefill_token_s == pytest.approx(1e-5)
    # Reference path: every slot's pages each step, whatever is live.
    assert t.decode_base_s == pytest.approx(0.010) and t.decode_live_s == 0.0
    # Publish + install + one chip's weights (1 GB) at half of v5e's 400 GB/s ICI.
    assert t.sync_s == pytest.approx(0.005 + 0.002 + 1e9 / 200e9)
    # Kernel path: the compiled step's own bytes, plus each live slot's KV at the mean
    # context (100 tokens x 512 B per chip) at 819 GB/s.
    k = program_times(_stub_plan("tpu_kernel"), CHIPS["v5e"], _shape(), context_tokens=100.0)
    assert k.decode_live_s == pytest.approx(100 * 512 / V5E_BW)


def test_splits_keep_the_sequences_per_chip_and_the_hbm_margin():
    from jaxflash.runtime.simulate.forecast import splits

    got = {s.learner_chips: s for s in splits(_stub_plan(), _shape())}
    assert sorted(got) == [2, 4, 6]  # 8 chips minus 1..3 generation slices of 2
    assert "micro-batch 6 does not divide the batch of 16" in got[6].why
    assert got[4].fits and got[4].peak_bytes == pytest.approx(3 * GIB)  # the compiled one
    assert got[2].fits and got[2].peak_bytes == pytest.approx(5 * GIB)  # state 2 -> 4 GiB
    small = splits(_stub_plan(), _shape(hbm_bytes=4 * GIB))
    assert [s.fits for s in small] == [False, True, False]


def test_the_forecast_prints_sync_async_a_best_split_and_says_it_is_a_model():
    from jaxflash.runtime.simulate.forecast import forecast_report
    from jaxflash.sizing.chips import CHIPS

    text = forecast_report(_stub_plan(), CHIPS["v5e"], _shape(), topology="v5e-8")
    assert "MODEL FIGURES, NOT MEASUREMENTS" in text and "roofline" in text
    assert "workload (assumed" in text and "lognormal median 32 tokens" in text
    rows = [x.split() for x in text.splitlines() if x.startswith(("  sync", "  async"))]
    modes = [r[:2] for r in rows if r[2].isdigit()]  # the table's rows
    assert ["sync", "colocated"] in modes and ["sync", "a=0"] in modes
    assert ["async", "a=2"] in modes and len(modes) == 5  # colocated + 2 splits x 2
    (best,) = [x for x in text.splitlines() if "best split for async a=2" in x]
    assert "learner" in best and "x sync colocated" in best and "samples/s" in best
    assert "skipped: micro-batch 6" in text
    # The reference path gathers: the forecast says what the TPU kernel would buy.
    assert "what-if, decode by the paged TPU kernel" in text


@pytest.mark.parametrize(
    "name, slots, pool, positions",
    [("tpu_qwen2p5_1p5b_v5e", 128, 524288, 8192), ("tpu_llama3p1_8b_v5p", 256, 2097152, 32768)],
)
def test_the_tpu_presets_convert_with_their_sizes(name, slots, pool, positions):
    import importlib

    c = importlib.import_module(f"configs.{name}").get_config()
    exp = ExperimentConfig.from_config_dict(c)
    r = exp.rollout
    assert (exp.model.remat_policy, exp.model.compute_dtype) == ("full", "bfloat16")
    assert (r.kv_cache, r.num_slots, r.num_pages * r.page_size) == ("paged", slots, pool)
    assert exp.data.max_prompt_tokens + r.sampling.max_new_tokens == positions
    assert exp.learner.packing and not exp.mesh.colocated and r.async_ratio == 2
    # The launch command in the docstring is the one docs/TPU.md gives.
    assert (
        f"--config configs/{name}.py --dry_run --topology"
        in importlib.import_module(f"configs.{name}").__doc__
    )


def test_a_given_workload_replaces_the_assumed_one():
    from jaxflash.runtime.simulate import Replay, SimWorkload
    from jaxflash.runtime.simulate.forecast import make_forecast
    from jaxflash.sizing.chips import CHIPS

    work = SimWorkload(lengths=Replay(((8, 16, 32, 200),)), max_tokens=256, prompt_tokens=(32,))
    f = make_forecast(_stub_plan(), CHIPS["v5e"], _shape(), workload=work)
    assert "workload (given)" in f.work_line and "Replay lengths" in f.work_line
    assert f.best.result.len_max == 200 and f.best.result.samples_per_s > 0
