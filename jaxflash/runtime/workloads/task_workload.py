"""The RLVR workload: prompts of a task, scored by the run's reward in worker processes.

One of the two workloads ``runtime.loop`` runs (``runtime.workloads.workload``; the other is
``runtime.agentic.EpisodeRollout``). Built before the model loads, so everything
the config names fails in seconds: the reward (``model_setup.make_reward``), the
task (``task_setup.build_task``), the tokenizer, and the prompt limits measured
from the data (``task_setup.measure_prompts`` + ``prompt_lengths``).
Per run it gives the loop the prompt source (its cursor in the checkpoint), the
prompts in flight at a checkpoint (rendered again), the reward pool, the rollout's
dispatcher (``rollout.dispatch.prompt_dispatch``), the learner
batch (per-group advantages, the truncation mask: ``runtime.workloads.learner_batch``) and
the held-out accuracy (``runtime.workloads.evaluation``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxflash.algorithms.advantages import get_advantage_estimator
from jaxflash.data.prompts import PromptFailure, PromptSource
from jaxflash.data.tasks import TaskData
from jaxflash.replay.groups import Group
from jaxflash.rewards.code_reward import CodeReward
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.console import Console
from jaxflash.runtime.model_setup import load_tokenizer, make_reward
from jaxflash.runtime.rollout.dispatch import prompt_dispatch
from jaxflash.runtime.rollout.reward_pool import RewardPool
from jaxflash.runtime.rollout.scoring import Scorer, TruncationPolicy
from jaxflash.runtime.rollout.settings import DispatchFactory
from jaxflash.runtime.workloads.evaluation import evaluate
from jaxflash.runtime.workloads.learner_batch import LearnerBatch, learner_batch
from jaxflash.runtime.workloads.task_setup import (
    PromptLengths,
    build_task,
    eval_prompts,
    held_out_note,
    measure_prompts,
    prompt_by_id,
    prompt_lengths,
)
from jaxflash.types import Prompt


class TaskWorkload:
    """Prompts of ``data.task`` scored by ``reward.fn`` (RLVR).

    Args:
      exp: the experiment with its prompt limits set (``task_setup.prompt_lengths``).
      task: its task (``task_setup.build_task``).
      reward: the resolved reward (``model_setup.make_reward``: a name, weights or a
        callable, as ``RewardPool`` takes it).
      tokenizer: the policy's tokenizer (chat template, stop ids).
      lengths: the prompt lengths measured.
    """

    def __init__(
        self,
        exp: ExperimentConfig,
        *,
        task: TaskData,
        reward: Any,
        tokenizer: Any,
        lengths: PromptLengths,
    ) -> None:
        self.exp, self.task, self.reward, self.tokenizer = exp, task, reward, tokenizer
        self.lengths = lengths
        self.held_out = eval_prompts(task, tokenizer, exp.data.max_prompt_tokens)
        r = exp.rollout
        self.truncation = TruncationPolicy(mode=r.truncation, penalty=r.truncation_penalty)
        self.advantage_fn = get_advantage_estimator(exp.advantage)

    @classmethod
    def build(cls, exp: ExperimentConfig, console: Console) -> TaskWorkload:
        """Resolves the reward, builds the task and the tokenizer, measures the prompts
        (each long phase on the console) and sets the prompt limits.

        Raises:
          ConfigError: the reward, the task, its data or the prompt limits cannot run
            (naming the fields).
        """
        reward = make_reward(exp.reward)  # resolve a custom reward before the model load
        if isinstance(reward, CodeReward):  # which sandbox runs model code, in one line
            console.line(reward.sandbox().check().line)
        with console.phase(f"building task {exp.data.task}"):
            task = build_task(exp)
            tokenizer = load_tokenizer(exp.model)
        measured = {"rows": 0, "of": 0}
        with console.phase(
            "measuring prompt lengths",
            lambda: f"{measured['rows']}/{measured['of']} rows rendered with the chat template",
        ):
            failures: list[str] = []
            lengths, every_row = measure_prompts(
                task,
                tokenizer,
                on_row=lambda i, n: measured.update(rows=i, of=n),
                failures=failures,
            )
        exp, info = prompt_lengths(exp, lengths, every_row, failures)
        workload = cls(exp, task=task, reward=reward, tokenizer=tokenizer, lengths=info)
        if note := held_out_note(exp, task, len(workload.held_out)):
            console.line(note)  # a small file: no (or a smaller) evaluation, said
        return workload

    def describe(self) -> str:
        """One console line."""
        e = self.exp
        return f"task {e.data.task}, reward {e.reward.fn}; {self.lengths.describe()}"

    def prompt_lengths(self) -> PromptLengths:
        """The prompt lengths measured (``run_config.json``)."""
        return self.lengths

    # ------------------------------------------------------------------ the scheduler's parts

    def source(self, start: int) -> PromptSource:
        """The training prompts from row ``start`` (a checkpoint's data cursor)."""
        train = self.task.train
        return PromptSource(
            train,
            self.tokenizer,
            max_prompt_tokens=self.exp.data.max_prompt_tokens,
            start=start,
            cycle=not callable(train),  # a file is read in epochs; ids keep growing
        )

    def resume(
        self, source: PromptSource, open_ids: Sequence[int]
    ) -> tuple[Prompt | PromptFailure, ...]:
        """Prompts in flight at the checkpoint, rendered again (generated from scratch)."""
        return tuple(prompt_by_id(self.task.train, source, pid) for pid in sorted(open_ids))

    def reward_pool(self, clock: Clock) -> RewardPool:
        """Starts the reward worker processes (the caller closes the pool)."""
        spec = self.exp.reward
        return RewardPool(
            self.reward, num_workers=spec.num_workers, timeout_s=spec.timeout_s, clock=clock
        )

    @property
    def plays_episodes(self) -> bool:
        """False: a prompt's G samples are generated and scored one by one."""
        return False

    def dispatch(self, reward_pool: Scorer | None) -> DispatchFactory:
        """The prompt dispatcher (``rollout.dispatch.prompt_dispatch``): G single-sample
        requests per prompt, each decoded with the policy's tokenizer and scored by
        ``reward_pool`` as it comes back.

        Raises:
          ValueError: no reward pool.
        """
        return prompt_dispatch(reward_pool, self.tokenizer)

    def batch_timeout_s(self) -> float:
        """How long the loop waits for a batch before giving up (servers hung)."""
        r = self.exp.rollout
        return r.sample_deadline_s * (r.max_retries + 2) + 4 * self.exp.reward.timeout_s

    # ------------------------------------------------------------------ learner, evaluation

    def learner_batch(
        self, groups: Sequence[Group], *, pad_id: int, max_len: int, num_sequences: int
    ) -> LearnerBatch:
        """Advantages per group; samples masked by truncation carry no loss
        (``runtime.learner_batch.learner_batch``)."""
        return learner_batch(
            groups,
            self.advantage_fn,
            self.truncation,
            num_sequences=num_sequences,
            pad_id=pad_id,
            max_len=max_len,
        )

    def report(self, batch: Any, tracker: Any) -> None:
        """A task's samples add nothing to a step's record beyond the batch's own."""
        del batch, tracker

    @property
    def eval_size(self) -> int:
        """Held-out prompts (0: no evaluation)."""
        return len(self.held_out)

    def describe_eval(self) -> str:
        return f"{self.eval_size} prompts x {self.exp.eval.samples_per_prompt} samples"

    def evaluate(
        self,
        generate: Any,
        reward_pool: RewardPool | None,
        *,
        version: int,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> dict[str, float]:
        """Held-out accuracy, mean@n, scored by the run's reward pool
        (``workloads.evaluation.evaluate``), generated by ``generate``."""
        if reward_pool is None:
            raise ValueError("TaskWorkload.evaluate needs the run's reward_pool")
        e = self.exp
        return evaluate(
            generate,
            self.held_out,
            samples_per_prompt=e.eval.samples_per_prompt,
            sampling=e.rollout.sampling,
            seed=e.seed,
            policy_version=version,
            tokenizer=self.tokenizer,
            reward_pool=reward_pool,
            progress=progress,
        )
