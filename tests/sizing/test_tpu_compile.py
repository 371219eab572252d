"""Deviceless TPU compile (``jaxflash.sizing``): slice names, roofline, the missing-extra
line, and a tiny config's programs compiled for abstract v5e chips (needs libtpu)."""

import importlib.util

import pytest

from jaxflash.sizing import chips
from jaxflash.sizing.chips import CHIPS, parse_topology, roofline_seconds
from jaxflash.sizing.plan import ProgramCost, parse_oom
from jaxflash.sizing.report import Settings, format_plan
from jaxflash.sizing.tpu import MissingTpuExtraError, check_libtpu
from tests.paths import REPO

GIB = 1 << 30


@pytest.mark.parametrize(
    "name, kind, grid, libtpu",
    [
        ("v5e-16", "v5e", (4, 4), "v5e:4x4"),
        ("v5litepod-8", "v5e", (2, 4), "v5e:2x4"),
        ("v5e-1", "v5e", (1, 1), "v5e:1x1"),
        ("v6e-64", "v6e", (8, 8), "v6e:8x8"),
        ("v5p-8", "v5p", (2, 2, 1), "v5p:2x2x1"),  # 8 TensorCores = 4 chips
        ("v5p-64", "v5p", (2, 4, 4), "v5p:2x4x4"),  # 32 chips
        ("v4-32", "v4", (2, 2, 4), "v4:2x2x4"),  # 16 chips
        ("v5e:4x8", "v5e", (4, 8), "v5e:4x8"),
        ("V5P:2x2x2", "v5p", (2, 2, 2), "v5p:2x2x2"),
    ],
)
def test_slice_names_parse_as_gcp_writes_them(name, kind, grid, libtpu):
    topo = parse_topology(name)
    assert (topo.chip.kind, topo.grid, topo.libtpu_name) == (kind, grid, libtpu)


def test_gcp_names_count_tensorcores_on_v5p_and_v4():
    assert parse_topology("v5p-64").chips == 32 and parse_topology("v5p-64").gcp_name == "v5p-64"
    assert parse_topology("v4-8").chips == 4
    assert parse_topology("v5e-16").chips == 16 and parse_topology("v6e-16").chips == 16


@pytest.mark.parametrize(
    "name, match",
    [
        ("v7x-8", "unknown TPU kind.*v5e-16"),
        ("h100-8", "unknown TPU kind"),
        ("v5e-12", "no slice of 12 chips.*valid: .*v5e-16"),
        ("v5p-7", "counts TensorCores"),
        ("v5e-512", "no slice of 512"),
        ("v5e:4x4x1", "2 dimensions"),
        ("sixteen", "unknown TPU kind"),
        ("v5e:4x3", "no slice of 12 chips"),
        ("v5e:1x8x", "not a slice name.*v5e:<grid>"),
        ("v5e:abc", "not a slice name"),
        ("v5p:2x2x3", "no slice of 12 chips"),
        ("v5e:2x1", "no slice of 2 chips"),
    ],
)
def test_unknown_names_are_refused_listing_the_valid_ones(name, match):
    with pytest.raises(ValueError, match=match):
        parse_topology(name)


def test_roofline_is_the_slower_of_compute_and_memory():
    v5e = CHIPS["v5e"]  # 197 TFLOP/s, 819 GB/s
    # Compute-bound: 197e12 FLOPs in 1 s; 819e6 bytes would take 1 ms.
    assert roofline_seconds(197e12, 819e6, v5e) == pytest.approx(1.0)
    # Memory-bound: 8.19e9 bytes = 10 ms; 1.97e9 FLOPs = 10 us.
    assert roofline_seconds(1.97e9, 8.19e9, v5e) == pytest.approx(0.01)
    # Two devices per chip (v4 TensorCores): each has half the chip.
    assert roofline_seconds(275e12, 0, CHIPS["v4"], share=2) == pytest.approx(2.0)


