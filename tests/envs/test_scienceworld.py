"""ScienceWorld: action parsing, the score as reward, the split, and dead/hung JVMs counted.

One real JVM for the module (``real_pool``; ~2 s to start, ~0.1 s a step); the hang
and crash paths also run on test doubles, so no test waits on a real hang.
"""

import threading

import pytest

pytest.importorskip("scienceworld")

from jaxflash.envs.base import EnvFailureReason, checked_reset, checked_step  # noqa: E402
from jaxflash.envs.registry import env_config, make_env  # noqa: E402
from jaxflash.envs.scienceworld import (  # noqa: E402
    ScienceWorldConfig,
    ScienceWorldEnv,
    parse_action,
)
from jaxflash.envs.scienceworld_sim import SimulatorDied, SimulatorPool  # noqa: E402


@pytest.mark.parametrize(
    "text, want",
    [
        ("open door to kitchen", "open door to kitchen"),
        ("  Go to Kitchen.\nbecause it is there", "go to kitchen"),
        ("\n\n> look around", "look around"),
        ("Action: `focus on dove`", "focus on dove"),
        ('"inventory"', "inventory"),
        ("", None),
        ("  \n ", None),
        ("x" * 101, None),
    ],
)
def test_parse_action_takes_the_first_line(text, want):
    assert parse_action(text, 100) == want


def test_config_refuses_unknown_tasks_naming_them():
    with pytest.raises(ValueError, match="boill"):
        env_config("scienceworld", tasks="boil,boill")
    assert env_config("scienceworld", tasks=" boil , melt").task_names == ("boil", "melt")


class FakeProc:
    """The JVM's Popen, as far as the pool looks at it."""

    def __init__(self):
        self.killed = threading.Event()

    def poll(self):
        return 137 if self.killed.is_set() else None

    def kill(self):
        self.killed.set()


class FakeSim:
    """A ScienceWorldEnv double: ``hang`` blocks a step until killed; ``crash`` exits."""

    def __init__(self, mode=""):
        self.mode, self.proc = mode, FakeProc()
        self.killed = self.proc.killed
        self._gateway = type("Gateway", (), {"java_process": self.proc})()

    def load(self, task, variation, simplifications=""):
        self.task = task

    def get_variations_train(self):
        return [3, 5]

    def get_variations_dev(self):
        return [7]

    def reset(self):
        return "This room is called the hallway.", {"score": 0}

    def get_task_description(self):
        return "Your task is to find a(n) plant."

    def step(self, action):
        if self.mode == "hang":
            self.killed.wait(30)
            raise ConnectionError("py4j: answer from the Java side is empty")
        if self.mode == "crash":
            self.killed.set()  # the process is gone
            raise ConnectionError("py4j: an error occurred while calling o0.step")
        return "You move.", 0, False, {"score": 8, "moves": 1}

    def close(self):
        self.proc.kill()


@pytest.mark.parametrize("mode", ["hang", "crash"])
def test_hung_or_crashed_simulator_fails_the_call_and_is_never_reused(mode):
    sims = []

    def start():
        sims.append(FakeSim(mode if not sims else ""))
        return sims[-1]

    pool = SimulatorPool(start)
    config = ScienceWorldConfig(tasks="find-plant", step_timeout_s=0.2)
    env = ScienceWorldEnv(config, pool=pool)
    assert checked_reset(env, 1).observation.endswith("hallway.")
    assert env.task == ("find-plant", 5)  # train variations [3, 5]; seed 1 -> the second
    out = checked_step(env, "go to greenhouse")
    assert out.failure.reason == EnvFailureReason.RAISED and "SimulatorDied" in out.failure.detail
    env.close()
    assert pool.counters["discarded"] == 1 and pool.idle() == 0
    # The next episode gets a new JVM, which works.
    env = ScienceWorldEnv(config, pool=pool)
    env.reset(0)
    assert env.step("go to greenhouse").reward == pytest.approx(0.08)
    env.close()
    assert pool.counters["started"] == 2 and pool.idle() == 1


def test_dead_simulator_is_refused_before_the_call():
    pool = SimulatorPool(FakeSim)
    sim = pool.acquire()
    sim.kill()
    with pytest.raises(SimulatorDied):
        sim.call(1.0, "reset")
    pool.release(sim)
    assert pool.counters["discarded"] == 1 and pool.idle() == 0


@pytest.fixture(scope="module")
def real_pool():
    pool = SimulatorPool(max_idle=1)
    yield pool
    pool.close()


@pytest.mark.slow
def test_real_simulator_gold_path_scores_one_and_reuses_the_jvm(real_pool):
    env = ScienceWorldEnv(ScienceWorldConfig(tasks="find-non-living-thing"), pool=real_pool)
    first = env.reset(0)
    assert "Task: Your task is to find a(n) non-living thing." in first and "hallway" in first
    task, variation = env.task
    sim = env._sim
    # The simulator's own gold path for this variation (a fresh load to ask for it).
    sim.env.load(task, variation, "easy", generateGoldPath=True)
    gold = sim.env.get_gold_action_sequence()
    env.reset(0)
    bad = env.step("")  # invalid: no simulator step
    assert bad.info["invalid_action"] and bad.reward == -0.01
    unknown = env.step("xyzzy the plugh")
    assert unknown.info["unknown_action"] and unknown.reward == 0.0
    rewards, result = [], None
    for action in gold:
        result = env.step(action)
        rewards.append(result.reward)
    assert result.terminated and result.info["success"] and result.info["score"] == 100
    # "easy" opens the doors: 8 of the 100 are there at reset and not earned.
    assert sum(rewards) == pytest.approx(0.92) and min(rewards) >= 0
    env.close()
    # The next episode (another variation of the eval split) reuses the JVM.
    env = make_env("scienceworld", tasks="find-non-living-thing", split="eval")
    env._pool = real_pool
    env.reset(0)
    assert env._sim is sim and env.task[1] != variation
    env.close()
    assert real_pool.counters["started"] == 1 and real_pool.counters["reused"] == 1


@pytest.mark.slow
def test_real_jvm_killed_mid_episode_is_a_counted_failure(real_pool):
    env = ScienceWorldEnv(ScienceWorldConfig(tasks="find-plant"), pool=real_pool)
    env.reset(3)
    env._sim.env._gateway.java_process.kill()
    env._sim.env._gateway.java_process.wait(10)
    out = checked_step(env, "look around")
    assert out.failure.reason == EnvFailureReason.RAISED and "SimulatorDied" in out.failure.detail
    discarded = real_pool.counters["discarded"]
    env.close()
    assert real_pool.counters["discarded"] == discarded + 1 and real_pool.idle() == 0
