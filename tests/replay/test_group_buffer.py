"""GroupBuffer: complete fresh groups oldest-first, nothing lost at the batch edge."""

import random
import threading

import numpy as np
import pytest

from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.groups import GroupFilter
from jaxflash.types import FailureReason, FinishReason, PromptOutcome, Sample

G = 4


def _s(pid, idx, start=5, reward=1.0, *, versions=None, error=None, finish=FinishReason.EOS):
    tv = np.full((2,), start, np.int32) if versions is None else np.asarray(versions, np.int32)
    return Sample(
        prompt_id=pid,
        sample_index=idx,
        prompt_tokens=np.array([1, 2], np.int32),
        response_tokens=np.arange(tv.size, dtype=np.int32),
        behaviour_logprobs=np.zeros(tv.size, np.float32),
        token_versions=tv,
        start_version=start,
        finish_reason=finish,
        reward=reward,
        reward_info={"error": error} if error else {},
    )


def _add_group(buf, pid, start=5, rewards=(0.0, 1.0, 0.0, 1.0)):
    for i, r in enumerate(rewards):
        buf.add(_s(pid, i, start, r))


def _balanced(buf):
    c = buf.counts()
    return c["produced"] == c["returned"] + c["dropped"] + c["pending"]


# -- Nothing dropped at the batch edge ----------------------------------------


def test_batch_edge_keeps_the_remainder_and_returns_it_first():
    buf = GroupBuffer(G)
    for pid in range(10):
        _add_group(buf, pid, start=5)
    groups, dropped = buf.take(8, learner_version=5, async_ratio=0)
    assert [g.prompt_id for g in groups] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert dropped == []
    assert buf.counts()["pending"] == 2
    for pid in (10, 11, 12):  # newer groups arrive before the next step
        _add_group(buf, pid, start=6)
    groups, dropped = buf.take(8, learner_version=6, async_ratio=1)
    assert [g.prompt_id for g in groups] == [8, 9, 10, 11, 12]
    assert dropped == []
    assert buf.counts() == {
        "produced": 13,
        "returned": 13,
        "dropped": 0,
        "pending": 0,
        "samples_late_discarded": 0,
        "staleness_fresh": 13,
        "staleness_stale": 0,
        "staleness_anomaly": 0,
        "staleness_overshoot": 0,
    }


def test_groups_come_out_oldest_first_then_by_prompt_id_and_sorted_inside():
    buf = GroupBuffer(G)
    for pid, start in [(30, 4), (10, 5), (20, 3), (5, 5), (40, 3)]:
        for i in (3, 0, 2, 1):  # arrival order within the group does not matter
            buf.add(_s(pid, i, start, float(i)))
    groups, _ = buf.take(5, learner_version=5, async_ratio=2)
    assert [(g.start_version, g.prompt_id) for g in groups] == [
        (3, 20),
        (3, 40),
        (4, 30),
        (5, 5),
        (5, 10),
    ]
    for g in groups:
        assert [s.sample_index for s in g.samples] == [0, 1, 2, 3]
        np.testing.assert_array_equal(g.rewards_g, [0.0, 1.0, 2.0, 3.0])


def test_incomplete_groups_wait():
    buf = GroupBuffer(G)
    for i in range(3):
        buf.add(_s(1, i))
    assert buf.take(4, 5, 0) == ([], [])
    assert buf.num_complete() == 0
    buf.add(_s(1, 3))
    assert buf.num_complete() == 1
    groups, _ = buf.take(4, 5, 0)
    assert [g.prompt_id for g in groups] == [1]


# -- Staleness at take time ---------------------------------------------------


def test_group_start_is_its_oldest_sample_and_stale_groups_are_dropped_with_reason():
    buf = GroupBuffer(G)
    buf.add(_s(1, 0, start=3, versions=[3, 4]))  # spans {3, 4}
    for i in (1, 2, 3):
        buf.add(_s(1, i, start=4))
    _add_group(buf, 2, start=4)
    groups, dropped = buf.take(8, learner_version=4, async_ratio=0)
    assert [g.prompt_id for g in groups] == [2]
    assert [(d.prompt_id, d.reason, d.outcome, d.regenerate) for d in dropped] == [
        (1, "stale", PromptOutcome.STALE, False)
    ]
    assert "start version 3, learner version 4, staleness 1 > async_ratio 0" in dropped[0].detail
    assert len(dropped[0].samples) == G
    c = buf.counts()
    assert (c["dropped_stale"], c["staleness_stale"], c["staleness_fresh"]) == (1, 1, 1)