def test_the_compilers_out_of_memory_message_is_read():
    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (21.25G) exceeds available HBM (15.75G)."
    )
    assert parse_oom(msg) == (int(21.25 * GIB), int(15.75 * GIB))
    assert parse_oom("RESOURCE_EXHAUSTED: Used 40.20G of 15.75G hbm.") == (
        int(40.2 * GIB),
        int(15.75 * GIB),
    )
    assert parse_oom("INVALID_ARGUMENT: bad") is None


def test_without_the_extra_the_message_is_one_line_naming_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "libtpu" else real(n, *a)
    )
    with pytest.raises(MissingTpuExtraError) as err:
        check_libtpu()
    text = str(err.value)
    assert "\n" not in text and "jaxflash[tpu]" in text and "libtpu==0.0.42.1" in text


def test_a_program_over_hbm_names_the_number_and_the_setting():
    settings = Settings(
        micro_batch_size=8, remat=True, batch_size=32, seq_len=2048, num_slots=128,
        cache_len=4096, max_prefill_length=1024, prefill_rows=1,
        learner_mesh={"fsdp": 8}, generation_mesh={"tensor": 8}, n_kv_heads=2,
        colocated=False,
    )  # fmt: skip
    costs = [
        ProgramCost(name="train_step", role="learner", devices=8, argument_bytes=2 * GIB,
                    temp_bytes=20 * GIB, flops=1e12, bytes_accessed=1e10),
        ProgramCost(name="decode_block_8", role="generation", devices=8,
                    argument_bytes=15 * GIB, temp_bytes=GIB, flops=1e9, bytes_accessed=5e10),
        ProgramCost(name="prefill_1024", role="generation", devices=8, argument_bytes=GIB),
    ]  # fmt: skip
    table = format_plan(costs, chip=CHIPS["v5e"], settings=settings)
    assert "DOES NOT FIT: train_step needs 22.00 GiB per device of 15.75 GiB" in table
    assert "over by 6.25 GiB" in table and "learner.micro_batch_size (now 8)" in table
    assert "DOES NOT FIT: decode_block_8" in table and "rollout.num_slots" in table
    assert "n_kv_heads=2" in table and "DOES NOT FIT: prefill" not in table
    # Roofline of the decode block: memory-bound, 5e10 B / 819 GB/s = 61.05 ms.
    row = next(line for line in table.splitlines() if line.startswith("decode_block_8"))
    assert row.split()[-1] == "61.05ms"


def test_parse_needs_no_jax_at_import():
    assert "jax" not in chips.__dict__


_HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.fixture(scope="module")
def tiny_plan():
    if not _HAS_LIBTPU:
        pytest.skip("libtpu not installed: pip install 'jaxflash[tpu]' (CI installs it)")
    import dataclasses

    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.learner.config import LearnerConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES
    from jaxflash.sizing import programs
    from jaxflash.sizing.plan import measure
    from jaxflash.sizing.tpu import topology_devices

    devices = topology_devices(parse_topology("v5e-4"))
    model = get_preset("tiny", compute_dtype="bfloat16", remat=True)
    engine = EngineConfig(
        max_concurrent_decodes=8, max_prefill_length=32, max_target_length=64, decode_block=4
    )
    # The two programs CI compiles for TPU (the others go the same way: sizing.plan).
    train, _ = programs.train_step_program(
        model, LearnerConfig(lr=1e-3, micro_batch_size=4), make_mesh(devices[:2], {"fsdp": 2}),
        LEARNER_RULES, batch_size=8, seq_len=64,
    )  # fmt: skip
    gmesh = make_mesh(devices[2:], {"tensor": 2})
    (block,), _, _ = programs.engine_programs(model, engine, gmesh, GENERATOR_RULES, buckets=[])
    # The paged engine's block: 24 pages of 8 for 8 slots of 64 positions (reference path:
    # a 2-chip engine), renamed so the rows stay apart.
    paged = dataclasses.replace(engine, kv_cache="paged", page_size=8, num_pages=24)
    (pblock,), _, pstate = programs.engine_programs(
        model, paged, gmesh, GENERATOR_RULES, buckets=[]
    )
    pcost = dataclasses.replace(measure(pblock), name="paged_decode_block_4")
    costs = [measure(train), measure(block)]
    return model, devices, {c.name: c for c in costs}, train, (pcost, pstate)


