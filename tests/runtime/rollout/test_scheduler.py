"""RolloutScheduler with fake servers (no jax), threaded: capacity, α gate, deadlines.

The fake server "generates" a sample a few milliseconds after it is submitted,
stamping the version it holds; the fake reward scores sample i with reward i, so
every group has variance unless a test says otherwise. (The thread-free parts and
a virtual-clock run: tests/runtime/rollout/test_scheduler_parts.py.)
"""

import concurrent.futures
import time

import numpy as np
import pytest

from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.groups import GroupFilter
from jaxflash.rewards.base import RewardResult
from jaxflash.runtime.rollout.dispatch import prompt_dispatch
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.reward_pool import Scored
from jaxflash.runtime.rollout.scheduler import Inbox, RolloutScheduler
from jaxflash.runtime.rollout.server_pool import ServersChanged
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.types import (
    FailureReason,
    Prompt,
    PromptOutcome,
    SamplingParams,
)
from tests.fake_servers import FakeServer, Tok


class FakeSource:
    def __init__(self):
        self.cursor = 0

    def take(self, n):
        out = []
        for _ in range(n):
            pid = self.cursor
            self.cursor += 1
            out.append(
                Prompt(prompt_id=pid, text=f"q{pid}", prompt_tokens=np.array([1, 2]), answer="a")
            )
        return out


class FakeRewards:
    """Reward = sample index (from the item id), or 1.0 for prompts in ``flat``."""

    def __init__(self, flat=()):
        self.flat = set(flat)

    def submit(self, item):
        _, pid, _, idx = item[2].split()
        f = concurrent.futures.Future()
        f.set_result(Scored(RewardResult(score=1.0 if int(pid) in self.flat else float(idx))))
        return f


def _servers(*specs):
    """An inbox and one FakeServer per dict of FakeServer keyword arguments."""
    inbox = Inbox()
    return inbox, [FakeServer(inbox.generated, **spec) for spec in specs]


def _scheduler(inbox_servers, *, B=2, G=2, alpha=0, rewards=None, group_filter=None, **kw):
    inbox, servers = inbox_servers
    ledger = PromptLedger()
    books = RolloutBooks(
        source=FakeSource(), ledger=ledger, buffer=GroupBuffer(G, group_filter=group_filter)
    )
    settings = RolloutSettings(
        batch_prompts=B,
        group_size=G,
        async_ratio=alpha,
        sampling=SamplingParams(max_new_tokens=4),
        seed=0,
        **kw,
    )
    dispatch = prompt_dispatch(rewards or FakeRewards(), Tok())
    s = RolloutScheduler(servers, inbox, books, settings, dispatch)
    s.start()
    return s, ledger


def _trained_total(ledger):
    return sum(ledger.count(o) for o in PromptOutcome) + len(ledger.open_ids)


def test_alpha0_next_prompts_start_after_publish():
    inbox, servers = _servers({}, {})
    sched, ledger = _scheduler((inbox, servers), B=2, G=2, alpha=0)
    try:
        batch = sched.next_batch(0, timeout_s=10)
        assert [g.prompt_id for g in batch.groups] == [0, 1]
        # Prompt replication: 2 prompts x 2 samples spread 2 and 2 over the servers.
        assert [len(s.submitted) for s in servers] == [2, 2]
        time.sleep(0.1)
        assert sum(len(s.submitted) for s in servers) == 4  # nothing new before publish
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(ServersChanged(version=1, weights=[None, None]))
        batch = sched.next_batch(1, timeout_s=10)
        assert [g.prompt_id for g in batch.groups] == [2, 3]
        assert {s.start_version for g in batch.groups for s in g.samples} == {1}
        assert [r["outcome"] for r in batch.rows] == ["trained"] * 4
    finally:
        sched.close()
    assert ledger.taken == 4 and ledger.count(PromptOutcome.TRAINED) == 2


def test_at_most_alpha_plus_one_batches_in_flight():
    inbox, servers = _servers({"delay_s": 10.0})  # nothing finishes during the test
    sched, ledger = _scheduler((inbox, servers), B=2, G=2, alpha=2)
    time.sleep(0.2)
    assert ledger.taken == 6  # (2 + 1) * 2 prompts
    assert len(servers[0].submitted) == 12
    sched.close()
    assert sched.watch.counters["samples_aborted"] == 12  # surplus aborted at shutdown, counted


