"""The reward worker process: what runs in each child of ``RewardPool``.

A worker imports ``jaxflash.rewards`` only (not jax), resolves the reward, says it
is ready, then scores one item at a time from its pipe until it receives None.
Whatever the reward does -- returns a result, returns the wrong type, raises --
the parent gets a ``RewardResult`` back (score 0.0 and ``error`` set on failure).
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from jaxflash.rewards.base import RewardResult, as_reward_fn

READY = "ready"
STARTUP_ERROR = "startup_error"


class RewardItem(NamedTuple):
    """One response to score; any 3-tuple (response_text, answer, item_id) works."""

    response_text: str
    answer: str
    item_id: Any


def worker_main(conn: Connection, reward_spec: Any) -> None:
    """Worker process: resolve the reward, say ready, then score items until None.

    Args:
      conn: this worker's end of a duplex pipe to the pool.
      reward_spec: a registry name, {name: weight} or a picklable callable.
    """
    # Ctrl-C reaches the whole process group; the run's process closes the pool (None,
    # or the pipe's EOF), so a worker ignores it instead of dying with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = as_reward_fn(reward_spec)
    except BaseException as e:  # report why the worker cannot start, then exit
        conn.send((STARTUP_ERROR, f"{type(e).__name__}: {e}"))
        return
    conn.send(READY)
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the pool went away
            return
        if msg is None:
            return
        response_text, answer, item_id = msg
        try:
            result = fn(response_text, answer)
            if not isinstance(result, RewardResult):
                raise TypeError(f"reward returned {type(result).__name__}, not RewardResult")
        except BaseException as e:
            result = RewardResult(
                score=0.0, error=f"reward raised scoring {item_id}: {type(e).__name__}: {e}"
            )
        conn.send(result)
