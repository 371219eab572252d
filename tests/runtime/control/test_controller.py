"""Adaptive controller: synthetic rate measurements move alpha, rho and the split as documented."""

import dataclasses
import json

import pytest

from jaxflash.replay.controller import (
    AdaptiveController,
    ControllerConfig,
    ControllerInputs,
    Decision,
    FixedSchedule,
    in_flight_for,
)

START = Decision(
    replay_ratio=0.25, async_ratio=1, requests_in_flight=0, learner_devices=4, generation_devices=4
)


def _ctl(**kw):
    cfg = ControllerConfig(batch_samples=32, max_async_ratio=3, **kw)
    return AdaptiveController(cfg, START)


def _feed(ctl, n, *, start=0, **measured):
    kw = dict(gen_rate=10.0, train_rate=10.0, queue_depth=0, staleness_mean=0.5, ess=0.9) | measured
    return [ctl.update(ControllerInputs(step=start + i, **kw)) for i in range(n)]


def test_generation_bound_raises_rho_alpha_and_generation_share():
    ctl = _ctl(move_patience=3)
    out = _feed(ctl, 8, gen_rate=2.0, train_rate=10.0)  # supply 2 / 7.5 << 1, empty queue
    rhos = [d.replay_ratio for d in out]
    alphas = [d.async_ratio for d in out]
    assert rhos == sorted(rhos) and rhos[-1] == 0.75 and rhos[0] == 0.375
    assert alphas == [2, 3, 3, 3, 3, 3, 3, 3]
    gens = [d.generation_devices for d in out]
    assert gens == [4, 4, 5, 5, 5, 6, 6, 6]  # a move after 3 bound steps, then 3 apart
    assert all(d.learner_devices + d.generation_devices == 8 for d in out)
    assert all(
        d.requests_in_flight == in_flight_for(d.async_ratio, d.replay_ratio, 32) for d in out
    )
    m = ctl.metrics()
    assert m["ctl_generation_bound"] is True and m["ctl_in_gen_rate"] == 2.0
    # Rates measured before a move describe the old layout: the EMA restarts.
    moved = _ctl(move_patience=3)
    _feed(moved, 3, gen_rate=2.0)  # the third update moves a device
    _feed(moved, 1, start=3, gen_rate=9.0)
    # rho in force during that update: 0.25 + 3 * 0.125; blended rates would give 5.5 / 3.75.
    assert moved.metrics()["ctl_supply_ratio"] == pytest.approx(9.0 / (10.0 * (1 - 0.625)))
    assert m["ctl_replay_ratio"] == 0.75 and m["ctl_generation_devices"] == 6
    json.dumps(m)