def test_state_dict_carries_the_counters_into_a_resumed_buffer():
    """A checkpoint's buffer_* go on in the resumed run, as prompts_* do; the groups
    pending at the checkpoint are generated again there, so they are counted produced
    once over both runs, as in an uninterrupted one."""

    def first_run():
        buf = GroupBuffer(G)
        buf.add(_s(1, 0, start=3, versions=[3, 4]))
        for i in (1, 2, 3):
            buf.add(_s(1, i, start=4))  # stale at version 4
        _add_group(buf, 2, start=4)
        buf.take(8, learner_version=4, async_ratio=0)
        buf.add(_s(3, 0, start=4), failure=FailureReason.REWARD_ERROR)
        buf.take(8, learner_version=4, async_ratio=0)  # reports group 3 failed
        buf.add(_s(3, 1, start=4))  # late sibling of a failed group
        _add_group(buf, 4, start=4)  # complete, not yet taken: pending at the checkpoint
        buf.add(_s(5, 0, start=4))  # incomplete: pending too
        return buf

    def rest(buf, *, resumed):  # the rest of the run up to the next take
        if resumed:  # the in-flight prompts 4 and 5 are generated again from scratch
            _add_group(buf, 4, start=4)
            buf.add(_s(5, 0, start=4))
        for i in (1, 2, 3):
            buf.add(_s(5, i, start=4))
        _add_group(buf, 6, start=5)
        buf.take(8, learner_version=5, async_ratio=1)
        return buf.counts()

    buf = first_run()
    state = buf.state_dict()
    assert state["produced"] == buf.counts()["produced"] - 2  # pending 4 and 5 left out
    resumed = GroupBuffer(G, state=state)
    assert resumed.counts() == {**buf.counts(), "produced": state["produced"], "pending": 0}
    assert _balanced(resumed)
    uninterrupted = rest(first_run(), resumed=False)
    assert rest(resumed, resumed=True) == uninterrupted
    assert uninterrupted["dropped_failed"] == uninterrupted["samples_late_discarded"] == 1
    assert rest(GroupBuffer(G), resumed=True) != uninterrupted  # what a resume used to report
    with pytest.raises(ValueError, match="not a state_dict"):
        GroupBuffer(G, state={**state, "produced": state["produced"] + 1})


def test_queue_time_counts_finished_at_4_trained_at_6_with_k1():
    buf = GroupBuffer(G)
    _add_group(buf, 1, start=4)
    groups, dropped = buf.take(1, learner_version=6, async_ratio=1)
    assert groups == [] and [d.reason for d in dropped] == ["stale"]


def test_stale_groups_past_the_batch_edge_are_dropped_too():
    buf = GroupBuffer(G)
    for pid in range(3):
        _add_group(buf, pid, start=6)
    _add_group(buf, 9, start=2)
    groups, dropped = buf.take(1, learner_version=6, async_ratio=1)
    assert [g.prompt_id for g in groups] == [0]
    assert [d.prompt_id for d in dropped] == [9]
    assert buf.counts()["pending"] == 2 and _balanced(buf)


def test_regenerate_policy_reports_stale_groups_for_resubmission():
    buf = GroupBuffer(G)
    _add_group(buf, 1, start=2)
    groups, dropped = buf.take(4, learner_version=5, async_ratio=1, policy="regenerate")
    assert groups == []
    assert [(d.prompt_id, d.reason, d.regenerate) for d in dropped] == [(1, "stale", True)]
    _add_group(buf, 1, start=5)  # the regenerated attempt is a new group
    groups, dropped = buf.take(4, learner_version=5, async_ratio=1)
    assert [g.prompt_id for g in groups] == [1] and dropped == []
    assert groups[0].start_version == 5
    c = buf.counts()
    assert (c["produced"], c["returned"], c["dropped"]) == (2, 1, 1)


