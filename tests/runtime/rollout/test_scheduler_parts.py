"""The scheduler's thread-free parts, and the scheduler driven under a VirtualClock.

OutstandingTable, Admission, ServerPool and the clocks each on their own; then the
whole RolloutScheduler without its pump thread (``poll`` / ``try_batch`` /
``publish``), against fake servers that finish samples at virtual times: deadlines
fire at the virtual time they are due and nothing sleeps for real.
"""

import collections
import concurrent.futures
import logging
import threading
import time

import pytest

from jaxflash.data.prompts import PromptFailure
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.rewards.base import RewardResult
from jaxflash.runtime.clock import RealClock, VirtualClock
from jaxflash.runtime.rollout.admission import Admission
from jaxflash.runtime.rollout.dispatch import prompt_dispatch
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.outstanding import Outstanding, OutstandingTable
from jaxflash.runtime.rollout.reward_pool import Scored
from jaxflash.runtime.rollout.scheduler import Inbox
from jaxflash.runtime.rollout.server_pool import ServerPool, ServersChanged, Submitted
from jaxflash.runtime.rollout.settings import RolloutSettings
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.types import (
    FailureReason,
    PromptOutcome,
)
from tests.fake_servers import (
    SAMPLING,
    InstantRewards,
    Tok,
    VirtualServer,
    _prompt,
    _request,
    _rollout,
    _Server,
    _Source,
    _virtual_scheduler,
    drive,
)

# -- OutstandingTable -----------------------------------------------------------------


def test_outstanding_table_rows_load_and_lateness():
    t = OutstandingTable()
    t.add(Outstanding(request=_request(1, 0), server=0, dispatched_at=10.0, version=3))
    t.add(Outstanding(request=_request(1, 1), server=1, dispatched_at=11.0, version=3))
    t.add(Outstanding(request=_request(2, 0), server=1, dispatched_at=9.0, version=4, attempts=1))
    with pytest.raises(ValueError, match=r"\(1, 0\) is already outstanding"):
        t.add(Outstanding(request=_request(1, 0), server=1, dispatched_at=12.0, version=4))
    assert len(t) == 3 and (1, 1) in t and (3, 0) not in t
    assert [e.key for e in t.by_prompt(1)] == [(1, 0), (1, 1)]
    assert [e.key for e in t.by_server(1)] == [(1, 1), (2, 0)]
    assert t.prompts() == [1, 2]
    assert t.load() == collections.Counter({1: 2, 0: 1})
    # Late: strictly more than deadline_s since dispatch, oldest first.
    assert t.late(now=14.0, deadline_s=5.0) == []
    assert t.late(now=15.5, deadline_s=5.0) == [(2, 0), (1, 0)]
    assert t.next_deadline(5.0) == 14.0
    assert t.pop((2, 0)).attempts == 1 and t.pop((2, 0)) is None
    assert t.get((1, 0)).server == 0
    assert OutstandingTable().next_deadline(5.0) is None


def test_start_estimate_counts_finished_samples_and_non_restarting_servers():
    t = OutstandingTable()
    t.add(Outstanding(request=_request(1, 0), server=0, dispatched_at=0.0, version=5))
    t.add(Outstanding(request=_request(1, 1), server=1, dispatched_at=0.0, version=2))
    restarts = {0: False, 1: True}.get  # server 1 restarts in-flight samples at an update
    assert t.start_estimate(1, restarts) == 5.0  # server 1's version bounds nothing
    t.note_finished(1, 4)
    t.note_finished(1, 6)
    assert t.start_estimate(1, restarts) == 4.0  # the oldest finished sample
    assert t.start_estimate(1, lambda i: False) == 2.0
    t.forget(1)
    assert t.start_estimate(1, restarts) == 5.0
    assert t.start_estimate(9, restarts) == float("inf")


# -- Admission ----------------------------------------------------------------------------


def _admit_all(a):
    out = []
    while (nxt := a.next()) is not None:
        out.append((nxt[0].prompt_id, nxt[1]))
    return out


def test_admission_capacity_resume_and_release():
    resumed = _prompt(40)
    a = Admission(_Source(), capacity=3, resume=[resumed])
    # Resumed prompts first (already in the ledger: from_source False), then the source.
    assert _admit_all(a) == [(40, False), (0, True), (1, True)]
    assert len(a) == 3 and not a.can_admit()
    a.release_at_publish(0)
    assert a.next() is None and a.is_active(0)  # only at the next release
    a.free(1)  # capacity back now
    assert _admit_all(a) == [(2, True)]
    assert a.release() == [] and not a.is_active(0)
    assert _admit_all(a) == [(3, True)]
    a.regenerate_at_release(40)
    a.regenerate_at_release(3)
    a.free(3)  # released before it could be regenerated: nothing to regenerate
    assert [p.prompt_id for p in a.release()] == [40]
    assert a.prompt(40) is resumed and a.prompt(3) is None


