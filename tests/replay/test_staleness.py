"""Staleness gate and policy clock (rl_pitfalls.md, "Asynchrony").

"Restart means restart" is tested where samples restart: tests/runtime/test_partial_rollout.py
(SlotBatcher's in-flight policies) and tests/learner/test_learner.py (off-policy tokens)."""

import threading

import numpy as np
import pytest

from jaxflash.replay.staleness import (
    StalenessCounts,
    Verdict,
    classify,
    is_fresh,
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


def test_clock_reads_are_monotone_across_threads():
    clock = PolicyClock(3)
    seen: list[int] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            seen.append(clock.version)

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in readers:
        t.start()
    for v in range(4, 201):
        clock.publish(v)
    stop.set()
    for t in readers:
        t.join(5.0)
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