@pytest.mark.parametrize("policy", ["drop", "regenerate", "pace"])
def test_stale_groups_dropped_or_regenerated(policy):
    inbox, servers = _servers({})
    sched, ledger = _scheduler((inbox, servers), B=1, G=2, alpha=1, stale_policy=policy)
    try:
        time.sleep(0.2)  # prompts 0 and 1 finish at version 0
        sched.servers_changed(ServersChanged(version=1, weights=[None]))
        sched.servers_changed(ServersChanged(version=2, weights=[None]))
        batch = sched.next_batch(2, timeout_s=10)
        if policy == "drop":
            # staleness 2 > alpha 1: both dropped, closed as stale, rows say why.
            assert batch.groups == [] and [d.reason for d in batch.dropped] == ["stale"] * 2
            assert ledger.count(PromptOutcome.STALE) == 2
            assert {(r["outcome"], r["reason"]) for r in batch.rows} == {("stale", "stale")}
            # The step is skipped; the next weights free the capacity for fresh prompts.
            sched.servers_changed(ServersChanged(version=3, weights=[None]))
            batch = sched.next_batch(3, timeout_s=10)
            assert [g.prompt_id for g in batch.groups] == [2]
        elif policy == "pace":
            # Two versions passed with no batch taken (the bound cannot hold by
            # construction then): the oldest group is trained anyway, its overshoot
            # counted; nothing is dropped.
            assert [g.prompt_id for g in batch.groups] == [0] and batch.dropped == []
            assert {s.start_version for s in batch.groups[0].samples} == {0}
            assert sched.watch.counters["samples_trained_overshoot"] == 2
            assert ledger.count(PromptOutcome.STALE) == 0
        else:
            assert [g.prompt_id for g in batch.groups] == [0]
            assert {s.start_version for s in batch.groups[0].samples} == {2}
            assert ledger.count(PromptOutcome.STALE) == 0
            assert sched.watch.counters["prompts_regenerated_stale"] == 2
    finally:
        sched.close()
    ledger.check()


def test_dead_server_and_hung_sample_do_not_block():
    # Server 1 is dead; sample (1, 0) never returns anywhere: retried once, then failed.
    inbox_servers = _servers({"hang": {(1, 0)}}, {"dead": True, "hang": {(1, 0)}})
    sched, ledger = _scheduler(
        inbox_servers, B=2, G=2, alpha=0, sample_deadline_s=0.3, max_retries=1
    )
    t0 = time.monotonic()
    try:
        batch = sched.next_batch(0, timeout_s=20)
    finally:
        sched.close()
    assert time.monotonic() - t0 < 5
    assert [g.prompt_id for g in batch.groups] == [0]
    assert [(d.prompt_id, d.reason, d.failure) for d in batch.dropped] == [
        (1, "failed", FailureReason.GENERATION_TIMEOUT)
    ]
    assert sched.watch.counters["samples_timed_out"] >= 2
    assert sched.watch.counters["samples_retried"] >= 1
    assert sched.watch.counters["samples_failed"] == 1
    assert ledger.outcomes["failed"] == {"generation_timeout": 1}
    ledger.check()


def test_dynamic_sampling_refills_filtered_groups():
    # Prompts 0 and 2 have equal rewards: filtered, replaced at once, batch still full.
    sched, ledger = _scheduler(
        _servers({}, {}),
        B=2,
        G=2,
        alpha=0,
        rewards=FakeRewards(flat={0, 2}),
        group_filter=GroupFilter(zero_variance=True),
        refill_dropped=True,
    )
    try:
        batch = sched.next_batch(0, timeout_s=10)
    finally:
        sched.close()
    assert [g.prompt_id for g in batch.groups] == [1, 3]
    assert sorted(d.prompt_id for d in batch.dropped) == [0, 2]
    assert ledger.count(PromptOutcome.FILTERED) == 2
    assert sched.watch.counters["samples_dropped_zero_variance"] == 4
    ledger.check()