def test_train_step_and_decode_block_compile_for_abstract_v5e_chips(tiny_plan):
    model, devices, by, *_ = tiny_plan
    assert devices[0].platform == "tpu" and devices[0].device_kind == "TPU v5 lite"
    assert list(by) == ["train_step", "decode_block_4"]
    for c in by.values():
        assert not c.refused and c.peak_bytes < CHIPS["v5e"].usable_hbm_bytes
    train, block = by["train_step"], by["decode_block_4"]
    assert train.devices == 2 and block.devices == 2
    assert train.flops > 0 and train.bytes_accessed > 0 and block.bytes_accessed > 0
    # The decode block reads at least this device's half of the KV cache (2 KV heads
    # split over tensor=2): [8 slots, 64 positions, head_dim] per layer, K and V, at
    # least 2 bytes a value.
    cache_half = 2 * model.n_layers * 8 * 64 * model.head_dim * 2
    assert block.argument_bytes >= cache_half and block.alias_bytes >= cache_half
    assert block.bytes_accessed >= cache_half


def test_the_tpu_train_step_attends_with_the_splash_kernel(tiny_plan):
    """model.attention="auto" on TPU chips: the Pallas (Mosaic) kernel, no [T, T] scores."""
    train = tiny_plan[3]
    text = train.lower().as_text()
    assert "tpu_custom_call" in text  # the Mosaic kernel (dense attention has none)


def test_the_exact_modes_programs_compile_for_abstract_v5e_chips():
    """``model.exact_numerics`` on TPU: a 1-chip learner step (packed rows) and a paged
    engine with its slots over data=2 (the layouts the exact mode accepts) compile and
    fit, and neither calls a Mosaic kernel (splash / ragged paged attention sum in their
    own order; the exact mode's attention is pure JAX on both sides)."""
    if not _HAS_LIBTPU:
        pytest.skip("libtpu not installed: pip install 'jaxflash[tpu]' (CI installs it)")
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.learner.config import LearnerConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES, LEARNER_RULES
    from jaxflash.sizing import programs
    from jaxflash.sizing.kv_pool import KvPool
    from jaxflash.sizing.plan import measure
    from jaxflash.sizing.tpu import topology_devices

    devices = topology_devices(parse_topology("v5e-4"))
    model = get_preset("tiny", compute_dtype="bfloat16", remat=True, exact_numerics=True)
    learner = LearnerConfig(lr=1e-3, micro_batch_size=2, packing=True, pack_length=64)
    train, _ = programs.train_step_program(
        model, learner, make_mesh(devices[:1], {"fsdp": 1}), LEARNER_RULES,
        batch_size=4, seq_len=64,
    )  # fmt: skip
    engine = EngineConfig(
        max_concurrent_decodes=8, max_prefill_length=32, max_target_length=64,
        decode_block=4, kv_cache="paged", page_size=8, num_pages=48,
    )  # fmt: skip
    gmesh = make_mesh(devices[2:], {"data": 2})
    (prefill, block), _, state = programs.engine_programs(
        model, engine, gmesh, GENERATOR_RULES, buckets=[32]
    )
    assert KvPool.from_state(state).attention == "reference"
    for program in (train, prefill, block):
        assert "tpu_custom_call" not in program.lower().as_text(), program.name
        cost = measure(program)
        assert not cost.refused and 0 < cost.peak_bytes < CHIPS["v5e"].usable_hbm_bytes


