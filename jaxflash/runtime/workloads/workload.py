"""What a run trains on: a task's prompts (RLVR) or an environment's episodes (agentic).

``runtime.loop`` runs one loop for both; ``make_workload`` picks the workload once,
from ``env.name``, and the loop calls it through ``Workload`` without asking which:

* ``runtime.workloads.task_workload.TaskWorkload``: prompts of ``data.task``, one
  response each per sample, scored by ``reward.fn`` in reward worker processes the
  workload owns (started with the rollout, stopped by ``close``);
* ``runtime.workloads.agentic.EpisodeRollout``: a "prompt" is a group of episodes
  sharing an environment seed, played by the environment manager
  (``runtime.rollout.episode_dispatch``); the environments score them.

Each gives the rollout its side (``rollout``: the prompt source, the prompts in flight at
the checkpoint, the dispatcher), so the scheduler never asks which, and the agentic side
(``jaxflash.envs``) is imported only when ``env.name`` is set. This module is the one
place of ``workloads/`` that reads the whole experiment: each workload takes its sections.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxflash.replay.groups import Group
from jaxflash.rewards.code_reward import CodeReward
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.config.prompt_limits import PromptLengths, prompt_lengths
from jaxflash.runtime.console import Console
from jaxflash.runtime.model_setup import load_tokenizer, make_reward, model_context
from jaxflash.runtime.rollout.settings import WorkloadRollout
from jaxflash.runtime.workloads.evaluation import Generate
from jaxflash.runtime.workloads.learner_batch import LearnerBatch
from jaxflash.runtime.workloads.task_setup import build_task, held_out_note, measure_prompts
from jaxflash.runtime.workloads.task_workload import TaskWorkload


class HeldOut(Protocol):
    """What a run evaluates on (``Workload.held_out``): held-out prompts or seeds.

    Attributes:
      unit: what ``evaluate`` counts as it goes ("samples" or "episodes").
    """

    unit: str

    @property
    def size(self) -> int:
        """Held-out prompts or seeds (0: no evaluation)."""

    def describe(self) -> str:
        """What one evaluation runs, e.g. "64 prompts x 4 samples"."""

    def evaluate(
        self, generate: Generate, *, version: int,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Held-out ``eval_accuracy`` (mean@n) and its companions at ``version``, generated
        by ``generate`` (the fleet's: ``workloads.evaluation.Generate``) and scored by the
        workload (its reward pool, or the environments)."""


class Workload(Protocol):
    """The loop's view of what it trains on (``TaskWorkload`` or ``EpisodeRollout``).

    Attributes:
      tokenizer: the policy's tokenizer.
      held_out: what evaluation runs on (``HeldOut``).
    """

    tokenizer: Any
    held_out: HeldOut

    def prompt_lengths(self) -> PromptLengths:
        """The prompt lengths measured at start (``run_config.json``)."""

    @property
    def plays_episodes(self) -> bool:
        """True: a "prompt" is a group of episodes (False: G scored samples)."""

    def rollout(self, start: int, open_ids: Sequence[int]) -> WorkloadRollout:
        """The rollout's side: the prompt source from ``start`` (a checkpoint's cursor),
        the prompts (groups) in flight at the checkpoint, generated again from scratch,
        the dispatcher (prompts scored by the workload's reward pool, started here, or
        episodes scored by their environments) and the batch timeout."""

    def learner_batch(
        self,
        groups: Sequence[Group],
        *,
        pad_id: int,
        max_len: int,
        num_sequences: int,
        length_multiple: int = 32,
    ) -> LearnerBatch:
        """The step's advantages and packed batch (only what carries loss; T rounded up
        to a multiple of ``length_multiple``)."""

    def report(self, batch: Any, tracker: Any) -> None:
        """Report the workload's own metrics of the step's ``batch`` (a rollout
        ``Batch``) to ``tracker``: an agentic run's ``episodes`` section; a task's
        samples have none."""

    def close(self) -> None:
        """Stop what the workload started (its reward workers)."""


def make_workload(
    exp: ExperimentConfig, console: Console, clock: Clock | None = None
) -> tuple[ExperimentConfig, Workload]:
    """The experiment as run (a task's prompt limits derived from its data) and the run's
    workload, built before the model loads (each long phase on the console; then a line
    naming it and one naming the tokenizer's stop set). ``clock``: the reward pool's.

    Raises:
      ConfigError: the task, its data, the reward or the environment cannot run
        (naming the fields).
    """
    if exp.env.name:  # agentic: an environment gives observations and rewards
        # Imported here: an RLVR run never loads the environments (jaxflash.envs).
        from jaxflash.runtime.workloads.agentic import EpisodeRollout  # noqa: PLC0415

        with console.phase(f"building environment {exp.env.name}"):
            episodes = EpisodeRollout(
                exp.env, load_tokenizer(exp.model), rollout=exp.rollout, eval=exp.eval,
                advantage=exp.advantage, seed=exp.seed, model=exp.model,
            )  # fmt: skip
        console.line(episodes.describe())
        workload: Workload = episodes
    else:
        exp, task = _task_workload(exp, console, clock)
        if note := held_out_note(exp.data, task.task, task.held_out.size):
            console.line(note)  # a small file: no (or a smaller) evaluation, said
        console.line(task.describe())
        workload = task
    stops = workload.tokenizer.stop_set.describe(workload.tokenizer.id_to_token)
    console.line(f"stop set (ids that end a response): {stops}")
    return exp, workload


def _task_workload(
    exp: ExperimentConfig, console: Console, clock: Clock | None
) -> tuple[ExperimentConfig, TaskWorkload]:
    """Resolves the reward, builds the task and the tokenizer, measures the prompts
    (each long phase on the console) and sets the prompt limits."""
    reward = make_reward(exp.reward)  # resolve a custom reward before the model load
    if isinstance(reward, CodeReward):  # which sandbox runs model code, in one line
        console.line(reward.sandbox().check().line)
    with console.phase(f"building task {exp.data.task}"):
        task = build_task(exp.data, seed=exp.seed)
        tokenizer = load_tokenizer(exp.model)
    measured = {"rows": 0, "of": 0}
    with console.phase(
        "measuring prompt lengths",
        lambda: f"{measured['rows']}/{measured['of']} rows rendered with the chat template",
    ):
        failures: list[str] = []
        where: list[str] = []  # each prompt's row, to name the ones too long
        lengths, every_row = measure_prompts(
            task, tokenizer, on_row=lambda i, n: measured.update(rows=i, of=n), failures=failures,
            where=where,
        )  # fmt: skip
    # A derived limit is capped at what the model's context leaves (its files' header).
    context = model_context(exp.model)
    exp, info = prompt_lengths(exp, lengths, every_row, failures, context=context, where=where)
    workload = TaskWorkload(
        task=task, reward=reward, tokenizer=tokenizer, lengths=info, data=exp.data,
        reward_spec=exp.reward, rollout=exp.rollout, eval=exp.eval, advantage=exp.advantage,
        seed=exp.seed, clock=clock,
    )  # fmt: skip
    return exp, workload