def test_next_batch_times_out_loudly_when_everything_is_dead():
    sched, _ = _scheduler(_servers({"dead": True}), B=1, G=1, alpha=0, sample_deadline_s=100)
    try:
        with pytest.raises(TimeoutError, match="0/1 groups"):
            sched.next_batch(0, timeout_s=0.5)
    finally:
        sched.close()


def test_next_batch_calls_stop_every_wait_slice_and_its_raise_ends_the_wait():
    sched, _ = _scheduler(_servers({"dead": True}), B=1, G=1, alpha=0, sample_deadline_s=100)
    calls = []

    def stop():  # the loop's Ctrl-C check (runtime.interrupt)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            sched.next_batch(0, timeout_s=60, stop=stop)
        assert len(calls) == 3  # polled while waiting; the wait ended at the raise
    finally:
        sched.close()


def test_server_that_dies_is_routed_around():
    inbox, servers = _servers({"delay_s": 0.3}, {"delay_s": 0.3})
    sched, ledger = _scheduler((inbox, servers), B=2, G=2, alpha=0, sample_deadline_s=100)
    time.sleep(0.1)
    servers[1].error = "engine exploded"  # its 2 outstanding samples never come back
    try:
        batch = sched.next_batch(0, timeout_s=10)
    finally:
        sched.close()
    assert [g.prompt_id for g in batch.groups] == [0, 1]
    assert sched.watch.counters["server_failures"] == 1
    assert sched.watch.counters["samples_rerouted"] == 2
    assert sched.watch.counters["samples_timed_out"] == 0  # noticed at once, not at the deadline
    assert len(servers[0].submitted) == 4
    ledger.check()


def _balanced(buf):
    c = buf.counts()
    return c["produced"] == c["returned"] + c["dropped"] + c["pending"]


def test_surplus_prompt_aborted_once_it_can_no_longer_be_trained_fresh():
    # alpha=1, B=1: capacity 2. Prompt 1's sample 1 never finishes by itself.
    inbox, servers = _servers({"hang": {(1, 1)}})
    sched, ledger = _scheduler((inbox, servers), B=1, G=2, alpha=1)
    try:
        batch = sched.next_batch(0, timeout_s=10)
        assert [g.prompt_id for g in batch.groups] == [0]
        # Still fresh at step 1 (start 0 >= 0 + 1 - 1): kept running, not aborted.
        assert servers[0].aborted == [] and sched.watch.counters["samples_aborted_surplus"] == 0
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(
            ServersChanged(version=1, weights=[None])
        )  # prompt 2 starts at version 1
        time.sleep(0.1)  # sample (1, 0) (start 0) is back and scored
        batch = sched.next_batch(1, timeout_s=10)
        assert [g.prompt_id for g in batch.groups] == [2]
        # Prompt 1 would be stale at step 2 (start 0 < 1 + 1 - 1): aborted at once.
        assert servers[0].aborted == [1]
        assert [(d.prompt_id, d.reason, d.outcome) for d in batch.dropped] == [
            (1, "surplus_stale", PromptOutcome.STALE)
        ]
        assert [(r["prompt_id"], r["outcome"], r["reason"]) for r in batch.rows] == [
            (2, "trained", "trained"),
            (2, "trained", "trained"),
            (1, "stale", "surplus_stale"),
        ]
        assert ledger.outcomes["stale"] == {"surplus_stale": 1}
        assert sched.watch.counters["samples_aborted_surplus"] == 1  # (1, 1) was outstanding
        assert sched.watch.counters["samples_aborted"] == 1
        assert sched.watch.counters["samples_dropped_surplus_stale"] == 1  # (1, 0) had arrived
        c = ThreadFree(sched).parts.buffer.counts()
        assert c["dropped_surplus_stale"] == 1 and _balanced(ThreadFree(sched).parts.buffer)
        # Its capacity is free now (a prompt started at version 1 is fresh at step 2).
        time.sleep(0.1)
        assert (3, 0) in servers[0].submitted and ledger.taken == 4
        ThreadFree(sched).mark_trained(batch.groups)
    finally:
        sched.close()
    assert ledger.count(PromptOutcome.TRAINED) == 2 and ledger.count(PromptOutcome.STALE) == 1
    assert ledger.taken == 4 and ledger.open_ids == {3}
    ledger.check()