def test_the_paged_decode_block_compiles_with_the_pool_it_allocates(tiny_plan):
    """The decode row of a paged engine: its pool (not a dense cache) is what the block
    takes and returns, split over the 2 KV heads; the reference path gathers every
    page-table entry of every slot, and XLA counts at least that."""
    from jaxflash.sizing.kv_pool import KvPool, decode_traffic

    model, _, _, _, (cost, state) = tiny_plan
    kv = KvPool.from_state(state)
    assert (kv.kind, kv.attention, kv.slots, kv.pool_tokens) == ("paged", "reference", 8, 192)
    # bf16 pool [24, 8, 2 x 2, 16] per layer, split 2 ways by KV head.
    assert kv.chip_bytes == model.n_layers * 24 * 8 * 4 * model.head_dim * 2 // 2
    assert not cost.refused and cost.alias_bytes >= kv.chip_bytes
    t = decode_traffic(kv, xla_bytes=cost.bytes_accessed, steps=4, weight_bytes=0)
    assert t.kv_gathered == kv.reserved_tokens * kv.token_chip_bytes > t.kv_in_use
    assert t.xla >= t.kv_gathered and t.kernel_unseen == 0


def test_the_report_of_a_tpu_plan_has_a_roofline(tiny_plan):
    _, _, by, *_ = tiny_plan
    table = format_plan(list(by.values()), chip=CHIPS["v5e"])
    row = next(line for line in table.splitlines() if line.startswith("train_step"))
    assert row.endswith("ms") and float(row.split()[-1][:-2]) > 0
    assert "DOES NOT FIT" not in table


def test_a_long_prefill_compiles_with_splash_and_no_t_by_t_scores():
    """A bucket above ``prefill_dense_max`` on a v5e chip: the prefill attends with the
    splash kernel (Mosaic), holds no [T, T] array (the dense prefill's masks and scores
    are [T, T]), and its temporaries stay below an eighth of one layer's float32 [T, T]
    scores (T = 2048). Measured for Qwen2.5-1.5B, bf16, T = 8192: 6.84 GiB of
    temporaries dense, 0.37 GiB O(T) (benchmarks/prefill_memory.py, docs/TPU.md)."""
    if not _HAS_LIBTPU:
        pytest.skip("libtpu not installed: pip install 'jaxflash[tpu]' (CI installs it)")
    import re

    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES
    from jaxflash.sizing import programs
    from jaxflash.sizing.tpu import topology_devices

    t = 2048
    devices = topology_devices(parse_topology("v5e-4"))
    model = get_preset("tiny", compute_dtype="bfloat16", max_seq_len=2 * t)
    engine = EngineConfig(
        max_concurrent_decodes=8, max_prefill_length=t, max_target_length=t + 64,
        prefill_dense_max=t // 2,
    )  # fmt: skip
    (prefill, _), _, _ = programs.engine_programs(
        model, engine, make_mesh(devices[:1], {}), GENERATOR_RULES, buckets=[t]
    )
    compiled = prefill.lower().compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    assert not re.search(rf"\[[\d,]*{t},{t}\]", text)  # no [..., T, T] buffer
    scores = model.n_heads * t * t * 4
    assert compiled.memory_analysis().temp_size_in_bytes < scores / 8


@pytest.fixture(scope="module")
def paged_block():
    """The paged engine's decode block for v5e-4 as data=2 x tensor=2: a tiny bf16 model
    whose heads the kernel tiles (2 kv heads of 128: one per chip), 64 pages of 16."""
    if not _HAS_LIBTPU:
        pytest.skip("libtpu not installed: pip install 'jaxflash[tpu]' (CI installs it)")
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.models.caches import ragged_attention
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES
    from jaxflash.sizing import programs
    from jaxflash.sizing.tpu import topology_devices

    devices = topology_devices(parse_topology("v5e-4"))
    model = get_preset("tiny", compute_dtype="bfloat16", head_dim=128)
    engine = EngineConfig(
        max_concurrent_decodes=8, max_prefill_length=32, max_target_length=64, decode_block=4,
        kv_cache="paged", page_size=16, num_pages=64,
    )  # fmt: skip
    mesh = make_mesh(devices, {"data": 2, "tensor": 2})
    (block,), _, state = programs.engine_programs(model, engine, mesh, GENERATOR_RULES, buckets=[])
    # Each chip's 4 rows x 4 pages (16 B of table a row) in calls of 2 rows: the chunking
    # that keeps a large engine's page table within SMEM (ragged_attention.rows_per_call).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ragged_attention, "SMEM_TABLE_BYTES", 32)
        return state, block.lower().compile()