def test_admission_refill_budget_halt_and_exhaustion():
    a = Admission(_Source(n=6), capacity=2, refill_budget=1)
    assert _admit_all(a) == [(0, True), (1, True)]
    assert a.free_for_refill(0) is True  # within the budget: freed now
    assert a.free_for_refill(1) is False  # budget spent: at the next release
    assert _admit_all(a) == [(2, True)]
    a.release()  # frees 1, renews the budget
    assert a.free_for_refill(2) is True
    a.halt()
    assert a.next() is None and not a.can_admit()
    a.reopen()
    assert _admit_all(a) == [(3, True), (4, True)]
    a.free(3)
    a.free(4)
    assert _admit_all(a) == [(5, True)]
    a.free(5)
    assert a.next() is None and not a.can_admit()  # the source is exhausted
    with pytest.raises(ValueError, match="capacity"):
        Admission(_Source(), capacity=0)


# -- ServerPool ---------------------------------------------------------------------------


def test_server_pool_ranking():
    servers = [_Server(version=3), _Server(version=2), _Server(version=3)]
    pool = ServerPool(servers)
    load = collections.Counter({0: 2, 1: 0, 2: 1})
    assert pool.choose(load, version=3) == 2  # up to date before lagging, then least loaded
    assert pool.choose(load, version=3, avoid=2) == 0
    assert pool.choose(collections.Counter({0: 0, 2: 0}), version=3) == 0  # lowest index
    pool.suspect.add(0)
    assert pool.choose(collections.Counter(), version=3) == 2  # healthy before suspect
    assert pool.choose(collections.Counter(), version=2) == 1  # nobody lags at version 2
    pool.mark_dead(1, RuntimeError("x"))
    pool.mark_dead(2, RuntimeError("x"))
    assert pool.choose(collections.Counter(), version=3) == 0  # suspect, but alive
    pool.mark_dead(0, RuntimeError("x"))
    assert pool.choose(collections.Counter(), version=3) == -1 and pool.alive == []
    with pytest.raises(ValueError, match="at least one"):
        ServerPool([])


def test_server_pool_guarded_calls_report_each_death_once():
    a, b = _Server(), _Server(partial_rollout="restart")
    pool = ServerPool([a, b])
    assert pool.restarts(1) and not pool.restarts(0)
    assert pool.submit(0, _request(5)).status is Submitted.OK and a.submitted == [5]
    rejected = pool.submit(0, _request(-1))
    assert rejected.status is Submitted.REJECTED and "max_prefill_length" in str(rejected.error)
    assert pool.alive == [0, 1]  # a rejected request does not kill the server
    a.fail_with = RuntimeError("engine exploded")
    assert pool.submit(0, _request(6)).status is Submitted.DIED
    assert pool.dead == {0}
    assert pool.abort(0, 5) is Submitted.OK and pool.update(0, None, 1) is Submitted.OK  # skipped
    assert pool.check() == []  # already known dead: reported once
    b.fail_with = RuntimeError("oom")
    assert pool.stats() == [{}, {}]  # stats never kill: check() reports the death
    assert pool.check() == [1] and pool.check() == []
    c = _Server()
    pool = ServerPool([c])
    c.fail_with = RuntimeError("gone")
    assert pool.update(0, None, 2) is Submitted.DIED and pool.abort(0, 1) is Submitted.OK


# -- Clocks -----------------------------------------------------------------------------


def test_virtual_clock_moves_only_when_advanced():
    clock = VirtualClock(start=5.0)
    assert clock.now() == 5.0 and clock.now() == 5.0
    assert clock.advance(1.5) == 6.5
    clock.sleep(0.5)  # no real sleeping: the sleeper makes time pass
    cond = threading.Condition()
    with cond:
        assert clock.wait(cond, 2.0) is False
    assert clock.now() == 9.0
    assert clock.advance_to(10.0) == 10.0
    with pytest.raises(ValueError, match="already 10.0"):
        clock.advance_to(9.0)
    with pytest.raises(ValueError, match=">= 0"):
        clock.advance(-1.0)
    real = RealClock()
    t0 = real.now()
    real.sleep(0.01)
    assert real.now() > t0


