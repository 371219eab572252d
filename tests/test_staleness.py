"""Staleness gate, policy clock and restart semantics (rl_pitfalls.md, "Asynchrony")."""

import threading

import numpy as np
import pytest

from jaxflash.replay.staleness import (
    StalenessCounts,
    Verdict,
    classify,
    extend_sample,
    is_fresh,
    off_policy_tokens,
    restart_sample,
    staleness,
    start_version_of,
)
from jaxflash.replay.versions import PolicyClock
from jaxflash.types import FinishReason, Sample


def _sample(token_versions, start_version, *, tokens=None, logprobs=None, finish=None):
    tv = np.asarray(token_versions, np.int32)
    n = tv.size
    return Sample(
        prompt_id=7,
        sample_index=1,
        prompt_tokens=np.array([1, 5, 9], np.int32),
        response_tokens=np.arange(100, 100 + n, dtype=np.int32) if tokens is None else tokens,
        behaviour_logprobs=(
            -np.arange(1, n + 1, dtype=np.float32) / 10 if logprobs is None else logprobs
        ),
        token_versions=tv,
        start_version=start_version,
        finish_reason=finish or FinishReason.EOS,
    )


# -- Versions only go up ------------------------------------------------------


def test_publish_must_increase_and_names_both_versions():
    clock = PolicyClock(0)
    for v in (1, 2, 57):
        clock.publish(v)
    assert clock.version == 57
    with pytest.raises(ValueError, match=r"version 1 after version 57"):
        clock.publish(1)
    with pytest.raises(ValueError, match=r"version 57 after version 57"):
        clock.publish(57)
    assert clock.version == 57  # a refused publish changes nothing
    clock.publish(60)  # versions may skip
    assert clock.version == 60


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3", None])
def test_clock_rejects_non_int_versions(bad):
    with pytest.raises((TypeError, ValueError)):
        PolicyClock(bad)
    with pytest.raises((TypeError, ValueError)):
        PolicyClock(0).publish(bad)


def test_clock_reads_are_monotone_across_threads_and_wait_for_wakes():
    clock = PolicyClock(3)
    assert clock.wait_for(3, timeout_s=0.0) is True
    assert clock.wait_for(4, timeout_s=0.01) is False
    seen: list[int] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            seen.append(clock.version)

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in readers:
        t.start()
    waiter_result = []
    waiter = threading.Thread(target=lambda: waiter_result.append(clock.wait_for(200, 5.0)))
    waiter.start()
    for v in range(4, 201):
        clock.publish(v)
    waiter.join(5.0)
    stop.set()
    for t in readers:
        t.join(5.0)
    assert waiter_result == [True]
    assert clock.version == 200
    assert all(3 <= v <= 200 for v in seen)


# -- Off-by-one staleness -------------------------------------------------------


@pytest.mark.parametrize(
    "versions, learner, k, expected_staleness, fresh",
    [
        ([3, 4], 4, 0, 1, False),  # spans {3,4}: starts at 3, rejected with k=0
        ([4], 4, 0, 0, True),  # {4} accepted with k=0
        ([4, 4, 4], 4, 0, 0, True),
        ([3, 4], 4, 1, 1, True),  # k=1: {3,4} accepted
        ([3, 4, 5], 5, 1, 2, False),  # k=1: {3,4,5} rejected at learner 5
        ([4, 3, 5], 5, 1, 2, False),  # the oldest token decides, not the first
        ([4], 6, 1, 2, False),  # finished at 4, trained at 6: queue time counts
        ([4], 5, 1, 1, True),
        (4, 6, 2, 2, True),  # plain start version
        ([0], 0, 0, 0, True),
    ],
)
def test_staleness_is_measured_from_the_start(versions, learner, k, expected_staleness, fresh):
    assert staleness(versions, learner) == expected_staleness
    assert is_fresh(versions, learner, k) is fresh
    assert classify(versions, learner, k) == (Verdict.FRESH if fresh else Verdict.STALE)


def test_sample_finished_at_4_trained_at_6_is_rejected_with_k1():
    s = _sample([4, 4, 4], start_version=4)
    assert staleness(s, 6) == 2
    assert not is_fresh(s, 6, 1)
    assert is_fresh(s, 5, 1)
    assert s.staleness(6) == 2  # agrees with types.Sample.staleness


def test_sample_start_is_older_of_stamp_and_tokens():
    # start_version says 3 although tokens are all 4: the start (3) counts.
    assert start_version_of(_sample([4, 4], start_version=3)) == 3
    assert not is_fresh(_sample([4, 4], start_version=3), 4, 0)
    # An inconsistent stamp newer than a token can only make the sample look older.
    assert start_version_of(_sample([2, 4], start_version=4)) == 2
    # No tokens yet: the stamp alone.
    assert start_version_of(_sample([], start_version=5)) == 5