def test_the_paged_decode_block_runs_the_kernel_on_each_chips_pages(paged_block):
    """paged_attention="auto" on a TPU mesh: ragged_paged_attention (Mosaic) per chip under
    shard_map; each chip holds 1/G of the pages (G = 2 slot groups over data) of its
    kv head, and no chip ever holds a whole pool."""
    import math

    from jaxflash.sizing.programs import per_device_bytes

    state, compiled = paged_block
    pages = state.cache.pages
    assert pages.kernel and pages.layout.groups == 2 and pages.layout.head_shards == 2
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the Mosaic kernel
    # 2 layers x 2 calls of 2 rows (the fixture's SMEM budget), on each chip's own rows.
    calls = [
        x for x in text.splitlines() if "= " in x and 'custom_call_target="tpu_custom_call"' in x
    ]
    assert len(calls) == 2 * 2 and all("bf16[2,2,128]" in x.split("=")[1][:40] for x in calls)
    pools = state.cache.kv_pages
    total = sum(math.prod(p.shape) * p.dtype.itemsize for p in pools)
    per_chip = per_device_bytes(pools)
    assert per_chip * 2 * 2 == total  # 1/G of the pages, 1/2 of the heads
    # The donated state (its pools, the page table, per-slot vectors) aliases its
    # outputs: per chip that is the chip's quarter of the pools, not a replica.
    memory = compiled.memory_analysis()
    assert per_chip <= memory.alias_size_in_bytes < per_chip + (1 << 16)
    assert "bf16[64,16,4,128]" not in text  # no buffer of a whole layer's pool
    # The HBM walk reproduces XLA's count of the block under XLA's rules (so the plan
    # uses it), and per step reads no more than XLA's count (VMEM staging left out).
    from jaxflash.sizing.hbm_traffic import hbm_traffic

    xla = compiled.cost_analysis()["bytes accessed"]
    walk = hbm_traffic(text, trips=4, xla_bytes=xla)
    assert walk.agrees and 0 < walk.hbm / 4 <= xla


def test_the_kernels_page_table_fits_smem_in_calls_of_rows():
    """256 slots x 1,024 pages of int32 (32k positions in pages of 32) is 1 MiB, all of
    v5p's SMEM: the compiler refused Llama-3.1-8B's decode block. Calls of 128 rows."""
    from jaxflash.models.caches.ragged_attention import SMEM_TABLE_BYTES, rows_per_call

    assert rows_per_call(1024) == 128 and rows_per_call(256) == 512
    assert rows_per_call(1024) * 1024 * 4 <= SMEM_TABLE_BYTES and rows_per_call(10**9) == 1


def test_the_launcher_says_it_in_one_line_and_exits_2_without_libtpu():
    import subprocess
    import sys

    root = REPO
    # libtpu hidden from the launcher's check (CI has the extra installed).
    prelude = (
        "import importlib.util, runpy, sys; real = importlib.util.find_spec; "
        "importlib.util.find_spec = lambda n, *a: None if n == 'libtpu' else real(n, *a); "
        "sys.argv = ['tpu_pod.py', '--config', 'configs/smoke.py', '--dry_run', "
        "'--topology', 'v5e-16']; runpy.run_path('launch/tpu_pod.py', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", prelude], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'jaxflash[tpu]'" in lines[0]
    assert "jax" not in out.stdout  # nothing started


