"""The elastic resource pool: servers retired and added at a step boundary, config refusals.

* Scheduler level (thread-free, virtual clock): retiring a server re-queues exactly
  the requests it still held (counted ``samples_requeued``), takes what it finished
  before stopping as generated (never twice), never calls it again; a server added
  later takes requests; the prompt books add up and nothing is trained twice.
* Config: every combination the live pool cannot carry out is refused before
  anything loads, naming the fields.
* The live loop on 8 fake devices (tests/runtime/control/test_elastic_run.py).
"""

import collections

import pytest

from jaxflash.replay.controller import Decision
from jaxflash.runtime.config.elastic_spec import check_elastic, learner_axes
from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec, check_replay_combination
from jaxflash.runtime.config.specs import ConfigError, MeshSpec
from jaxflash.runtime.console import step_line
from jaxflash.runtime.control.controller_setup import fixed_decisions
from jaxflash.runtime.rollout.server_pool import RetiredServer, ServersChanged
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.types import PromptOutcome
from tests.fake_servers import VirtualServer, _virtual_scheduler, drive


def _books_add_up(m):
    closed = sum(m.count(o) for o in PromptOutcome)
    return m.taken == closed + len(m.open_ids)


def test_retire_requeues_what_the_server_held_and_add_takes_requests():
    sched, clock, servers, ledger = _virtual_scheduler(
        [{"latency_s": 0.3}, {"latency_s": 0.7}], B=2, G=2, alpha=1
    )
    trained = collections.Counter()
    batch = drive(sched, clock, servers, 0)
    ThreadFree(sched).mark_trained(batch.groups)
    trained.update((s.prompt_id, s.sample_index) for g in batch.groups for s in g.samples)
    sched.servers_changed(ServersChanged(version=1, weights=[None, None]))
    ThreadFree(sched).poll()
    table = ThreadFree(sched).parts.dispatcher.router.table
    held = {e.key for e in table.by_server(1)}
    assert len(held) >= 2, "server 1 holds requests at the boundary (alpha = 1)"
    # Server 1 finishes one of them before it stops: that one is generated, not re-queued;
    # the others are still running when it stops.
    first = min(held)
    when, request, version = servers[1].queue[first]
    for k in held - {first}:
        t, req, ver = servers[1].queue[k]
        servers[1].queue[k] = (t + 100.0, req, ver)
    clock.advance_to(when + 1e-6)
    queued0 = len(servers[0].queue)
    servers[0].deliver_due()  # (the clock moved for every server)
    delivered0 = queued0 - len(servers[0].queue)
    servers[1].deliver_due()
    finished_early = {k for k in held if k not in servers[1].queue}
    assert finished_early == {first}
    generated = sched.watch.counters["samples_generated"]
    submitted_before = list(servers[1].submitted)

    requeued = sched.servers_changed(ServersChanged(retired=[1])).requeued

    assert requeued == len(held) - 1 == sched.watch.counters["samples_requeued"] > 0
    assert sched.watch.counters["samples_generated"] == generated + len(finished_early) + delivered0
    assert {e.key for e in table.by_server(0)} >= held - finished_early
    assert not table.by_server(1)
    assert (
        isinstance(ThreadFree(sched).parts.pool.servers[1], RetiredServer)
        and 1 not in ThreadFree(sched).parts.pool.alive
    )
    assert ThreadFree(sched).parts.pool.stats()[1] == {}
    # A new server at the published version takes requests; server 1 never again.
    new = VirtualServer(ThreadFree(sched).parts.dispatcher.inbox.generated, clock, latency_s=0.2)
    new.version = 1
    assert sched.servers_changed(ServersChanged(added=[new])).added == (2,)
    live = [servers[0], new]
    for v in range(1, 5):
        batch = drive(sched, clock, live, v)
        ThreadFree(sched).mark_trained(batch.groups)
        trained.update((s.prompt_id, s.sample_index) for g in batch.groups for s in g.samples)
        sched.servers_changed(ServersChanged(version=v + 1, weights=[None, None, None]))
    assert servers[1].submitted == submitted_before
    assert new.submitted, "the added server took requests"
    assert max(trained.values()) == 1  # nothing trained twice
    assert ledger.count(PromptOutcome.TRAINED) == 5 * 2
    assert _books_add_up(ledger)
    ledger.check()


def test_the_last_server_cannot_be_retired():
    sched, *_ = _virtual_scheduler([{"latency_s": 0.3}], B=1, G=1)
    with pytest.raises(ValueError, match="last one alive"):
        sched.servers_changed(ServersChanged(retired=[0]))


# -- config ---------------------------------------------------------------------------------


def _mesh(**kw):
    base = dict(
        num_cpu_devices=8, learner={"fsdp": 6}, generation={"tensor": 1},
        colocated=False, num_generation_slices=2,
    )  # fmt: skip
    return MeshSpec(**{**base, **kw})


FIXED = dict(kind="fixed", elastic=True)