# -- The scheduler under a VirtualClock ---------------------------------------------------


def test_no_silent_hang_under_a_virtual_clock(monkeypatch):
    """rl_pitfalls "No silent hang": of 8 samples one never returns and one raises;
    0.5 s deadline, one retry: the batch comes back at virtual t ~ 1 s with the
    shortfall and both failures counted -- and nothing sleeps for real."""

    def no_sleep(_):
        raise AssertionError("real sleep under a virtual clock")

    monkeypatch.setattr(time, "sleep", no_sleep)
    threads = threading.active_count()
    sched, clock, servers, ledger = _virtual_scheduler(
        [{"latency_s": 0.1, "hang": {1}, "reject": {2}}, {"latency_s": 0.1, "hang": {1}}],
        B=4,
        G=2,
        sample_deadline_s=0.5,
        max_retries=1,
    )
    # Deadlines fire at the virtual time they are due, not before.
    ThreadFree(sched).poll()  # admits prompts 0-3 at t = 0; (2, 0) is rejected on submit
    clock.advance_to(0.2)
    for s in servers:
        s.deliver_due()  # everything but prompt 1 is back
    clock.advance_to(0.5)
    ThreadFree(sched).poll()
    assert sched.watch.counters["samples_timed_out"] == 0
    clock.advance_to(0.51)
    ThreadFree(sched).poll()
    assert sched.watch.counters["samples_timed_out"] == 2  # (1, 0) and (1, 1), both late now
    assert sched.watch.counters["samples_retried"] == 2  # each retried on the other server
    batch = drive(sched, clock, servers, 0)
    assert 1.0 < clock.now() < 1.1  # the second deadline (0.51 + 0.5), not later
    assert [g.prompt_id for g in batch.groups] == [0, 3]
    assert {(d.prompt_id, d.failure) for d in batch.dropped} == {
        (1, FailureReason.GENERATION_TIMEOUT),
        (2, FailureReason.REQUEST_REJECTED),
    }
    # Second deadline: the first late sample fails the prompt, its sibling is aborted.
    assert sched.watch.counters["samples_timed_out"] == 3
    assert sched.watch.counters["samples_failed"] == 2
    assert ledger.outcomes["failed"] == {"generation_timeout": 1, "request_rejected": 1}
    ThreadFree(sched).mark_trained(batch.groups)
    assert ledger.count(PromptOutcome.TRAINED) == 2
    # alpha = 0: nothing new starts before the next weights are published.
    sent = sum(len(s.submitted) for s in servers)
    clock.advance(10.0)
    ThreadFree(sched).poll()
    assert sum(len(s.submitted) for s in servers) == sent
    sched.servers_changed(ServersChanged(version=1, weights=[None, None]))
    ThreadFree(sched).poll()
    assert sum(len(s.submitted) for s in servers) == sent + 4 * 2
    assert threading.active_count() == threads  # no pump thread was started


def test_virtual_clock_runs_are_deterministic():
    def run():
        sched, clock, servers, ledger = _virtual_scheduler(
            [{"latency_s": 0.3}, {"latency_s": 0.7}], B=3, G=2, alpha=1
        )
        trace = []
        for v in range(4):
            batch = drive(sched, clock, servers, v)
            ThreadFree(sched).mark_trained(batch.groups)
            trace.append((clock.now(), [g.prompt_id for g in batch.groups], batch.rows))
            sched.servers_changed(ServersChanged(version=v + 1, weights=[None, None]))
        return trace, dict(sched.watch.counters), ledger.state_dict()

    assert run() == run()


# -- Every failure reason, exact, in both placements ---------------------------------------


