"""Chaos soak (bounded): generation programs SIGKILLed at a seeded rate while a reward
hangs on a set share of responses; the run completes and its books balance.

The controller and learner run in this test process; two generation programs
are child processes (``runtime.fleet.gen_program``). A killer thread SIGKILLs one of
them at seeded exponential intervals (mean ``KILL_MEAN_S``, at most
``MAX_KILLS``), only while the other one serves, so the run always has a server;
the reward (``tests.reward_fixtures.chaos_reward``) hangs on the share
``CHAOS_HANG_RATE`` of responses (by their hash) and the reward pool's deadline
fails those prompts as ``reward_timeout``.
"""

import json
import os
import random
import signal
import threading
import time

import pytest

from configs import smoke_async
from jaxflash.runtime import loop as rlvr
from jaxflash.runtime.config.experiment import ExperimentConfig
from tests.kill_campaign import check_books, rows
from tests.reward_fixtures import chaos_hangs

SEED = 11
STEPS = 24
KILL_MEAN_S = 6.0
MAX_KILLS = 4
NAMES = ("gen0", "gen1")


def _config() -> ExperimentConfig:
    c = smoke_async.get_config()  # learner 6 devices, two 1-device generation programs
    c.total_steps = STEPS
    c.data.eval_size = 0  # evaluation needs an engine in the controller's process
    c.rollout.async_ratio = 1
    c.checkpoint.every = 8
    c.mesh.generation_processes = True
    c.reward.fn = "tests.reward_fixtures:chaos_reward"
    c.reward.timeout_s = 1.0  # a hung reward costs a second
    return ExperimentConfig.from_config_dict(c)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class GenKiller(threading.Thread):
    """SIGKILLs a generation program at seeded exponential intervals, while the other serves.

    A program serves when the last ``up`` event of its log (``<gen_dir>/<name>.jsonl``:
    it holds the current weights) has no ``died`` after it and its process is alive.
    """

    def __init__(self, gen_dir: str):
        super().__init__(name="gen-killer", daemon=True)
        self.gen_dir = gen_dir
        self.kills: list[dict] = []
        self.stopped = threading.Event()

    def _serving_pid(self, name: str) -> int | None:
        path = os.path.join(self.gen_dir, f"{name}.jsonl")
        events = rows(path) if os.path.exists(path) else []
        ups = [i for i, e in enumerate(events) if e["event"] == "up"]
        if not ups or any(e["event"] == "died" for e in events[ups[-1] :]):
            return None
        pid = int(events[ups[-1]]["pid"])
        return pid if _alive(pid) else None

    def run(self) -> None:
        rng = random.Random(SEED)
        while len(self.kills) < MAX_KILLS and not self.stopped.wait(
            rng.expovariate(1 / KILL_MEAN_S)
        ):
            name = rng.choice(NAMES)
            other = NAMES[1 - NAMES.index(name)]
            pid = self._serving_pid(name)
            if pid is None or self._serving_pid(other) is None:
                continue  # never both at once: the run must keep a server
            os.kill(pid, signal.SIGKILL)
            self.kills.append({"name": name, "pid": pid, "t": time.time()})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_soak_completes_and_its_counters_add_up(tmp_path, monkeypatch):
    # The generation programs (children) compile from a cache after their first start.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    workdir = str(tmp_path / "run")
    killer = GenKiller(os.path.join(workdir, "generation"))
    killer.start()
    t0 = time.monotonic()
    try:
        last = rlvr.run(_config(), workdir=workdir)
    finally:
        killer.stopped.set()
        killer.join(5)
    print(f"soak: {time.monotonic() - t0:.0f}s, kills {killer.kills}")

    # It ran to the end; every kill was seen once, as the death of that process.
    assert last["policy_version"] == STEPS
    assert len(killer.kills) >= 2, "the run ended before the killer got going"
    assert last["server_failures"] == len(killer.kills)
    assert last.get("server_recoveries", 0) <= last["server_failures"]
    for name in NAMES:
        events = rows(os.path.join(workdir, "generation", f"{name}.jsonl"))
        died = [e for e in events if e["event"] == "died"]
        assert len(died) == sum(k["name"] == name for k in killer.kills), name

    # Books: the generic balance (nothing lost, nothing trained twice) ...
    check_books(workdir, STEPS, 2, max_in_flight=2 * 4)  # (α + 1)·B
    failed = last["prompt_outcomes"]["failed"]
    assert sum(failed.values()) == last["prompts_failed"]
    assert failed.get("reward_timeout", 0) >= 1, failed
    # ... and every hanging response failed its prompt as reward_timeout, and nothing else did.
    rollouts = rows(os.path.join(workdir, "rollouts.jsonl"))
    for r in rollouts:
        if chaos_hangs(r["response"]):
            assert (r["outcome"], r["failure"]) == ("failed", "reward_timeout"), r
    timed_out = {r["prompt_id"] for r in rollouts if r["failure"] == "reward_timeout"}
    hung = {r["prompt_id"] for r in rollouts if chaos_hangs(r["response"])}
    assert timed_out == hung and len(timed_out) == failed["reward_timeout"]
    assert set(failed) == {"reward_timeout"}, failed  # no other failure was caused
    print(json.dumps({k: last[k] for k in sorted(last) if k.startswith(("prompts_", "server_"))}))