def test_negative_staleness_is_an_anomaly_never_fresh():
    assert staleness([6], 4) == -2
    for k in (0, 1, 2, 100):
        assert classify([6], 4, k) is Verdict.ANOMALY
        assert is_fresh([6], 4, k) is False
        assert is_fresh(_sample([5], start_version=5), 4, k) is False


@pytest.mark.parametrize(
    "versions, learner, k, err",
    [
        ([], 3, 0, ValueError),  # no tokens, no start
        ([3], -1, 0, ValueError),
        ([3], 3, -1, ValueError),
        ([3], 3, True, TypeError),
        ([3.0], 3, 0, TypeError),
        (True, 3, 0, TypeError),
    ],
)
def test_bad_inputs_raise(versions, learner, k, err):
    with pytest.raises(err):
        classify(versions, learner, k)


def test_staleness_counts():
    c = StalenessCounts()
    c = c.plus(Verdict.FRESH).plus(Verdict.FRESH).plus(Verdict.ANOMALY).plus(Verdict.STALE, 3)
    assert (c.fresh, c.stale, c.anomaly, c.total) == (2, 3, 1, 6)
    with pytest.raises(ValueError, match="stale"):
        StalenessCounts(stale=-1)


# -- Restart means restart ---------------------------------------------------


def _aborted_at_2():
    return _sample(
        [2, 2],
        start_version=2,
        tokens=np.array([11, 12], np.int32),
        logprobs=np.array([-0.5, -0.25], np.float32),
        finish=FinishReason.ABORTED,
    )


def test_restart_without_partial_rollout_keeps_nothing():
    old = _aborted_at_2()
    fresh = restart_sample(old, 3, partial=False)
    assert fresh.response_tokens.shape == (0,)
    assert fresh.token_versions.shape == (0,)
    assert fresh.behaviour_logprobs.shape == (0,)
    assert fresh.start_version == 3
    assert fresh.finish_reason == FinishReason.ABORTED
    done = extend_sample(
        fresh,
        np.array([21, 22, 23], np.int32),
        np.array([-1.0, -2.0, -3.0], np.float32),
        version=3,
        finish_reason=FinishReason.EOS,
    )
    np.testing.assert_array_equal(done.token_versions, [3, 3, 3])
    np.testing.assert_array_equal(done.response_tokens, [21, 22, 23])  # no old prefix
    np.testing.assert_array_equal(done.behaviour_logprobs, [-1.0, -2.0, -3.0])
    assert done.token_versions.dtype == np.int32 and done.response_tokens.dtype == np.int32
    assert done.start_version == 3 and done.finish_reason == FinishReason.EOS
    assert staleness(done, 3) == 0 and is_fresh(done, 3, 0)
    assert not off_policy_tokens(done.token_versions, 3).any()
    # the original is untouched
    np.testing.assert_array_equal(old.response_tokens, [11, 12])
    np.testing.assert_array_equal(old.token_versions, [2, 2])


def test_restart_with_partial_rollout_keeps_the_old_prefix_as_off_policy():
    old = _aborted_at_2()
    cont = restart_sample(old, 3, partial=True)
    assert cont.start_version == 2
    np.testing.assert_array_equal(cont.token_versions, [2, 2])
    done = extend_sample(
        cont,
        np.array([21, 22, 23], np.int32),
        np.array([-1.0, -2.0, -3.0], np.float32),
        version=3,
        finish_reason=FinishReason.LENGTH,
    )
    np.testing.assert_array_equal(done.token_versions, [2, 2, 3, 3, 3])
    np.testing.assert_array_equal(done.response_tokens, [11, 12, 21, 22, 23])
    np.testing.assert_array_equal(done.behaviour_logprobs, [-0.5, -0.25, -1.0, -2.0, -3.0])
    np.testing.assert_array_equal(
        off_policy_tokens(done.token_versions, 3), [True, True, False, False, False]
    )
    # The staleness gate still sees the version-2 prefix.
    assert staleness(done, 3) == 1
    assert not is_fresh(done, 3, 0)
    assert is_fresh(done, 3, 1)
    assert done.truncated


def test_restart_partial_with_no_tokens_starts_at_new_version():
    empty = _sample([], start_version=2, finish=FinishReason.ABORTED)
    assert restart_sample(empty, 4, partial=True).start_version == 4


def test_restart_and_extend_refuse_going_back_in_versions():
    with pytest.raises(ValueError, match="version 1 is older than its newest version 2"):
        restart_sample(_aborted_at_2(), 1, partial=True)
    with pytest.raises(ValueError, match="older than existing token"):
        extend_sample(
            _aborted_at_2(), np.array([1]), np.array([0.0]), version=1, finish_reason="eos"
        )
    with pytest.raises(ValueError, match="tokens_t has 2 entries but logprobs_t has 1"):
        extend_sample(
            _aborted_at_2(), np.array([1, 2]), np.array([0.0]), version=2, finish_reason="eos"
        )
