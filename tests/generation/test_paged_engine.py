"""The paged KV cache (``EngineConfig.kv_cache="paged"``) against the dense engine.

One tiny fp32 engine of each kind (3 slots, S = 40) serves every test, so the
programs compile once. The paged pool is small on purpose (12 pages of 4
positions = 48 positions for 3 slots of 40): requests wait for pages at
admission, running samples get preempted, and fresh samples of one prompt share
its full prompt pages — and tokens and logprobs still equal the dense engine's
bit for bit.
"""

import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.api import EngineApi
from jaxflash.generation.page_pool import PagePool
from jaxflash.generation.slot_loop import SlotBatcher
from jaxflash.generation.slot_types import check_request
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.config.specs import ConfigError
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams

CFG = get_preset("tiny")  # vocab 512, fp32
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)
BASE = dict(max_concurrent_decodes=3, max_prefill_length=16, max_target_length=40, decode_block=4)
PAGES = dict(kv_cache="paged", page_size=4, num_pages=12)
NO_EOS = -1


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def new_params():
    return init_params(CFG, seed=1)


@pytest.fixture(scope="module")
def dense():
    return LlamaEngine(CFG, EngineConfig(**BASE, **SAMPLING))


@pytest.fixture(scope="module")
def paged():
    return LlamaEngine(CFG, EngineConfig(**BASE, **PAGES, **SAMPLING))


def request(prompt_id, prompt_len, max_new, sample_index=0):
    tokens = (np.arange(prompt_len, dtype=np.int32) * 37 + 11 * prompt_id) % CFG.vocab_size
    return GenerationRequest(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=tokens,
        sampling=SamplingParams(max_new_tokens=max_new, **SAMPLING),
    )


def drain(batcher):
    done = []
    while not batcher.idle:
        done += batcher.step()
    return {(s.prompt_id, s.sample_index): s for s in done}


def run(engine, params, requests):
    batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS)
    for r in requests:
        batcher.add(r)
    return drain(batcher), batcher


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key].response_tokens, b[key].response_tokens, str(key))
        np.testing.assert_array_equal(
            a[key].behaviour_logprobs, b[key].behaviour_logprobs, str(key)
        )
        np.testing.assert_array_equal(a[key].token_versions, b[key].token_versions, str(key))
        assert a[key].finish_reason == b[key].finish_reason


def assert_pool_full(batcher):
    pool = batcher.pages
    pool.check()
    assert pool.num_free == pool.num_pages and not pool.table[pool.table < pool.num_pages].size


def test_paged_equals_dense_with_shared_prompts_waits_and_preemption(dense, paged, params):
    # 3 prompts x 2 samples: prompts of 9 and 13 tokens have full pages to share.
    requests = [request(p, 5 + 4 * p, 12 + 3 * p, s) for p in range(3) for s in range(2)]
    want, _ = run(dense, params, requests)
    got, batcher = run(paged, params, requests)
    assert_same(want, got)
    assert batcher.stats.shared_pages > 0  # second samples mapped their prompt's pages
    assert batcher.stats.page_waits + batcher.stats.preempted > 0  # the pool was short
    assert batcher.pages.peak_in_use <= 12
    assert_pool_full(batcher)


def test_admission_waits_for_pages_then_completes(dense, paged, params):
    # Prompt 15 + a first block of 4 -> 5 pages each: 2 start, the third waits.
    requests = [request(10 + i, 15, 20) for i in range(3)]
    batcher = SlotBatcher(paged, params, policy_version=0, eos_id=NO_EOS)
    for r in requests:
        batcher.add(r)
    batcher.step()
    assert batcher.num_running == 2 and batcher.num_queued == 1
    assert batcher.stats.page_waits == 1
    got = drain(batcher)
    want, _ = run(dense, params, requests)
    assert_same(want, got)
    assert all(s.finish_reason == FinishReason.LENGTH for s in got.values())
    assert_pool_full(batcher)


