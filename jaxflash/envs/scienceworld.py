"""ScienceWorld (arXiv 2203.07540) as a text environment: partial-credit science tasks.

Each step is a real call into the ScienceWorld simulator (a JVM per environment in
use, pooled and reused: ``envs.scienceworld_sim``); the reward is its partial-credit
score.

Task subset and split. ``tasks`` names the task types played (default
``DEFAULT_TASKS``: the four "find" tasks and the two lifespan tasks, whose credit
starts within a few actions -- opening the right door is worth 8 of 100 -- and whose
gold paths are 5-10 actions). Episode ``seed`` plays task ``tasks[seed % T]``,
variation ``V[(seed // T) % len(V)]`` where ``V`` is the task's variation list of
the split: ScienceWorld's own train variations for ``split="train"`` and its dev
variations for ``split="eval"`` (disjoint by the benchmark's construction; its test
variations are left untouched). With the default tasks that is 150 train / 75 dev
variations per find task and 62 / 31 per lifespan task.

Reward. The simulator's score is an integer in [0, 100] (-100 once the task failed,
e.g. after focusing on a wrong object). The score is clipped at 0 and scaled to
[0, 1]; a step's reward is the change of that scaled score, so an episode's return
is (final clipped score - score at reset) / 100: the credit its actions earned (a
failed task loses what it had reached; under "easy" the open doors are worth 8 at
reset already, so the return is at most 0.92 there). ``info["score"]`` is the raw
score; ``info["success"]`` is score == 100.

Actions. The action is the reply's first non-empty line, lower-cased, without
surrounding quotes or backticks, a leading ``>`` or ``action:`` and a trailing
period. An empty action or one longer than ``max_action_chars`` is invalid
(``invalid_action_penalty``, ``info["invalid_action"]``, no simulator step). A
well-formed action the simulator does not understand is a real step (it costs a
move and returns "No known action matches that input."; ``info["unknown_action"]``).

Failures. A JVM that crashes or hangs past ``step_timeout_s`` is killed and the
call raises ``SimulatorDied``: the episode ends as an environment failure
(``envs.base.checked_step`` → RAISED), counted by the runtime; the JVM is never
reused.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from jaxflash.envs.base import EnvConfig, StepResult
from jaxflash.envs.scienceworld_sim import Simulator, SimulatorPool, default_pool

DEFAULT_TASKS = (
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "find-animal",
    "lifespan-longest-lived",
    "lifespan-shortest-lived",
)
_SPLIT_METHOD = {"train": "get_variations_train", "eval": "get_variations_dev"}
_UNKNOWN = "No known action matches that input."
_PREFIX = re.compile(r"^(?:>\s*|action\s*:\s*)", re.IGNORECASE)

_INSTRUCTIONS = (
    "You are an agent in ScienceWorld, a text simulation. Each turn, reply with exactly "
    "one action and nothing else. Useful actions: look around, open door to LOCATION, "
    "go to LOCATION, teleport to LOCATION, look at OBJECT, pick up OBJECT, "
    "move OBJECT to CONTAINER, focus on OBJECT, inventory, wait1. Focus only on the "
    "object the task asks for: focusing on a wrong one fails the task."
)


def _known_tasks() -> tuple[str, ...]:
    try:
        from scienceworld.constants import ID2TASK  # noqa: PLC0415 -- optional dependency
    except ImportError as e:
        raise ImportError(
            "the scienceworld environment needs `pip install scienceworld==1.2.3` "
            "(pip install 'jaxflash[scienceworld]') and Java >= 11 on PATH"
        ) from e
    return tuple(ID2TASK.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScienceWorldConfig(EnvConfig):
    """ScienceWorld knobs (plus the common limits of ``EnvConfig``).

    Attributes:
      tasks: comma-separated ScienceWorld task names (module docstring).
      split: "train" (ScienceWorld's train variations) or "eval" (its dev ones).
      simplifications: ScienceWorld's simplification string ("easy": teleport,
        open doors and containers, self-watering pots, no electrical actions; ""
        for none; or a comma-separated subset).
      max_action_chars: a longer action is invalid (>= 1).
      step_timeout_s: also the watchdog of every simulator call: a JVM still busy
        after it is killed.
    """

    max_turns: int = 10
    max_tokens_per_turn: int = 24
    step_timeout_s: float = 60.0
    invalid_action_penalty: float = -0.01
    tasks: str = ",".join(DEFAULT_TASKS)
    split: Literal["train", "eval"] = "train"
    simplifications: str = "easy"
    max_action_chars: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        known = _known_tasks()
        names = self.task_names
        self.require("tasks", bool(names), "a non-empty comma-separated list of task names")
        unknown = [t for t in names if t not in known]
        self.require("tasks", not unknown, f"task names among {known} (unknown: {unknown})")
        self.require("max_action_chars", self.max_action_chars >= 1, "an int >= 1")

    @property
    def task_names(self) -> tuple[str, ...]:
        """The task names of ``tasks``, in order."""
        return tuple(t.strip() for t in self.tasks.split(",") if t.strip())


def parse_action(text: str, max_chars: int) -> str | None:
    """The action of a reply (module docstring), or None when it is empty or too long."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = _PREFIX.sub("", line).strip().strip("`'\"").strip().rstrip(".").strip()
    if not line or len(line) > max_chars:
        return None
    return line.lower()


class ScienceWorldEnv:
    """ScienceWorld tasks over text; ``reset(seed)`` plays (task, variation) of the split.

    Args:
      config: tasks, split and limits.
      pool: where simulators come from (default: the process's shared pool).

    Raises (from ``reset`` / ``step``; ``checked_*`` turn them into failures):
      SimulatorDied: the JVM crashed or hung past ``config.step_timeout_s``.
      RuntimeError: ``step`` before ``reset`` or after the episode ended.
    """

    def __init__(
        self, config: ScienceWorldConfig | None = None, *, pool: SimulatorPool | None = None
    ):
        self.config = config or ScienceWorldConfig()
        self._pool = pool or default_pool()
        self._sim: Simulator | None = None
        self._score = 0  # clipped score of the last step, in [0, 100]
        self._done = True
        self.task: tuple[str, int] | None = None  # (task name, variation) of the episode

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self._sim is not None
        try:
            return self._sim.call(self.config.step_timeout_s, method, *args, **kwargs)
        except Exception:
            self._sim.kill()  # state unknown after a failed call: never reuse this JVM
            raise

    def _variations(self, task: str) -> tuple[int, ...]:
        def ask() -> tuple[int, ...]:
            self._call("load", task, 0, "")
            found = tuple(int(v) for v in self._call(_SPLIT_METHOD[self.config.split]))
            if not found:
                raise RuntimeError(
                    f"ScienceWorld task {task!r} has no {self.config.split} variations"
                )
            return found

        return self._pool.remember((task, self.config.split), ask)

    def task_of(self, seed: int) -> tuple[str, int]:
        """(task name, variation) episode ``seed`` plays (needs a simulator the first time)."""
        if seed < 0:
            raise ValueError(f"ScienceWorldEnv: seed must be >= 0, got {seed}")
        names = self.config.task_names
        task = names[seed % len(names)]
        variations = self._variations(task)
        return task, variations[(seed // len(names)) % len(variations)]

    def reset(self, seed: int) -> str:
        """Load the seed's task variation; returns the instructions, the task and the room."""
        if self._sim is None:
            self._sim = self._pool.acquire()
        task, variation = self.task = self.task_of(seed)
        self._call("load", task, variation, self.config.simplifications)
        look, info = self._call("reset")
        description = self._call("get_task_description")
        # Credit already given at the start (open doors under "easy": 8) is not earned.
        self._score, self._done = max(int(info.get("score", 0)), 0), False
        return f"{_INSTRUCTIONS}\nTask: {description.strip()}\n{look.strip()}"

    def step(self, action_text: str) -> StepResult:
        """One turn: parse the action, step the simulator (if valid), reward the score change."""
        if self._sim is None or self._done:
            raise RuntimeError("ScienceWorldEnv: call reset(seed) before step (and after an end)")
        action = parse_action(action_text, self.config.max_action_chars)
        if action is None:
            obs = (
                f"Invalid action: reply with one action of at most "
                f"{self.config.max_action_chars} characters, e.g. look around."
            )
            info = {"invalid_action": True, "action": None, "score": self._score}
            return StepResult(obs, float(self.config.invalid_action_penalty), False, False, info)
        obs, _, completed, sim_info = self._call("step", action)
        raw = int(sim_info["score"])
        score = max(raw, 0)
        reward, self._score = (score - self._score) / 100.0, score
        self._done = bool(completed)
        info = {
            "invalid_action": False,
            "unknown_action": obs.strip() == _UNKNOWN,
            "action": action,
            "score": raw,
            "success": raw >= 100,
            "moves": int(sim_info["moves"]),
        }
        return StepResult(obs.strip(), reward, self._done, False, info)

    def close(self) -> None:
        """Return the simulator to the pool (a dead one is discarded there)."""
        sim, self._sim, self._done = self._sim, None, True
        if sim is not None:
            self._pool.release(sim)