class _CharTokenizer:
    """Renders "<u>{content}<a>" as code points (PromptSource asks for the ids directly)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<u>{m['content']}" for m in messages) + "<a>"
        return [ord(c) % 512 for c in text] if tokenize else text


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.timeout(300)
def test_every_failure_reason_is_counted_exactly(tmp_path, placement):
    """Malformed row, over-long prompt, reward raise, reward timeout (real data
    loader, prompt source and reward worker processes), sample deadline and server
    death (fake servers): each prompt fails with its own reason, none is "other"."""
    from jaxflash.data.files import load_rows
    from jaxflash.data.prompts import PromptSource
    from jaxflash.runtime.rollout.reward_pool import RewardPool
    from tests.reward_fixtures import flaky_reward

    lines = [
        '{"prompt": "a", "answer": "1"}',
        "{this is not json",  # 1: malformed_row
        '{"prompt": "' + "w" * 80 + '", "answer": "1"}',  # 2: prompt_too_long
        '{"prompt": "c", "answer": "raise"}',  # 3: reward_error
        '{"prompt": "d", "answer": "hang"}',  # 4: reward_timeout
        '{"prompt": "e", "answer": "1"}',  # 5: generation_timeout (never comes back)
        '{"prompt": "f", "answer": "1"}',  # 6: server_died (kills every server it reaches)
        '{"prompt": "g", "answer": "1"}',
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = load_rows(str(path), prompt_key="prompt", answer_key="answer", on_error="skip")
    source = PromptSource(rows, _CharTokenizer(), max_prompt_tokens=32)
    n_servers = 1 if placement == "colocated" else 2
    server = {"latency_s": 0.2, "hang": {5}, "poison": {6}}
    with RewardPool(flaky_reward, num_workers=2, timeout_s=1.0) as pool:
        sched, clock, servers, ledger = _virtual_scheduler(
            [server] * n_servers,
            B=6,
            G=2,
            scorer=pool,
            source=source,
            sample_deadline_s=5.0,
            max_retries=0,
        )
        first = drive(sched, clock, servers, 0)  # prompts 0-5
        ThreadFree(sched).mark_trained(first.groups)
        sched.servers_changed(ServersChanged(version=1, weights=[None] * n_servers))
        second = drive(sched, clock, servers, 1)  # prompt 6 kills the servers: admission halts
        with pytest.raises(RuntimeError, match="every generation server died"):
            drive(sched, clock, servers, 1)
    assert [g.prompt_id for g in first.groups] == [0] and second.groups == []
    assert ledger.outcomes["failed"] == {
        "malformed_row": 1,
        "prompt_too_long": 1,
        "reward_error": 1,
        "reward_timeout": 1,
        "generation_timeout": 1,
        "server_died": 1,
    }
    assert ledger.count(PromptOutcome.TRAINED) == 1 and ledger.taken == 7
    assert sched.watch.counters["server_failures"] == n_servers
    # Every failed prompt has its G = 2 rows: the samples that came back (prompts 3 and
    # 4) with their tokens, the others (never generated, or lost on a server) empty.
    failed = [r for r in first.rows + second.rows if r["outcome"] == "failed"]
    assert {r["prompt_id"]: r["failure"] for r in failed} == {
        1: "malformed_row",
        2: "prompt_too_long",
        3: "reward_error",
        4: "reward_timeout",
        5: "generation_timeout",
        6: "server_died",
    }
    keys = sorted((r["prompt_id"], r["sample_index"]) for r in failed)
    assert keys == [(p, i) for p in range(1, 7) for i in range(2)]
    assert {r["prompt_id"] for r in failed if r["response_tokens"]} == {3, 4}
    ledger.check()


def test_prompt_failure_items_fail_with_their_own_reason():
    class Failing(_Source):
        def take(self, k):
            self.cursor += 1
            return [PromptFailure(prompt_id=0, reason="bad", failure=FailureReason.MALFORMED_ROW)]

    sched, clock, servers, ledger = _virtual_scheduler([{}], B=1, G=2, source=Failing(n=1))
    batch = drive(sched, clock, servers, 0)
    assert [(d.prompt_id, d.failure) for d in batch.dropped] == [(0, FailureReason.MALFORMED_ROW)]
    assert ledger.outcomes["failed"] == {"malformed_row": 1}


class LowRewards(InstantRewards):
    """Reward 0 for every sample of the prompts in ``low``, else the sample index."""

    def __init__(self, low):
        self.low = set(low)

    def submit(self, item):
        _, pid, _, idx = item[2].split()
        f = concurrent.futures.Future()
        f.set_result(Scored(RewardResult(score=0.0 if int(pid) in self.low else float(idx))))
        return f


def test_group_filters_apply_with_a_refill_budget_of_b_per_step():
    """Filter thresholds act at alpha = 0 on one server (the colocated shape) too; a
    filtered prompt is replaced at once, at most B times per step, so a run whose
    every group is filtered cannot read its whole dataset in one step."""
    from jaxflash.replay.groups import GroupFilter

    clock, inbox, ledger = VirtualClock(), Inbox(), PromptLedger()
    servers = [VirtualServer(inbox.generated, clock, latency_s=0.1)]
    sched = _rollout(
        _Source(),
        GroupBuffer(2, group_filter=GroupFilter(min_mean=0.25)),
        LowRewards(low={0, 1, 2, 3, 5}),
        B=2, G=2, alpha=0, ledger=ledger, clock=clock, servers=servers, inbox=inbox,
        refill_dropped=True,
    )  # fmt: skip
    batch = drive(sched, clock, servers, 0)
    # 0 and 1 filtered -> replaced by 2 and 3 (budget 2 spent) -> filtered, not replaced.
    assert batch.groups == [] and [d.prompt_id for d in batch.dropped] == [0, 1, 2, 3]
    assert {d.reason for d in batch.dropped} == {"mean_below_min"}
    assert ledger.taken == 4 and ledger.outcomes["filtered"] == {"mean_below_min": 4}
    sched.servers_changed(
        ServersChanged(version=1, weights=[None])
    )  # the skipped step's version: capacity and budget are back
    batch = drive(sched, clock, servers, 1)
    assert [g.prompt_id for g in batch.groups] == [4, 6]  # 5 filtered and replaced by 6
    assert ledger.outcomes["filtered"] == {"mean_below_min": 5}


def test_settings_and_dispatch_factories_refuse_bad_input_naming_it():
    with pytest.raises(ValueError, match="need batch_prompts >= 1, group_size >= 1, async_ratio"):
        RolloutSettings(batch_prompts=0, group_size=2, async_ratio=0, sampling=SAMPLING, seed=0)
    with pytest.raises(
        ValueError, match=r"stale_policy must be drop \| regenerate \| pace, got 'keep'"
    ):
        RolloutSettings(
            batch_prompts=1, group_size=2, async_ratio=0, sampling=SAMPLING, seed=0,
            stale_policy="keep",
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs a scorer"):
        prompt_dispatch(None, Tok())
    from jaxflash.runtime.rollout.episode_dispatch import episode_dispatch

    sched, *_ = _virtual_scheduler([{}], B=1, G=2)
    no_replication = RolloutSettings(
        batch_prompts=1, group_size=2, async_ratio=0, sampling=SAMPLING, seed=0,
        prompt_replication=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="prompt_replication=False has no meaning for episodes"):
        episode_dispatch(None)(None, no_replication)
    # reconfigure goes through the owners' methods: capacity and refill budget checked there.
    sched.reconfigure(batch_prompts=2, async_ratio=1, prompts_in_flight=3)
    stats = sched.watch.stats()
    assert (stats["sched_batch_prompts"], stats["sched_async_ratio"]) == (2, 1)
    assert stats["sched_prompts_capacity"] == 3
    with pytest.raises(ValueError, match="Admission needs capacity >= 1"):
        ThreadFree(sched).parts.admission.resize(capacity=0, refill_budget=0)


def test_counters_are_the_checkpoints_plus_what_each_part_counted():
    restored = {"samples_generated": 10, "samples_scored": 10, "prompts_trained": 3}
    sched, clock, servers, _ = _virtual_scheduler([{}], B=1, G=2, counters=restored)
    batch = drive(sched, clock, servers, 0)
    assert len(batch.groups) == 1
    c = sched.watch.counters
    assert c["samples_generated"] == 12 and c["samples_scored"] == 12  # 10 restored + 2
    assert c["prompts_trained"] == 3 and c["prompts_regenerated_on_resume"] == 0
    assert (
        ThreadFree(sched).parts.dispatcher.watch.counts()["samples_generated"] == 2
    )  # the router's own, via its owner
    assert ThreadFree(sched).snapshot().counters == {k: c[k] for k in sorted(c)}


def test_a_malformed_row_is_warned_once_and_counted_every_epoch(tmp_path, caplog):
    # A file is read in epochs with fresh prompt ids: its malformed rows fail every epoch.
    from jaxflash.data.files import load_rows
    from jaxflash.data.prompts import PromptSource

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{not json\n{"prompt": " ", "answer": "1"}\n')
    rows = load_rows(str(path), prompt_key="prompt", answer_key="answer", on_error="skip")
    source = PromptSource(rows, _CharTokenizer(), max_prompt_tokens=32, cycle=True)
    sched, clock, servers, ledger = _virtual_scheduler([{}], B=3, G=2, source=source)
    caplog.set_level(logging.WARNING, logger="jaxflash.runtime.rollout.batches")
    for version in range(3):  # three epochs of the three rows
        batch = drive(sched, clock, servers, version)
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(ServersChanged(version=version + 1, weights=[None]))
    assert ledger.outcomes["failed"] == {"malformed_row": 6}
    warned = [r.getMessage() for r in caplog.records if "malformed_row" in r.getMessage()]
    assert len(warned) == 2, warned
    assert f"{path}:2: " in warned[0] and f"{path}:3: 'prompt' is empty" in warned[1]