def test_abort_returns_pages(paged, params):
    batcher = SlotBatcher(paged, params, policy_version=0, eos_id=NO_EOS)
    keys = [batcher.add(request(20 + i, 6, 30)) for i in range(4)]
    batcher.step()
    assert batcher.pages.in_use > 0 and batcher.num_queued >= 1
    for key in keys:  # running and queued alike
        sample = batcher.abort(key)
        assert sample.finish_reason == FinishReason.ABORTED
        batcher.pages.check()
    assert batcher.idle
    assert_pool_full(batcher)


@pytest.mark.parametrize("policy", ["continue", "recompute"])
def test_weight_update_mid_sample(dense, paged, params, new_params, policy):
    """Versions [0, 0, ..., 1, ...], the same tokens and logprobs as the dense engine."""
    out = []
    for engine in (dense, paged):
        batcher = SlotBatcher(engine, params, policy_version=0, eos_id=NO_EOS)
        for s in range(2):
            batcher.add(request(30, 9, 14, s))
        batcher.step()  # first token + one block under version 0
        batcher.set_params(new_params, 1, in_flight=policy)
        out.append((drain(batcher), batcher))
    (want, _), (got, batcher) = out
    assert_same(want, got)
    for sample in got.values():
        assert sample.token_versions[0] == 0 and sample.token_versions[-1] == 1
    assert_pool_full(batcher)


@pytest.fixture(scope="module")
def split():
    """A paged engine on data=2 x tensor=2 CPU devices (GENERATOR_RULES): kv heads over
    tensor, pages and slots over data (2 slot groups of 2 slots and 8 pages)."""
    import jax

    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES

    mesh = make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2})
    cfg = EngineConfig(
        **{**BASE, "max_concurrent_decodes": 4}, **{**PAGES, "num_pages": 16}, **SAMPLING
    )
    return LlamaEngine(CFG, cfg, mesh=mesh, rules=GENERATOR_RULES)


def test_pool_split_by_slot_group_and_kv_head_equals_dense(dense, split, params):
    """Each device holds a quarter of every pool (half the pages, half the heads); slots
    map pages of their own group only, prompts are shared within a group and copied
    across; pages run short per group (waits, preemption). Same tokens as the dense
    engine; logprobs within 1e-5 (tensor=2 splits the heads' reductions; on data=2
    alone they were bit-identical when measured)."""
    import jax

    assert split.config.page_groups == 2 and split.config.paged_attention == "reference"
    for pool in split.init_decode_state().cache.kv_pages:
        assert tuple(pool.sharding.spec) == ("data", None, "tensor", None)
    requests = [request(p, 5 + 4 * p, 12 + 3 * p, s) for p in range(3) for s in range(2)]
    got, batcher = run(split, jax.tree.map(np.asarray, params), requests)
    want, _ = run(dense, params, requests)
    for key in want:
        np.testing.assert_array_equal(got[key].response_tokens, want[key].response_tokens)
        np.testing.assert_allclose(
            got[key].behaviour_logprobs, want[key].behaviour_logprobs, atol=1e-5
        )
    stats = batcher.stats
    assert stats.shared_pages > 0 and stats.copied_pages > 0
    assert stats.page_waits + stats.preempted > 0
    assert_pool_full(batcher)  # check() includes the group ranges


def test_pool_layout_puts_every_axis_not_splitting_heads_on_pages():
    """2 kv heads: over tensor=2 they split (pages over data); over tensor=4 they cannot,
    so tensor splits pages too (data x tensor = 8 slot groups)."""
    import jax

    from jaxflash.models.caches.pool_layout import pool_layout
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES

    two = pool_layout(CFG, make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2}), GENERATOR_RULES)
    assert (two.head_axes, two.group_axes, two.groups) == (("tensor",), ("data",), 2)
    four = pool_layout(CFG, make_mesh(jax.devices()[:8], {"data": 2, "tensor": 4}), GENERATOR_RULES)
    assert (four.head_axes, four.group_axes, four.groups) == ((), ("data", "tensor"), 8)
    assert tuple(four.pool_spec) == (("data", "tensor"), None, None, None)
    assert pool_layout(CFG, make_mesh(jax.devices()[:1], {}), GENERATOR_RULES) is None