def test_pace_policy_returns_an_overshooting_group_counted_and_accept_holds_groups():
    """policy="pace" drops nothing for staleness: a group older than α is returned and
    counted (``staleness_overshoot``, kept in the state_dict); ``accept`` False keeps a
    complete group pending, in start order."""
    buf = GroupBuffer(G)
    _add_group(buf, 1, start=2)
    _add_group(buf, 2, start=4)
    asked = []

    def hold_2(pid, start):
        asked.append((pid, start))
        return pid != 2

    groups, dropped = buf.take(4, learner_version=5, async_ratio=1, policy="pace", accept=hold_2)
    assert [g.prompt_id for g in groups] == [1] and dropped == [] and asked == [(1, 2), (2, 4)]
    c = buf.counts()
    assert (c["staleness_overshoot"], c["staleness_fresh"], c["pending"]) == (1, 0, 1)
    groups, _ = buf.take(4, learner_version=5, async_ratio=1, policy="pace")
    assert [g.prompt_id for g in groups] == [2] and buf.counts()["staleness_fresh"] == 1
    state = buf.state_dict()
    assert state["staleness_overshoot"] == 1 and _balanced(buf)
    assert GroupBuffer(G, state=state).counts()["staleness_overshoot"] == 1
    old = {k: v for k, v in state.items() if k != "staleness_overshoot"}  # before "pace"
    assert GroupBuffer(G, state=old).counts()["staleness_overshoot"] == 0


def test_group_newer_than_learner_is_stale_and_an_anomaly():
    buf = GroupBuffer(G)
    _add_group(buf, 1, start=7)
    groups, dropped = buf.take(2, learner_version=5, async_ratio=5)
    assert groups == []
    assert [(d.prompt_id, d.reason, d.outcome) for d in dropped] == [
        (1, "stale", PromptOutcome.STALE)
    ]
    assert (
        "anomaly" in dropped[0].detail
        and "start version 7 > learner version 5" in dropped[0].detail
    )
    c = buf.counts()
    assert c["returned"] == 0 and c["dropped_stale"] == 1 and c["staleness_anomaly"] == 1
    assert c["staleness_fresh"] == 0


def test_learner_version_may_not_go_back():
    buf = GroupBuffer(G)
    buf.take(1, 57, 0)
    with pytest.raises(ValueError, match="take at version 1 after version 57"):
        buf.take(1, 1, 0)


# -- Filters ------------------------------------------------------------------


@pytest.mark.parametrize(
    "flt, rewards, reason",
    [
        (GroupFilter(zero_variance=True), (1.0, 1.0, 1.0, 1.0), "zero_variance"),
        (GroupFilter(zero_variance=True), (0.0, 0.0, 0.0, 0.0), "zero_variance"),
        # equal up to float rounding counts as equal (fp32-residue pitfall)
        (GroupFilter(zero_variance=True), (0.35, 0.35, 0.35 + 1e-9, 0.35), "zero_variance"),
        (GroupFilter(zero_variance=True), (0.35, 0.35, 0.35, 0.0), None),
        (GroupFilter(min_mean=0.2), (0.0, 0.0, 0.0, 0.5), "mean_below_min"),  # mean .125
        (GroupFilter(min_mean=0.2), (0.0, 0.0, 0.0, 0.8), None),  # mean .2
        (GroupFilter(max_mean=0.9), (1.0, 1.0, 1.0, 1.0), "mean_above_max"),
        (GroupFilter(max_mean=0.9), (1.0, 1.0, 1.0, 0.5), None),  # mean .875
        (GroupFilter(min_std=0.1), (0.0, 0.0, 0.0, 0.2), "std_below_min"),  # std .0866
        (GroupFilter(min_std=0.1), (0.0, 0.0, 1.0, 1.0), None),  # std .5
    ],
)
def test_filters(flt, rewards, reason):
    buf = GroupBuffer(G, group_filter=flt)
    _add_group(buf, 3, rewards=rewards)
    groups, dropped = buf.take(1, 5, 0)
    if reason is None:
        assert [g.prompt_id for g in groups] == [3] and dropped == []
    else:
        assert groups == []
        assert [(d.prompt_id, d.reason, d.outcome) for d in dropped] == [
            (3, reason, PromptOutcome.FILTERED)
        ]
        assert buf.counts()[f"dropped_{reason}"] == 1