@pytest.mark.parametrize("partial_rollout", ["continue", "restart"])
def test_in_flight_start_version_depends_on_partial_rollout(partial_rollout):
    # Prompt 1 has no finished sample. On a continue server its samples keep the
    # start version they were dispatched at (0): stale at step 2, aborted at step 1.
    # On a restart server a sample still running at the next publish restarts at
    # the new version, so the prompt is kept.
    inbox, servers = _servers({"hang": {(1, 0), (1, 1)}})
    servers[0].partial_rollout = partial_rollout
    sched, ledger = _scheduler((inbox, servers), B=1, G=2, alpha=1)
    try:
        batch = sched.next_batch(0, timeout_s=10)
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(ServersChanged(version=1, weights=[None]))
        batch = sched.next_batch(1, timeout_s=10)
        assert [g.prompt_id for g in batch.groups] == [2]
        assert batch.dropped == []  # no sample of prompt 1 had arrived
        if partial_rollout == "continue":
            assert servers[0].aborted == [1]
            assert sched.watch.counters["samples_aborted_surplus"] == 2
            assert ledger.outcomes["stale"] == {"surplus_stale": 1}
        else:
            assert servers[0].aborted == []
            assert sched.watch.counters["samples_aborted_surplus"] == 0
            assert ledger.count(PromptOutcome.STALE) == 0
    finally:
        sched.close()
    ledger.check()


def test_surplus_prompt_regenerated_fresh():
    inbox, servers = _servers({"hang": {(1, 1)}})
    sched, ledger = _scheduler((inbox, servers), B=1, G=2, alpha=1, stale_policy="regenerate")
    try:
        batch = sched.next_batch(0, timeout_s=10)
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(ServersChanged(version=1, weights=[None]))
        time.sleep(0.1)
        batch = sched.next_batch(1, timeout_s=10)
        assert [g.prompt_id for g in batch.groups] == [2]
        assert servers[0].aborted == [1]
        assert [(d.prompt_id, d.reason, d.regenerate) for d in batch.dropped] == [
            (1, "surplus_stale", True)
        ]
        assert sched.watch.counters["prompts_regenerated_stale"] == 1
        servers[0].hang.clear()  # the resubmitted requests finish normally
        ThreadFree(sched).mark_trained(batch.groups)
        sched.servers_changed(ServersChanged(version=2, weights=[None]))
        batch = sched.next_batch(2, timeout_s=10)
        # The regenerated group started at version 1: fresh at step 2, trained.
        assert [g.prompt_id for g in batch.groups] == [1]
        assert {s.start_version for s in batch.groups[0].samples} == {1}
        assert servers[0].submitted.count((1, 0)) == 2 and servers[0].submitted.count((1, 1)) == 2
        ThreadFree(sched).mark_trained(batch.groups)
    finally:
        sched.close()
    assert ledger.count(PromptOutcome.STALE) == 0 and ledger.count(PromptOutcome.TRAINED) == 3
    assert sched.watch.counters["samples_aborted_surplus"] == 1
    ledger.check()


def test_batch_groups_in_prompt_order_whatever_order_they_completed_in():
    # Prompt 0 finishes after prompt 1; the batch is still [0, 1] (canonical order,
    # so float sums over the batch do not depend on thread timing).
    inbox, servers = _servers({"hang": {(0, 0), (0, 1)}})
    sched, _ = _scheduler((inbox, servers), B=2, G=2, alpha=0)
    try:
        deadline = time.monotonic() + 10
        while ThreadFree(sched).parts.buffer.num_complete() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (
            ThreadFree(sched).parts.buffer.num_complete() == 1
        )  # prompt 1's group, complete first
        servers[0].hang.clear()
        batch = sched.next_batch(0, timeout_s=10)
        assert [g.prompt_id for g in batch.groups] == [0, 1]
    finally:
        sched.close()
