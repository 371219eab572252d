"""stale_policy="pace": nothing discarded for staleness, the bound held, the overshoot counted.

The ``Pacer``'s decisions by hand; then the real scheduler in the simulator on a
long-tailed workload (where "drop" does discard, and so trains shorter samples), and
under fake servers with α lowered mid-run (the one way the bound is exceeded: trained
and counted, never dropped).
"""

import pytest

from jaxflash.runtime.rollout.pacing import Pacer
from jaxflash.runtime.rollout.server_pool import ServersChanged
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.runtime.simulate import (
    CostModel,
    DecodeCost,
    LearnerCost,
    LogNormal,
    PrefillCost,
    SimConfig,
    SimWorkload,
    SyncCost,
    simulate,
)
from tests.fake_servers import _virtual_scheduler, drive


def test_pacer_trains_earliest_deadline_first_and_holds_a_slot_for_a_due_group():
    """B = 1, α = 2: three prompts admitted at version 0 are all due at version 2. A
    fourth admitted at version 1 (due at 3) must not take batch 1's slot while one of
    the three is still being generated -- they could not all make batch 2."""
    p = Pacer(batch_prompts=1, async_ratio=2, version=0)
    for pid in (0, 1, 2):
        assert p.admits()
        p.admitted(pid)
    assert not p.admits()  # a fourth due at 2 would need a 4th slot in batches 0..2
    p.begin(0)
    assert p.accept(2, 0)  # any of the three: all due at 2
    p.batch_done(0)
    p.published(1)
    assert p.admits()  # due at 3: batches 1..3 hold 0, 1 and it
    p.admitted(3)
    p.begin(1)
    assert not p.accept(3, 1)  # 0 and 1 (due at 2) need batches 1 and 2
    assert p.accept(0, 0)
    p.batch_done(1)
    p.published(2)
    p.begin(2)
    assert not p.accept(3, 1)  # 1 is due now: batch 2 waits for it
    p.closed(1)  # ... unless it leaves untrained (filtered, failed)
    assert p.accept(3, 1)
    assert p.open_prompts() == 0
    with pytest.raises(ValueError, match="batch_prompts >= 1 and async_ratio >= 0"):
        Pacer(batch_prompts=0, async_ratio=1, version=0)


def _costs():
    return CostModel(
        name="test",
        decode=DecodeCost(base_s=0.01, per_active_slot_s=0.001, per_slot_s=0.0005),
        prefill=PrefillCost(per_prompt_s=0.02, per_prompt_token_s=1e-4, per_sample_s=0.002),
        learner=LearnerCost(step_s=0.2, per_token_s=2e-4, padding="bucket"),
        sync=SyncCost(weight_sync_s=0.1),
    )


def _long_tail():
    return SimWorkload(
        lengths=LogNormal(median=60, sigma=1.0),
        max_tokens=1024,
        prompt_tokens=(20,),
        prompt_sigma=0.6,
        pass_length_power=1.0,
        seed=0,
    )


@pytest.mark.parametrize("alpha", [1, 2])
def test_pace_discards_nothing_holds_the_bound_and_trains_the_long_tail(alpha):
    kw = dict(
        placement="disjoint",
        async_ratio=alpha,
        servers=2,
        slots_per_server=16,
        batch_prompts=8,
        group_size=4,
        steps=10,
    )
    paced = simulate(SimConfig(stale_policy="pace", **kw), _costs(), _long_tail())
    dropped = simulate(SimConfig(stale_policy="drop", **kw), _costs(), _long_tail())

    assert not paced.outcomes["stale"] and dropped.outcomes["stale"]  # drop does discard
    assert not any(k.startswith("samples_dropped") for k in paced.counters)
    assert paced.counters.get("samples_aborted_surplus", 0) == 0
    assert paced.counters.get("samples_trained_overshoot", 0) == 0
    assert paced.staleness_max <= alpha and paced.trained_samples > 0
    assert len(paced.lengths_trained) == sum(paced.outcomes["trained"].values()) * 4
    # Every prompt admitted ends trained or is still open: nothing else happened to it.
    admitted = len(paced.lengths_started) // 4
    open_now = admitted - sum(paced.outcomes["trained"].values())
    assert open_now >= 0 and open_now <= (alpha + 1) * 8
    # drop trains the short ones: its mean trained length is below paced's.
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(dropped.lengths_trained) < mean(paced.lengths_trained)
    assert 0.0 <= paced.admission_idle <= 1.0


def test_lowering_alpha_mid_run_overshoots_counted_never_dropped():
    """α 2 -> 0 at a step boundary: groups admitted under α = 2 are trained at
    staleness 1 > 0, counted as overshoot; none is closed stale; the ledger adds up."""
    sched, clock, servers, ledger = _virtual_scheduler(
        [{"latency_s": 1.0}], B=2, G=2, alpha=2, stale_policy="pace"
    )
    staleness = []
    for v in range(4):
        batch = drive(sched, clock, servers, v)
        staleness += [v - g.start_version for g in batch.groups]
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(ServersChanged(version=v + 1, weights=[None]))
        if v == 0:
            sched.reconfigure(batch_prompts=2, async_ratio=0, prompts_in_flight=2)
    counters = sched.watch.counters
    stats = sched.watch.stats()
    overshot = sum(s > 0 for s in staleness)
    assert overshot > 0 and counters["samples_trained_overshoot"] == 2 * overshot
    assert stats["buffer_staleness_overshoot"] == overshot
    assert ledger.count("stale") == 0 and not any("dropped" in k for k in counters)
    ledger.check()
    assert ledger.count("trained") == 8