def test_filtered_groups_do_not_take_batch_slots():
    buf = GroupBuffer(G, group_filter=GroupFilter(zero_variance=True))
    _add_group(buf, 0, rewards=(1.0,) * 4)
    _add_group(buf, 1)
    _add_group(buf, 2)
    _add_group(buf, 3)
    groups, dropped = buf.take(2, 5, 0)
    assert [g.prompt_id for g in groups] == [1, 2]
    assert [d.prompt_id for d in dropped] == [0]
    assert buf.counts()["pending"] == 1


@pytest.mark.parametrize(
    "kwargs", [dict(min_std=-1.0), dict(min_mean=1.0, max_mean=0.0), dict(zero_variance_atol=-1)]
)
def test_filter_validates(kwargs):
    with pytest.raises(ValueError, match="GroupFilter"):
        GroupFilter(**kwargs)


# -- Failures -----------------------------------------------------------------


def test_failed_sample_fails_its_group_with_reason_and_late_siblings_are_discarded():
    buf = GroupBuffer(G)
    buf.add(_s(4, 0))
    buf.add(
        _s(4, 1, reward=None, error="reward timeout after 10 s"),
        failure=FailureReason.REWARD_TIMEOUT,
    )
    _add_group(buf, 5)
    groups, dropped = buf.take(8, 5, 0)
    assert [g.prompt_id for g in groups] == [5]
    assert [(d.prompt_id, d.reason, d.outcome, d.failure) for d in dropped] == [
        (4, "failed", PromptOutcome.FAILED, FailureReason.REWARD_TIMEOUT)
    ]
    assert dropped[0].detail == "prompt 4 sample 1: reward timeout after 10 s"
    assert [s.sample_index for s in dropped[0].samples] == [0, 1]
    buf.add(_s(4, 2))  # a sibling arriving after the group was reported
    buf.fail(4, FailureReason.GENERATION_TIMEOUT, "late")
    assert buf.take(8, 5, 0) == ([], [])
    c = buf.counts()
    assert c["samples_late_discarded"] == 2 and c["pending"] == 0 and c["dropped_failed"] == 1
    assert _balanced(buf)


def test_fail_without_samples_and_nonfinite_reward():
    buf = GroupBuffer(G)
    buf.fail(8, FailureReason.SERVER_DIED, "generation error: RuntimeError: boom")
    for i in range(G):
        buf.add(_s(9, i, reward=float("nan") if i == 2 else 1.0))
    for i in range(G):  # an error in reward_info without a reason is a reward error
        buf.add(_s(10, i, error="unparsable reference" if i == 1 else None))
    _, dropped = buf.take(8, 5, 0)
    assert [(d.prompt_id, d.detail, d.failure) for d in dropped] == [
        (8, "prompt 8: generation error: RuntimeError: boom", FailureReason.SERVER_DIED),
        (9, "prompt 9 sample 2: non-finite reward nan", FailureReason.NON_FINITE_REWARD),
        (10, "prompt 10 sample 1: unparsable reference", FailureReason.REWARD_ERROR),
    ]
    assert buf.counts()["produced"] == 3 and _balanced(buf)


def test_fail_reports_what_it_cut_short_apart_from_the_samples_that_arrived():
    buf = GroupBuffer(G)
    buf.add(_s(3, 0))
    cut = (_s(3, 1, reward=None, finish=FinishReason.ABORTED),)
    buf.fail(3, FailureReason.ENV_FAILURE, "environment raised", unfinished=cut)
    later = (_s(3, 2, reward=None, finish=FinishReason.ABORTED),)
    buf.fail(3, FailureReason.GENERATION_TIMEOUT, "second", unfinished=later)  # first kept
    _, (d,) = buf.take(8, 5, 0)
    assert (d.failure, [s.sample_index for s in d.samples]) == (FailureReason.ENV_FAILURE, [0])
    assert d.unfinished == cut
    c = buf.counts()  # reported, never added: produced / dropped count the group once
    assert c["produced"] == 1 and c["dropped_failed"] == 1 and _balanced(buf)


