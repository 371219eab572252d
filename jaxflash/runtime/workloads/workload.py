"""What a run trains on: a task's prompts (RLVR) or an environment's episodes (agentic).

``runtime.loop`` runs one loop for both; ``make_workload`` picks the workload once,
from ``env.name``, and the loop calls it through ``Workload`` without asking which:

* ``runtime.workloads.task_workload.TaskWorkload``: prompts of ``data.task``, one
  response each per sample, scored by ``reward.fn`` in reward worker processes;
* ``runtime.workloads.agentic.EpisodeRollout``: a "prompt" is a group of episodes
  sharing an environment seed, played by the environment manager
  (``runtime.rollout.episode_dispatch``); the environments score them.

Each builds the rollout scheduler's dispatcher (``dispatch``), so the scheduler
never asks which, and the agentic side (``jaxflash.envs``) is imported only when
``env.name`` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxflash.replay.groups import Group
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.console import Console
from jaxflash.runtime.model_setup import load_tokenizer
from jaxflash.runtime.rollout.reward_pool import RewardPool
from jaxflash.runtime.rollout.settings import DispatchFactory
from jaxflash.runtime.workloads.evaluation import Generate
from jaxflash.runtime.workloads.learner_batch import LearnerBatch
from jaxflash.runtime.workloads.task_setup import PromptLengths
from jaxflash.runtime.workloads.task_workload import TaskWorkload


class Workload(Protocol):
    """The loop's view of what it trains on (``TaskWorkload`` or ``EpisodeRollout``).

    Attributes:
      exp: the experiment as run (a task's prompt limits derived from its data).
      tokenizer: the policy's tokenizer.
    """

    exp: ExperimentConfig
    tokenizer: Any

    def describe(self) -> str:
        """One console line: the task and reward, or the environment."""

    def prompt_lengths(self) -> PromptLengths:
        """The prompt lengths measured at start (``run_config.json``)."""

    def source(self, start: int) -> Any:
        """The scheduler's prompt source (``take(n)``, ``cursor``) from ``start``."""

    def resume(self, source: Any, open_ids: Sequence[int]) -> tuple[Any, ...]:
        """Prompts (groups) in flight at the checkpoint, generated again from scratch."""

    def reward_pool(self, clock: Clock) -> RewardPool | None:
        """The reward worker processes, started (None: the environments score)."""

    @property
    def plays_episodes(self) -> bool:
        """True: a "prompt" is a group of episodes (False: G scored samples)."""

    def dispatch(self, reward_pool: RewardPool | None) -> DispatchFactory:
        """The rollout scheduler's dispatcher factory (prompts scored by ``reward_pool``,
        or episodes scored by their environments)."""

    def batch_timeout_s(self) -> float:
        """How long the loop waits for a batch before giving up."""

    def learner_batch(
        self, groups: Sequence[Group], *, pad_id: int, max_len: int, num_sequences: int
    ) -> LearnerBatch:
        """The step's advantages and packed batch (only what carries loss)."""

    def report(self, batch: Any, tracker: Any) -> None:
        """Report the workload's own metrics of the step's ``batch`` (a rollout
        ``Batch``) to ``tracker``: an agentic run's ``episodes`` section; a task's
        samples have none."""

    @property
    def eval_size(self) -> int:
        """Held-out prompts or seeds (0: no evaluation)."""

    def describe_eval(self) -> str:
        """What one evaluation runs, e.g. "64 prompts x 4 samples"."""

    def evaluate(
        self,
        generate: Generate,
        reward_pool: RewardPool | None,
        *,
        version: int,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> dict[str, float]:
        """Held-out ``eval_accuracy`` (mean@n) and its companions at ``version``, generated
        by ``generate`` (the fleet's: ``workloads.evaluation.Generate``)."""


def make_workload(exp: ExperimentConfig, console: Console) -> Workload:
    """The run's workload, built before the model loads (each long phase on the console;
    then a line naming it and one naming the tokenizer's stop set).

    Raises:
      ConfigError: the task, its data, the reward or the environment cannot run
        (naming the fields).
    """
    if exp.env.name:  # agentic: an environment gives observations and rewards
        # Imported here: an RLVR run never loads the environments (jaxflash.envs).
        from jaxflash.runtime.workloads.agentic import EpisodeRollout  # noqa: PLC0415

        with console.phase(f"building environment {exp.env.name}"):
            workload: Workload = EpisodeRollout(exp, load_tokenizer(exp.model))
    else:
        workload = TaskWorkload.build(exp, console)
    console.line(workload.describe())
    stops = workload.tokenizer.stop_set.describe(workload.tokenizer.id_to_token)
    console.line(f"stop set (ids that end a response): {stops}")
    return workload
