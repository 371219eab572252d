"""Reward worker pool: deadlines, crashes, raises, order, recovery (spawned processes)."""

import os
import signal
import sys
import time

import pytest

from jaxflash.rewards import RewardResult
from jaxflash.runtime.rollout.reward_pool import RewardPool, Scored
from jaxflash.types import FailureReason


# Module-level so that spawned workers can unpickle them by reference.
def echo_reward(response_text: str, answer: str) -> RewardResult:
    """1.0 if the response equals the answer; "hang" sleeps; "raise" raises; "die" exits."""
    if response_text == "hang":
        time.sleep(60)
    if response_text == "raise":
        raise ValueError("bad response")
    if response_text == "die":
        os._exit(3)
    return RewardResult(score=1.0 if response_text == answer else 0.0)


def jax_imported_reward(response_text: str, answer: str) -> RewardResult:
    """Reports whether the worker process has imported jax (it must not)."""
    return RewardResult(score=1.0 if "jax" in sys.modules else 0.0)


def not_a_result_reward(response_text: str, answer: str) -> float:
    return 1.0


@pytest.fixture(scope="module")
def pool():
    with RewardPool(echo_reward, num_workers=2, timeout_s=1.0) as p:
        # Wait until both workers are up so that start-up never counts in timings.
        assert p.score_many([("a", "a", "warm0"), ("b", "b", "warm1")])[0].result.score == 1.0
        yield p


def test_hang_and_raise_among_normal_items(pool):
    items = [
        ("7", "7", "ok0"),
        ("hang", "7", "hung1"),
        ("8", "7", "wrong2"),
        ("raise", "7", "raise3"),
        ("9", "9", "ok4"),
        ("5", "5", "ok5"),
    ]
    t0 = time.monotonic()
    scored = pool.score_many(items)
    results = [s.result for s in scored]
    elapsed = time.monotonic() - t0
    assert elapsed < 10.0, elapsed  # a 60 s hang must not block the batch
    assert [r.score for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert [r.error is None for r in results] == [True, False, True, False, True, True]
    assert results[1].error == "timeout after 1s scoring hung1"
    assert "raise3" in results[3].error and "ValueError: bad response" in results[3].error
    R = FailureReason
    assert [s.failure for s in scored] == [None, R.REWARD_TIMEOUT, None, R.REWARD_ERROR, None, None]
    # The pool still works afterwards (the hung worker was replaced).
    again = [s.result for s in pool.score_many([("1", "1", "x"), ("2", "3", "y"), ("4", "4", "z")])]
    assert [r.score for r in again] == [1.0, 0.0, 1.0]
    assert all(r.error is None for r in again)


def test_dead_worker_is_replaced(pool):
    scored = pool.score_many([("die", "1", "dead0"), ("3", "3", "ok1")])
    assert scored[0].result.score == 0.0
    assert scored[0].result.error == "reward worker died (exit code 3) scoring dead0"
    assert scored[0].failure == FailureReason.REWARD_CRASH
    assert scored[1] == Scored(RewardResult(score=1.0), None)
    assert pool.score_many([("6", "6", "after")])[0].result.score == 1.0


def test_ctrl_c_does_not_kill_a_worker():
    # Ctrl-C goes to the whole process group; the run's process closes the pool, so a
    # worker must not die from it (it printed a KeyboardInterrupt traceback).
    with RewardPool(echo_reward, num_workers=2, timeout_s=5.0) as p:
        deadline = time.monotonic() + 60
        while not all(w.ready for w in p._workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = list(p._workers)
        for worker in workers:
            os.kill(worker.process.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(w.process.is_alive() for w in workers)
        scored = p.score_many([("2", "2", "a"), ("3", "3", "b")])
        assert [s.result.score for s in scored] == [1.0, 1.0]
        assert all(s.failure is None for s in scored) and p._workers == workers


def test_submit_resolves_per_item(pool):
    futures = [pool.submit(("2", "2", "s0")), pool.submit(("2", "1", "s1"))]
    assert [f.result(timeout=30).result.score for f in futures] == [1.0, 0.0]


def test_timeout_retried_then_dropped():
    with RewardPool(echo_reward, num_workers=1, timeout_s=0.5, max_retries=1) as p:
        t0 = time.monotonic()
        (scored,) = p.score_many([("hang", "1", "h")])
        # Two attempts of 0.5 s each, plus one worker restart in between.
        assert time.monotonic() - t0 >= 1.0
        assert scored.result.error == "timeout after 0.5s scoring h"
        assert scored.failure == FailureReason.REWARD_TIMEOUT
        assert p.score_many([("1", "1", "ok")])[0].result.score == 1.0


def test_workers_do_not_import_jax_and_names_resolve():
    with RewardPool(jax_imported_reward, num_workers=1, timeout_s=30.0) as p:
        assert p.score_many([("", "", 0)])[0].result.score == 0.0
    with RewardPool("math", num_workers=1, timeout_s=30.0) as p:
        scored = p.score_many([("so the answer is \\boxed{5}", "5", 0), ("5", "6", 1)])
        assert [s.result.score for s in scored] == [1.0, 0.0]
        assert [s.failure for s in scored] == [None, None]  # a wrong answer is no failure


def test_reward_returning_wrong_type_is_an_error():
    with RewardPool(not_a_result_reward, num_workers=1, timeout_s=30.0) as p:
        (scored,) = p.score_many([("x", "y", "item9")])
    assert scored.result.score == 0.0 and scored.failure == FailureReason.REWARD_ERROR
    assert "item9" in scored.result.error and "not RewardResult" in scored.result.error


def test_bad_arguments_and_closed_pool():
    with pytest.raises(KeyError, match="no_such_reward"):
        RewardPool("no_such_reward", num_workers=1, timeout_s=1.0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool("math", num_workers=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool("math", num_workers=1, timeout_s=0.0)
    p = RewardPool("math", num_workers=1, timeout_s=1.0)
    with pytest.raises(TypeError, match="item7"):
        p.submit((None, "1", "item7"))
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(("1", "1", 0))


def test_close_resolves_in_flight_and_queued_items():
    p = RewardPool(echo_reward, num_workers=1, timeout_s=30.0)
    assert p.score_many([("1", "1", "warm")])[0].result.score == 1.0
    hung, queued = p.submit(("hang", "1", "h0")), p.submit(("1", "1", "q1"))
    time.sleep(0.2)
    p.close()
    hung, queued = hung.result(timeout=10), queued.result(timeout=10)
    assert hung.result.error == "reward pool closed while scoring h0"
    assert queued.result.error == "reward pool closed before scoring q1"
    assert hung.failure == queued.failure == FailureReason.REWARD_UNAVAILABLE