def test_drain_empties_the_buffer():
    buf = GroupBuffer(G)
    _add_group(buf, 1)
    buf.add(_s(2, 0))
    out = buf.drain()
    shutdown = FailureReason.SHUTDOWN
    assert [(d.prompt_id, d.reason, d.outcome, d.failure, len(d.samples)) for d in out] == [
        (1, "drained", PromptOutcome.FAILED, shutdown, 4),
        (2, "drained", PromptOutcome.FAILED, shutdown, 1),
    ]
    assert buf.counts()["pending"] == 0 and _balanced(buf)


@pytest.mark.parametrize(
    "sample, match",
    [
        (_s(1, 4), r"sample_index 4 of prompt 1 is outside \[0, group_size=4\)"),
        (_s(1, -1), "sample_index -1"),
        (_s(1, 0, reward=None), "has no reward"),
        (_s(1, 0, finish=FinishReason.ABORTED), "ABORTED"),
    ],
)
def test_add_rejects_bad_samples(sample, match):
    with pytest.raises(ValueError, match=match):
        GroupBuffer(G).add(sample)


def test_bad_arguments():
    buf = GroupBuffer(G)
    buf.add(_s(1, 0))
    with pytest.raises(ValueError, match="duplicate sample 1/0"):
        buf.add(_s(1, 0))
    with pytest.raises(TypeError):
        buf.add({"prompt_id": 1})
    with pytest.raises(ValueError, match="batch_groups"):
        buf.take(0, 5, 0)
    with pytest.raises(ValueError, match="async_ratio"):
        buf.take(1, 5, -1)
    with pytest.raises(ValueError, match="learner_version"):
        buf.take(1, -1, 0)
    with pytest.raises(ValueError, match="policy"):
        buf.take(1, 5, 0, policy="keep")
    with pytest.raises(ValueError, match="group_size"):
        GroupBuffer(0)
    with pytest.raises(ValueError, match="detail"):
        buf.fail(1, FailureReason.REWARD_ERROR, "")
    with pytest.raises(TypeError, match="FailureReason"):
        buf.fail(1, "reward_error", "a reason as text is refused")
    with pytest.raises(ValueError, match="fail()"):
        buf.discard(1, PromptOutcome.FAILED, "failed")


# -- Randomized invariant: every group produced is returned or dropped once ------


