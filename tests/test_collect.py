"""runtime.collect: per-attempt deadline, retries, no silent hang (rl_pitfalls.md)."""

import threading
import time

import pytest

from jaxflash.runtime.collect import abandoned_threads_alive, collect


@pytest.fixture
def release():
    """An event hung tasks wait on; set at teardown so abandoned threads exit."""
    ev = threading.Event()
    yield ev
    ev.set()
    deadline = time.monotonic() + 5.0
    while abandoned_threads_alive() and time.monotonic() < deadline:
        time.sleep(0.01)


def _value(i):
    return lambda: i * 10


def test_no_silent_hang_8_tasks_one_hangs_one_raises(release):
    calls = {"t3": 0, "t5": 0}

    def hang():
        calls["t3"] += 1
        release.wait()  # never returns while the test runs
        return "too late"

    def boom():
        calls["t5"] += 1
        raise RuntimeError("boom")

    tasks = {f"t{i}": _value(i) for i in range(8)}
    tasks["t3"], tasks["t5"] = hang, boom
    before = abandoned_threads_alive()
    t0 = time.monotonic()
    res = collect(tasks, deadline_s=0.5, max_retries=1)
    wall = time.monotonic() - t0
    # two 0.5 s attempts of the hung task ~ 1.0 s; generous bound for a loaded machine
    assert 0.9 <= wall < 3.0, wall
    assert res.results == {"t0": 0, "t1": 10, "t2": 20, "t4": 40, "t6": 60, "t7": 70}
    assert res.shortfall == 2
    assert list(res.dropped) == ["t3", "t5"]
    assert "task 't3' dropped after 2 attempt(s)" in res.dropped["t3"]
    assert "timed out after 0.5 s" in res.dropped["t3"]
    assert "task 't5' dropped after 2 attempt(s)" in res.dropped["t5"]
    assert "RuntimeError: boom" in res.dropped["t5"]
    assert sorted(res.failures) == [
        "task 't3' attempt 1/2: timed out after 0.5 s",
        "task 't3' attempt 2/2: timed out after 0.5 s",
        "task 't5' attempt 1/2: RuntimeError: boom",
        "task 't5' attempt 2/2: RuntimeError: boom",
    ]
    assert (res.attempts, res.timeouts, res.errors, res.abandoned) == (10, 2, 2, 2)
    assert calls == {"t3": 2, "t5": 2}
    assert abandoned_threads_alive() == before + 2  # still hung, counted, not joined

    # A later call is not blocked by the abandoned threads.
    t0 = time.monotonic()
    res2 = collect({f"u{i}": _value(i) for i in range(4)}, deadline_s=0.5, max_retries=0)
    assert time.monotonic() - t0 < 1.0
    assert res2.results == {"u0": 0, "u1": 10, "u2": 20, "u3": 30}
    assert res2.shortfall == 0 and res2.failures == () and res2.abandoned == 0

    release.set()
    deadline = time.monotonic() + 5.0
    while abandoned_threads_alive() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned_threads_alive() == before  # their late answers went nowhere


def test_retry_recovers_from_an_error_and_a_timeout(release):
    tries = {"flaky": 0, "slow_once": 0}

    def flaky():
        tries["flaky"] += 1
        if tries["flaky"] == 1:
            raise ValueError("transient")
        return "ok"

    def slow_once():
        tries["slow_once"] += 1
        if tries["slow_once"] == 1:
            release.wait()
        return "second try"

    res = collect({"flaky": flaky, "slow_once": slow_once}, deadline_s=0.2, max_retries=1)
    assert res.results == {"flaky": "ok", "slow_once": "second try"}
    assert res.dropped == {}
    assert sorted(res.failures) == [
        "task 'flaky' attempt 1/2: ValueError: transient",
        "task 'slow_once' attempt 1/2: timed out after 0.2 s",
    ]
    assert (res.attempts, res.timeouts, res.errors) == (4, 1, 1)


def test_hung_attempt_frees_its_worker_slot(release):
    # One worker: the hung first task must not block the others behind it.
    tasks = {"hang": release.wait, "a": _value(1), "b": _value(2)}
    t0 = time.monotonic()
    res = collect(tasks, deadline_s=0.3, max_retries=0, max_workers=1)
    assert time.monotonic() - t0 < 2.0
    assert res.results == {"a": 10, "b": 20}
    assert res.dropped == {
        "hang": "task 'hang' dropped after 1 attempt(s); last: timed out after 0.3 s"
    }


def test_results_keep_task_order_and_zero_retries():
    res = collect({"z": _value(1), "a": _value(2), "m": _value(3)}, deadline_s=1.0, max_retries=0)
    assert list(res.results) == ["z", "a", "m"]
    empty = collect({}, deadline_s=1.0, max_retries=0)
    assert (empty.results, empty.dropped, empty.attempts) == ({}, {}, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(deadline_s=0, max_retries=0), "deadline_s"),
        (dict(deadline_s=1.0, max_retries=-1), "max_retries"),
        (dict(deadline_s=1.0, max_retries=True), "max_retries"),
        (dict(deadline_s=1.0, max_retries=0, max_workers=0), "max_workers"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        collect({"a": _value(1)}, **kwargs)
    with pytest.raises(ValueError, match="task 'b' is not callable"):
        collect({"b": 3}, deadline_s=1.0, max_retries=0)