def test_page_groups_take_pages_from_their_own_range_and_wait_apart():
    from jaxflash.generation.slot_pages import SlotPages

    pool = PagePool(num_pages=8, page_size=4, num_slots=4, pages_per_slot=5, num_groups=2)
    assert [pool.group_of(s) for s in range(4)] == [0, 0, 1, 1]
    assert pool.grow(0, 12) and pool.table[0, :3].tolist() == [0, 1, 2]
    assert pool.grow(2, 4) and pool.table[2, 0] == 4  # group 1: pages 4..7
    pool.register_prefix(0, "p", 2)
    assert pool.map_prefix(3, "p") == 0 and pool.copies("p", 1) == 2  # not across groups
    assert not pool.grow(1, 8) and pool.free_in(0) == 1 and pool.num_free == 4
    pool.check()
    pool.release(0)
    assert pool.free_in(0) == 4 and pool.shared_pages("p", 0) == 0
    with pytest.raises(ValueError, match="num_groups=3 must divide num_pages=8"):
        PagePool(num_pages=8, page_size=4, num_slots=6, pages_per_slot=5, num_groups=3)

    # Admission: a prompt of 9 + a block of 4 needs 4 pages; a group holds 4.
    cfg = EngineConfig(**{**BASE, "max_concurrent_decodes": 4}, **{**PAGES, "num_pages": 8},
                       page_groups=2, **SAMPLING)  # fmt: skip
    pages = SlotPages(cfg, decode_block=4)
    first = pages.admit([0, 1, 2, 3], request(60, 9, 8), 0, share=True)
    assert (first.slot, first.shared_pages, first.copied_pages) == (0, 0, 0)
    # The second sample prefers the group holding its prompt, where 0 pages are free:
    # it goes to group 1 and writes its own copy of the prompt's 2 full pages.
    second = pages.admit([1, 2, 3], request(60, 9, 8, 1), 0, share=True)
    assert (second.slot, second.copied_pages) == (2, 2)
    assert pages.admit([1, 3], request(61, 9, 8), 0, share=True) is None  # both groups full
    pages.release(0)
    assert pages.admit([0, 1, 3], request(61, 9, 8), 0, share=True).slot == 0
    pages.pool.check()


def test_refusals_name_the_setting(paged, params):
    check_request(paged, request(40, 16, 24))  # 39 positions = 10 of 12 pages: fits
    big = LlamaEngine(CFG, EngineConfig(**BASE, **{**PAGES, "num_pages": 6}, **SAMPLING))
    with pytest.raises(ValueError, match="needs up to 10 pages"):
        check_request(big, request(40, 16, 24))
    with pytest.raises(NotImplementedError, match="kv_cache='dense'"):
        EngineApi(paged)  # JetStream's Driver inserts into a dense cache only
    import jax

    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import GENERATOR_RULES

    mesh = make_mesh(jax.devices()[:2], {"data": 2})  # 3 slots cannot split into 2 groups
    with pytest.raises(ValueError, match=r"3 slots do not divide by 2 .*rollout.num_slots=3"):
        LlamaEngine(
            CFG, EngineConfig(**BASE, **PAGES, **SAMPLING), mesh=mesh, rules=GENERATOR_RULES
        )
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        EngineConfig(**BASE, kv_cache="pages")
    with pytest.raises(ConfigError, match="rollout.kv_cache must be dense | paged"):
        RolloutSpec(kv_cache="paged_")
    with pytest.raises(ConfigError, match="rollout.num_pages=8 is used only with"):
        RolloutSpec(num_pages=8)


def test_page_pool_shares_prompt_pages_and_counts_them_back():
    pool = PagePool(num_pages=8, page_size=4, num_slots=3, pages_per_slot=5)
    assert pool.grow(0, 10)  # 3 pages
    pool.register_prefix(0, "p", 2)  # the prompt's 2 full pages
    assert pool.map_prefix(1, "p") == 2 and pool.grow(1, 10)  # + 1 own page
    assert pool.in_use == 4 and pool.shared_pages("p") == 2
    assert not pool.grow(2, 20)  # 5 pages > 4 free: nothing mapped
    assert pool.held(2) == 0
    pool.release(0)  # the shared pages stay mapped by slot 1
    assert pool.in_use == 3 and pool.shared_pages("p") == 2
    pool.release(1)
    assert pool.in_use == 0 and pool.shared_pages("p") == 0
    pool.check()