def test_random_add_take_conserves_every_group():
    rng = random.Random(1234)  # fixed seed: deterministic sequence of ~600 add/fail/take calls
    G3, k = 3, 1
    buf = GroupBuffer(G3, group_filter=GroupFilter(zero_variance=True))
    version = 0
    next_pid = 0
    outstanding: dict[int, list[Sample]] = {}  # pid -> samples not yet added
    closed_failed: set[int] = set()
    returned: list[int] = []
    dropped_reasons: dict[str, int] = {}
    instances = 0
    samples_added = samples_seen = late = regenerated = 0

    def start_group(pid):
        nonlocal instances
        instances += 1
        samples = []
        for i in range(G3):
            err = "reward crashed" if rng.random() < 0.03 else None
            samples.append(_s(pid, i, version, float(rng.random() < 0.5), error=err))
        rng.shuffle(samples)
        outstanding[pid] = samples

    for _ in range(600):
        action = rng.random()
        if action < 0.15:
            start_group(next_pid)
            next_pid += 1
        elif action < 0.75 and outstanding:
            pid = rng.choice(sorted(outstanding)[:3])  # mostly in order, some overtaking
            s = outstanding[pid].pop()
            if not outstanding[pid]:
                del outstanding[pid]
            buf.add(s)
            samples_added += 1
            late += pid in closed_failed
        elif action < 0.77 and outstanding:
            pid = rng.choice(sorted(outstanding))
            buf.fail(pid, FailureReason.GENERATION_TIMEOUT, "generation timeout")
            late += pid in closed_failed
        elif action < 0.80 and outstanding:
            # A surplus prompt aborted in flight: dropped (late samples discarded)
            # or resubmitted at the current version.
            pid = rng.choice(sorted(outstanding))
            regen = rng.random() < 0.5 and pid not in closed_failed
            d = buf.discard(pid, PromptOutcome.STALE, "surplus_stale", regenerate=regen)
            if d is None:
                # Nothing pending: no sample of that attempt had arrived (nothing
                # produced), or its failed group was already reported.
                instances -= pid not in closed_failed
            else:
                assert d.outcome == PromptOutcome.STALE and d.regenerate == regen
                dropped_reasons[d.reason] = dropped_reasons.get(d.reason, 0) + 1
                samples_seen += len(d.samples)
            if regen:
                del outstanding[pid]  # aborted on the server: never delivered
                start_group(pid)
                regenerated += 1
            else:
                closed_failed.add(pid)  # its outstanding samples arrive late
        else:
            if rng.random() < 0.3:
                version += 1
            policy = rng.choice(["drop", "regenerate"])
            n = rng.randint(1, 4)
            groups, dropped = buf.take(n, version, k, policy=policy)
            assert len(groups) <= n
            keys = [(g.start_version, g.prompt_id) for g in groups]
            assert keys == sorted(keys)
            for g in groups:
                assert 0 <= version - g.start_version <= k
                assert [s.sample_index for s in g.samples] == list(range(G3))
                assert g.rewards_g.max() > g.rewards_g.min()
                returned.append(g.prompt_id)
                samples_seen += G3
            for d in dropped:
                assert d.reason and d.detail
                dropped_reasons[d.reason] = dropped_reasons.get(d.reason, 0) + 1
                samples_seen += len(d.samples)
                if d.reason == "failed":
                    closed_failed.add(d.prompt_id)
                if d.regenerate:
                    assert d.reason == "stale" and policy == "regenerate"
                    start_group(d.prompt_id)  # resubmitted at the current version
                    regenerated += 1
            c = buf.counts()
            assert _balanced(buf)
            assert c["returned"] == len(returned)
            assert c["samples_late_discarded"] == late

    # Finish: deliver everything outstanding, then drain what is left.
    for pid in sorted(outstanding):
        for s in outstanding[pid]:
            buf.add(s)
            samples_added += 1
            late += pid in closed_failed
    for d in buf.drain():
        dropped_reasons[d.reason] = dropped_reasons.get(d.reason, 0) + 1
        samples_seen += len(d.samples)
    c = buf.counts()
    assert c["pending"] == 0
    # every group started (including regenerated attempts) was returned or dropped once
    assert c["produced"] == instances == len(returned) + sum(dropped_reasons.values())
    assert {k: v for k, v in c.items() if k.startswith("dropped_")} == {
        f"dropped_{r}": n for r, n in dropped_reasons.items()
    }
    assert samples_added == samples_seen + late
    # the run exercised every path
    assert len(returned) > 10 and late > 0 and regenerated > 0
    assert {"stale", "failed", "zero_variance", "drained", "surplus_stale"} <= set(dropped_reasons)


def test_concurrent_add_and_take_lose_nothing():
    buf = GroupBuffer(2)
    n_per_thread = 200

    def producer(offset):
        for pid in range(offset, offset + n_per_thread):
            buf.add(_s(pid, 1, start=0, reward=0.0))
            buf.add(_s(pid, 0, start=0, reward=1.0))

    threads = [threading.Thread(target=producer, args=(o,)) for o in (0, 10_000)]
    for t in threads:
        t.start()
    got: list[int] = []
    while any(t.is_alive() for t in threads) or buf.num_complete():
        groups, dropped = buf.take(7, learner_version=0, async_ratio=0)
        assert dropped == [] and len(groups) <= 7
        got += [g.prompt_id for g in groups]
    for t in threads:
        t.join()
    got += [g.prompt_id for g in buf.take(1000, 0, 0)[0]]
    assert sorted(got) == list(range(200)) + list(range(10_000, 10_200))
    assert buf.counts()["produced"] == 400 and buf.counts()["pending"] == 0