def test_an_elastic_move_compiles_the_reshard_programs_it_runs():
    """Growing fsdp 2 -> 4 gathers on the old chips and slices on the new (4 does not
    divide 2); shrinking 4 -> 2 stages on the old chips (2 divides 4). CPU devices."""
    import jax

    from jaxflash.learner.config import LearnerConfig
    from jaxflash.learner.state import abstract_train_state
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import LEARNER_RULES
    from jaxflash.sizing import programs
    from jaxflash.sizing.plan import measure

    model, learner = get_preset("tiny"), LearnerConfig(lr=1e-3, micro_batch_size=4)
    small = make_mesh(jax.devices()[:2], {"fsdp": 2})
    big = make_mesh(jax.devices()[:4], {"fsdp": 4})
    grow = programs.elastic_programs(
        model, learner, abstract_train_state(model, learner, small, LEARNER_RULES), big,
        LEARNER_RULES,
    )  # fmt: skip
    assert {p.name for p in grow} == {"elastic_2to4_gather", "elastic_2to4_slice"}
    shrink = programs.elastic_programs(
        model, learner, abstract_train_state(model, learner, big, LEARNER_RULES), small,
        LEARNER_RULES,
    )  # fmt: skip
    assert {p.name for p in shrink} == {"elastic_4to2_staged"}
    for p in grow + shrink:
        cost = measure(p)
        assert cost.argument_bytes > 0 and cost.peak_bytes >= cost.argument_bytes


def test_xla_counts_a_loop_body_once():
    """Why the plan computes the train step's FLOPs on paper and multiplies the decode
    block's costs by its steps: a scan of 10 matmuls reports the FLOPs of one."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 64))

    def flops(fn):
        return jax.jit(fn).lower(x).compile().cost_analysis()["flops"]

    one = flops(lambda a: a @ a)
    ten = flops(lambda a: jax.lax.scan(lambda c, _: (c @ a, None), a, None, length=10)[0])
    assert one == 2 * 64**3 and ten == pytest.approx(one, abs=8)  # + the loop counter


def test_xla_counts_a_weight_again_for_its_vmem_staging_and_the_hbm_walk_does_not():
    """Why the plan reads a decode step's HBM bytes from the compiled program: for one
    bf16 matmul x[32, 1536] @ w[1536, 4480] (a 13.8 MB weight) XLA's TPU cost analysis
    counts the weight 5 times (the copy into VMEM: its read, its (VMEM, source) output
    tuple and its done; then the matmul's read from VMEM). The walk reproduces that total
    under XLA's rules and counts the HBM side once: w + x + the output."""
    if not _HAS_LIBTPU:
        pytest.skip("libtpu not installed: pip install 'jaxflash[tpu]' (CI installs it)")
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxflash.sizing.hbm_traffic import hbm_traffic
    from jaxflash.sizing.tpu import topology_devices

    chip = topology_devices(parse_topology("v5e-4"))[0]
    one = NamedSharding(Mesh([chip], ("x",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((32, 1536), jnp.bfloat16, sharding=one)
    w = jax.ShapeDtypeStruct((1536, 4480), jnp.bfloat16, sharding=one)
    with jax.default_device(chip):
        compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    xla = compiled.cost_analysis()["bytes accessed"]
    walk = hbm_traffic(compiled.as_text(), xla_bytes=xla)
    weight, io = 1536 * 4480 * 2, (32 * 1536 + 32 * 4480) * 2
    assert xla > 4.5 * weight and walk.agrees
    assert walk.xla_rules == pytest.approx(xla, rel=1e-3)
    assert walk.hbm == pytest.approx(weight + io, rel=1e-3)


def test_train_step_flops_on_paper_by_hand():
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sizing.paper import matmul_params, train_step_flops

    tiny = get_preset("tiny", remat=True, remat_policy="full")  # tied, 2 layers, d 64
    # Per layer q 64x4x16 + k, v 64x2x16 + o 4x16x64 + gate, up, down 64x128: 36,864;
    # x 2 layers + the tied head 512 x 64.
    assert matmul_params(tiny) == 2 * 36864 + 512 * 64
    # 4 passes (forward, backward x 2, full remat's recompute) x 8 x 64 tokens x
    # (2 x 106,496 + attention 4 x 32.5 positions x 4 heads x 16 x 2 layers).
    per_token = 2 * 106496 + 4 * 32.5 * 4 * 16 * 2
    assert train_step_flops(tiny, batch=8, seq_len=64) == 4 * 8 * 64 * per_token
    dots = get_preset("tiny", remat=True)  # matmul outputs kept: no recompute of them
    assert train_step_flops(dots, batch=8, seq_len=64, kl=True) == 4 * 8 * 64 * per_token
