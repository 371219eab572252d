"""The controller's decision is put in force at the next step: StepControl.after_step's plan
-> RolloutScheduler.reconfigure, as runtime.loop does after every step. Synthetic rate
measurements, the real scheduler under a VirtualClock (tests/fake_servers.py)."""

import dataclasses

import numpy as np
import pytest

from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec
from jaxflash.runtime.control.replay_cycle import ReplayCycle
from jaxflash.runtime.control.step_control import StepControl, StepReport
from jaxflash.runtime.rollout.server_pool import ServersChanged
from jaxflash.runtime.rollout.thread_free import ThreadFree
from tests.fake_servers import _virtual_scheduler, drive

B, G = 8, 2  # rollout.prompts_per_step, group_size


def _measured(control, v, generated, *, gen_per_s, train_per_s, queue):
    """after_step() with one second of step: gen_per_s fresh samples generated, the
    learner training train_per_s samples per second, ``queue`` samples waiting."""
    return control.after_step(
        StepReport(
            next_version=v,
            samples_generated=generated + gen_per_s,
            step_s=1.0,
            trained_samples=16,
            train_s=16 / train_per_s,
            queue_samples=queue,
            staleness_mean=0.5,
            replay_ess=0.9,
        )
    )


def _step(sched, clock, servers, v):
    batch = drive(sched, clock, servers, v)
    ThreadFree(sched).mark_trained(batch.groups)
    sched.servers_changed(ServersChanged(version=v + 1, weights=[None] * len(servers)))
    ThreadFree(sched).poll()  # admits up to the capacity in force
    return batch


def test_the_next_step_runs_under_the_controllers_decision():
    spec = ControllerSpec(kind="adaptive", move_patience=1, smoothing=1.0)  # no EMA
    replay = ReplaySpec(ratio=0.5, max_age=3, drop_uniform_groups=False)
    cycle = ReplayCycle(replay, spec, batch_prompts=B, group_size=G, seed=0)
    control = StepControl(
        replay,
        spec,
        batch_prompts=B,
        group_size=G,
        async_ratio=2,  # the user's maximum alpha
        learner_devices=6,
        generation_devices=2,
    )
    # rho 0.5: 4 fresh groups of the 8; alpha 2: (2 + 1) * 4 prompts in flight.
    first = dataclasses.asdict(control.plan().scheduler)
    assert first == {"batch_prompts": 4, "async_ratio": 2, "prompts_in_flight": 12}
    # Rows of the compiled step: at every reachable rho (0 .. 0.75 in steps of 0.125)
    # fresh + replayed = round((1 - rho) 8) * 2 + the replayed share = 16.
    assert cycle.rows == B * G
    sched, clock, servers, _ = _virtual_scheduler(
        [{"latency_s": 0.3}, {"latency_s": 0.5}],
        B=first["batch_prompts"],
        G=G,
        alpha=first["async_ratio"],
    )
    assert len(_step(sched, clock, servers, 0).groups) == 4
    assert sched.watch.stats()["prompts_active"] == 12  # the admission capacity is full

    # Training-bound (100 samples/s generated, 16/s trained, a deep queue): rho and alpha
    # go down -> 5 fresh groups (round(0.625 * 8)), (1 + 1) * 5 = 10 prompts in flight.
    plan = _measured(control, 1, 0, gen_per_s=100, train_per_s=16, queue=200)
    m = plan.metrics
    assert (m["ctl_replay_ratio"], m["ctl_async_ratio"]) == (0.375, 1)
    assert m["ctl_requests_in_flight"] == 20
    sched.reconfigure(**dataclasses.asdict(plan.scheduler))
    stats = sched.watch.stats()
    assert (stats["sched_batch_prompts"], stats["sched_async_ratio"]) == (5, 1)
    assert stats["sched_prompts_capacity"] == 10
    batch = _step(sched, clock, servers, 1)
    assert len(batch.groups) == 5  # the next batch has the new fresh share
    assert sched.watch.stats()["prompts_active"] <= 10  # 12 admitted before: none admitted above
    # ... and the replay cycle draws at the new rho: 10 fresh -> round(0.375 * 10 / 0.625).
    mixed = cycle.mix(
        [s for g in batch.groups for s in g.samples],
        np.zeros(10, np.float32),
        learner_version=1,
        replay_ratio=control.replay_ratio,
        pad_id=0,
        max_len=64,
    )
    assert mixed.metrics["cycle_replay_ratio_target"] == 0.375
    assert mixed.metrics["cycle_replay_requested"] == 6

    # Generation-bound (2 samples/s for a learner doing 160/s, nothing queued): rho and
    # alpha go up again, and a device is proposed for generation -- not moved.
    plan = _measured(control, 2, 100, gen_per_s=2, train_per_s=160, queue=0)
    m = plan.metrics
    assert (m["ctl_replay_ratio"], m["ctl_async_ratio"]) == (0.5, 2)
    assert (m["ctl_proposed_generation_devices"], m["ctl_generation_devices"]) == (3, 2)
    sched.reconfigure(**dataclasses.asdict(plan.scheduler))
    assert len(_step(sched, clock, servers, 2).groups) == 4
    assert sched.watch.stats()["sched_prompts_capacity"] == 12
    assert sched.watch.stats()["prompts_active"] == 12  # raised capacity is used at once


def test_reconfigure_refuses_a_capacity_below_one_batch_and_mid_batch_calls():
    sched, clock, servers, _ = _virtual_scheduler([{"latency_s": 0.3}], B=2, G=G)
    with pytest.raises(ValueError, match="prompts_in_flight >= batch_prompts"):
        sched.reconfigure(batch_prompts=3, async_ratio=0, prompts_in_flight=2)
    ThreadFree(sched).poll()
    assert ThreadFree(sched).try_batch(0) is None  # a batch is being assembled
    with pytest.raises(RuntimeError, match="between batches"):
        sched.reconfigure(batch_prompts=2, async_ratio=0, prompts_in_flight=2)