@pytest.mark.parametrize(
    "controller, mesh, match",
    [
        (dict(kind="none", elastic=True), {}, "controller.elastic=True needs controller.kind"),
        (dict(kind="fixed", device_schedule="0:6,2:7"), {}, "controller.device_schedule"),
        (
            {**FIXED, "device_schedule": "0:6,2:7"},
            dict(colocated=True, learner={"fsdp": 8}, num_generation_slices=1),
            "mesh.colocated=False",
        ),  # fmt: skip
        (
            {**FIXED, "device_schedule": "0:6,2:7"},
            dict(generation_processes=True),
            "mesh.generation_processes",
        ),  # fmt: skip
        ({**FIXED, "device_schedule": "0:5,2:6"}, {}, "starts at 5 learner devices"),
        ({**FIXED, "device_schedule": "0:6,2:8"}, {}, ">= 1 generation slice"),
        (
            {**FIXED, "device_schedule": "0:6,2:7"},
            dict(learner={"fsdp": 3, "tensor": 2}),
            "do not form a learner mesh",
        ),  # fmt: skip
        (
            {**FIXED, "device_schedule": "0:6,2:7"},
            dict(generation={"tensor": 2}, num_generation_slices=1),
            "whole number of generation slices",
        ),  # fmt: skip
        (
            dict(kind="adaptive", elastic=True),
            dict(learner={"fsdp": 3, "tensor": 2}),
            "multiple of\nmesh.learner's data x tensor|multiple of mesh.learner's data x tensor",
        ),
        ({**FIXED}, {}, "needs controller.replay_schedule or"),
    ],
)
def test_elastic_configs_that_cannot_work_are_refused(controller, mesh, match):
    with pytest.raises(ConfigError, match=match):
        check_elastic(ControllerSpec(**controller), _mesh(**mesh))


def test_a_fixed_device_schedule_needs_no_replay_but_refuses_ignored_replay_fields():
    spec = ControllerSpec(**FIXED, device_schedule="0:6,2:7,4:6")
    check_elastic(spec, _mesh())
    check_replay_combination(ReplaySpec(), spec, async_ratio=1)  # rho 0 all along: fine
    with pytest.raises(ConfigError, match="replay.max_reuse"):
        check_replay_combination(ReplaySpec(max_reuse=3), spec, async_ratio=1)


def test_fixed_decisions_merge_both_schedules():
    initial = Decision(
        replay_ratio=0.5, async_ratio=1, requests_in_flight=0, learner_devices=6,
        generation_devices=2,
    )  # fmt: skip
    out = fixed_decisions(
        [(0, 0.5), (3, 0.25)], [(0, 6), (2, 7), (4, 6)], initial, batch_samples=8, group_size=2
    )
    assert [(s, d.replay_ratio, d.learner_devices, d.generation_devices) for s, d in out] == [
        (0, 0.5, 6, 2), (2, 0.5, 7, 1), (3, 0.25, 7, 1), (4, 0.25, 6, 2),
    ]  # fmt: skip
    # requests in flight follow rho: (alpha + 1) * fresh groups * G
    assert [d.requests_in_flight for _, d in out] == [8, 8, 12, 12]


def test_learner_axes_grow_along_fsdp():
    assert learner_axes({"fsdp": 3, "tensor": 2}, 8) == {"data": 1, "fsdp": 4, "tensor": 2}
    with pytest.raises(ValueError, match="data x tensor = 2"):
        learner_axes({"fsdp": 3, "tensor": 2}, 7)


def test_the_step_line_says_when_devices_moved():
    row = {"learner_devices": 7, "generation_slices": 1, "elastic_to_learner": 1}
    assert step_line(2, 6, "1 s", row).endswith(
        "moved: learner 7 devices, 1 generation slices from the next step"
    )
    quiet = {"learner_devices": 7, "generation_slices": 1, "elastic_to_learner": 0}
    assert "moved" not in step_line(3, 6, "2 s", quiet)


def test_adaptive_role_split_goes_to_move_and_the_controller_learns_the_split_in_force():
    """The adaptive controller's proposals (test_replay_cycle's gen-bound then
    train-bound rows) are handed to ``move``; what it returns is the split in force,
    logged as ctl_*_devices and reported to the controller through ``applied``."""
    from tests.replay.test_replay_cycle import _after, _control, _row

    spec = ControllerSpec(kind="adaptive", move_patience=2)
    replay = ReplaySpec(ratio=0.25, max_age=2)
    floors = {"device_quantum": 1, "min_learner_devices": 1, "min_generation_devices": 1}
    rows = [_row(s, generated=100 + 2 * s, step_s=1.0, train_s=0.1, pending=0) for s in (1, 2, 3)]
    rows += [
        _row(s, generated=106 + 200 * (s - 3), step_s=1.0, train_s=1.0, pending=8, ess=0.9)
        for s in (4, 5, 6)
    ]

    def run(refuse: bool):
        control = _control(
            replay=replay, controller=spec, samples_generated=100, device_floors=floors
        )
        asked = []

        def move(n):
            asked.append(n)
            return control.decision.learner_devices if refuse else n

        logged = [_after(control, r, s + 1, move=move) for s, r in enumerate(rows)]
        return asked, logged

    asked, logged = run(refuse=False)
    # Gen-bound for 2 steps: one device to generation (learner 5); then, 2 train-bound
    # steps after it, back to the learner (6): the split in force follows.
    assert asked == [5, 6]
    assert [m["ctl_learner_devices"] for m in logged] == [6, 5, 5, 5, 6, 6]
    assert [m["ctl_generation_devices"] for m in logged] == [2, 3, 3, 3, 2, 2]
    assert all(
        m["ctl_proposed_learner_devices"] == m["ctl_learner_devices"] for m in logged
    )  # every proposal applied
    # Refused moves: the split stays, the proposal is logged, the controller is told.
    asked, logged = run(refuse=True)
    assert asked[0] == 5 and all(m["ctl_learner_devices"] == 6 for m in logged)
    assert logged[1]["ctl_proposed_learner_devices"] == 5