def test_training_bound_lowers_rho_alpha_and_moves_devices_to_the_learner():
    ctl = _ctl(move_patience=2)
    out = _feed(ctl, 6, gen_rate=50.0, train_rate=10.0, queue_depth=200)
    assert [d.replay_ratio for d in out] == [0.125, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [d.async_ratio for d in out] == [0, 0, 0, 0, 0, 0]
    assert [d.learner_devices for d in out] == [4, 5, 5, 6, 6, 7]
    assert out[-1].generation_devices == 1  # the floor
    more = _feed(ctl, 4, start=6, gen_rate=50.0, train_rate=10.0, queue_depth=200)
    assert more[-1].generation_devices == 1  # never below min_generation_devices
    # A deep queue alone (rates balanced) also means training-bound.
    ctl2 = _ctl()
    assert _feed(ctl2, 1, queue_depth=200)[0].replay_ratio == 0.125


def test_low_ess_and_high_staleness_pull_back():
    ctl = _ctl()
    d = _feed(ctl, 1, gen_rate=2.0, ess=0.2)[0]  # generation-bound, but replay too off-policy
    assert (d.replay_ratio, d.async_ratio) == (0.125, 0)
    ctl = _ctl(staleness_target=1.0)
    d = _feed(ctl, 1, gen_rate=2.0, staleness_mean=2.5)[0]
    assert d.replay_ratio == 0.375 and d.async_ratio == 0  # rho still helps; alpha may not grow


def test_balanced_holds_and_alternating_bounds_never_move_devices():
    ctl = _ctl(move_patience=2)
    out = _feed(ctl, 5, gen_rate=7.5, train_rate=10.0)  # supply exactly 1
    assert all(d == out[0] for d in out) and out[0].replay_ratio == 0.25
    ctl = _ctl(move_patience=2, smoothing=1.0)  # no EMA: the bound really alternates
    for i in range(10):
        gen = 1.0 if i % 2 == 0 else 80.0
        d = ctl.update(
            ControllerInputs(
                step=i, gen_rate=gen, train_rate=10.0, queue_depth=0, staleness_mean=0.0
            )
        )
        assert ctl.metrics()["ctl_generation_bound"] == (i % 2 == 0)
        assert (d.learner_devices, d.generation_devices) == (4, 4)


def test_state_dict_resumes_the_same_decisions():
    rows = [(2, 0, 0.9), (3, 0, 0.8), (40, 90, None), (1, 0, 0.3), (2, 0, 0.9)] * 3
    seq = [
        dict(gen_rate=g, train_rate=10.0, queue_depth=q, staleness_mean=1.0, ess=e)
        for g, q, e in rows
    ]
    full_ctl = _ctl(move_patience=2)
    full = [full_ctl.update(ControllerInputs(step=i, **x)) for i, x in enumerate(seq)]
    assert len({(d.learner_devices, d.replay_ratio, d.async_ratio) for d in full}) > 3
    for cut in range(1, len(seq)):  # every cut: mid-streak, right after a move, ...
        a = _ctl(move_patience=2)
        head = [a.update(ControllerInputs(step=i, **x)) for i, x in enumerate(seq[:cut])]
        b = _ctl(move_patience=2)
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        tail = [b.update(ControllerInputs(step=cut + i, **x)) for i, x in enumerate(seq[cut:])]
        assert head + tail == full, cut


def test_fixed_schedule_has_the_same_interface():
    later = Decision(
        replay_ratio=0.5,
        async_ratio=2,
        requests_in_flight=96,
        learner_devices=4,
        generation_devices=4,
    )
    sched = FixedSchedule([(0, START), (3, later)])
    got = _feed(sched, 5, gen_rate=1.0)
    assert got == [START, START, START, later, later]
    assert sched.metrics()["ctl_async_ratio"] == 2 and sched.metrics()["ctl_in_step"] == 4
    with pytest.raises(ValueError, match="start at 0"):
        FixedSchedule([(1, START)])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="train_rate"):
        ControllerInputs(step=0, gen_rate=1.0, train_rate=0.0, queue_depth=0, staleness_mean=0.0)
    with pytest.raises(ValueError, match="max_replay_ratio"):
        ControllerConfig(batch_samples=8, max_async_ratio=1, max_replay_ratio=1.0)
    with pytest.raises(ValueError, match="async_ratio 1 outside"):
        AdaptiveController(ControllerConfig(batch_samples=8, max_async_ratio=0), START)


def test_in_flight_counts_whole_groups():
    # 12 samples = 3 groups of 4 at rho 0.5: round(1.5) = 2 fresh groups = 8 samples,
    # alpha = 2 -> 3 * 8 = 24 requests; per sample (G = 1) it would be 3 * 6 = 18.
    assert in_flight_for(2, 0.5, 12, 4) == 24
    assert in_flight_for(2, 0.5, 12) == 18
    with pytest.raises(ValueError, match="group_size"):
        ControllerConfig(batch_samples=12, max_async_ratio=1, group_size=5)


def test_an_unapplied_move_is_logged_as_proposed_and_keeps_the_rates():
    ctl = _ctl(move_patience=1)
    d = _feed(ctl, 1, gen_rate=2.0)[0]  # generation-bound: proposes a device to generation
    assert (d.learner_devices, d.generation_devices) == (3, 5)
    kept = dataclasses.replace(d, learner_devices=4, generation_devices=4)
    ctl.applied(kept)  # the runtime could not move it
    m = ctl.metrics()
    assert (m["ctl_generation_devices"], m["ctl_proposed_generation_devices"]) == (4, 5)
    assert (m["ctl_learner_devices"], m["ctl_proposed_learner_devices"]) == (4, 3)
    assert ctl.decision == kept and ctl.state_dict()["decision"]["generation_devices"] == 4
    # Nothing moved, so the rate averages go on: gen 0.5 * 9 + 0.5 * 2 = 5.5 at rho 0.375
    # (an applied move restarts them: supply would be 9 / 6.25).
    _feed(ctl, 1, start=1, gen_rate=9.0)
    assert ctl.metrics()["ctl_supply_ratio"] == pytest.approx(5.5 / (10.0 * (1 - 0.375)))
    with pytest.raises(ValueError, match="changes more than the split"):
        ctl.applied(dataclasses.replace(ctl.decision, replay_ratio=0.0))
