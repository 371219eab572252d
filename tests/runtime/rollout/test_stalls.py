"""Generation stalls (``rollout.stalls``): admission held by the capacity or the pacer,
timed, with the decode slots left idle meanwhile."""

import pytest

from jaxflash.runtime.rollout.server_pool import ServersChanged
from jaxflash.runtime.rollout.stalls import AdmissionStalls
from jaxflash.runtime.rollout.thread_free import ThreadFree
from tests.fake_servers import _virtual_scheduler, drive


def test_stalls_time_each_hold_and_the_slots_idle_meanwhile():
    """By hand, K = 4 slots a server: every figure is a sum of exact binary fractions."""
    m = AdmissionStalls(slots_per_server=4)
    m.observe(0.0, None, servers=2, outstanding=8)  # 8 slots, all busy, admitting
    m.observe(1.0, "capacity", servers=2, outstanding=6)  # held: 2 slots idle
    m.observe(1.5, "capacity", servers=2, outstanding=3)  # the same hold: 5 idle
    m.observe(2.0, "pacer", servers=1, outstanding=1)  # one server left: 3 idle
    m.observe(2.25, None, servers=1, outstanding=4)
    m.observe(3.0, "pacer", servers=1, outstanding=4)  # a second pacer hold, 0 idle
    m.observe(3.5, None, servers=1, outstanding=0)
    s = m.stats()
    assert (s["admission_holds_capacity"], s["admission_holds_pacer"]) == (1, 2)
    assert (s["admission_held_capacity_s"], s["admission_held_pacer_s"]) == (1.0, 0.75)
    assert s["slots_idle_held_capacity_s"] == 0.5 * 2 + 0.5 * 5
    assert s["slots_idle_held_pacer_s"] == 0.25 * 3
    slot_s = 1.0 * 8 + 1.0 * 8 + 0.25 * 4 + 0.75 * 4 + 0.5 * 4
    assert s["slots_idle_held_frac"] == (3.5 + 0.75) / slot_s
    assert "slots_idle_held_frac" not in AdmissionStalls().stats()  # slots unknown
    with pytest.raises(ValueError, match="reason must be one of"):
        m.observe(4.0, "tired", servers=1, outstanding=0)


@pytest.mark.parametrize("policy", ["pace", "drop"])
def test_pacer_refusals_stall_generation_under_pace_only(policy):
    """α 2 -> 0 at a step boundary with the capacity kept at 6 prompts: under pace the
    pacer refuses the prompts that could not be trained by their deadline while slots
    are free (a stall, counted and timed); under drop nothing but the capacity holds
    admission, and the pacer's figures stay 0."""
    sched, clock, servers, ledger = _virtual_scheduler(
        [{"latency_s": 1.0}], B=2, G=2, alpha=2, stale_policy=policy, slots_per_server=8
    )
    for v in range(4):
        batch = drive(sched, clock, servers, v)
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(ServersChanged(version=v + 1, weights=[None]))
        if v == 0:
            sched.reconfigure(batch_prompts=2, async_ratio=0, prompts_in_flight=6)
    s = sched.watch.stats()
    if policy == "pace":
        assert s["admission_holds_pacer"] > 0 and s["admission_held_pacer_s"] > 0
        assert s["slots_idle_held_pacer_s"] > 0
    else:
        assert s["admission_holds_pacer"] == 0 and s["admission_held_pacer_s"] == 0.0
        assert s["slots_idle_held_pacer_s"] == 0.0
    assert s["admission_holds_capacity"] > 0  # the (α+1)·B bound holds it under both
    assert 0.0 < s["slots_idle_held_frac"] <= 1.0
    ledger.check()
