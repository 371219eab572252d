"""The RLVR workload: prompts of a task, scored by the run's reward in worker processes.

One of the two workloads ``runtime.loop`` runs (``runtime.workloads.workload``; the other is
``runtime.workloads.agentic.EpisodeRollout``). Built before the model loads by
``workload.make_workload``, so everything the config names fails in seconds: the reward
(``model_setup.make_reward``), the task (``task_setup.build_task``), the tokenizer, and
the prompt limits measured from the data (``task_setup.measure_prompts`` +
``config.prompt_limits``). It owns the run's reward pool (started with the rollout,
closed by ``close``) and gives the rollout its side (``rollout``: the prompt source from
the checkpoint's cursor, the prompts in flight at it rendered again, the dispatcher
``rollout.dispatch.prompt_dispatch`` scored by that pool), the learner batch (per-group
advantages, the truncation mask: ``runtime.workloads.learner_batch``) and the held-out
accuracy (``held_out``: ``runtime.workloads.evaluation``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxflash.algorithms.advantages import get_advantage_estimator
from jaxflash.data.prompts import PromptSource
from jaxflash.data.tasks import TaskData
from jaxflash.replay.groups import Group
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.config.prompt_limits import PromptLengths
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.config.specs import DataSpec, EvalSpec, RewardSpec
from jaxflash.runtime.rollout.dispatch import prompt_dispatch
from jaxflash.runtime.rollout.reward_pool import RewardPool
from jaxflash.runtime.rollout.scoring import TruncationPolicy
from jaxflash.runtime.rollout.settings import WorkloadRollout
from jaxflash.runtime.workloads.evaluation import Generate, evaluate
from jaxflash.runtime.workloads.learner_batch import LearnerBatch, learner_batch
from jaxflash.runtime.workloads.task_setup import eval_prompts, prompt_by_id
from jaxflash.types import Prompt


class TaskWorkload:
    """Prompts of ``data.task`` scored by ``reward.fn`` (RLVR).

    Args:
      task: its task (``task_setup.build_task``).
      reward: the resolved reward (``model_setup.make_reward``: a name, weights or a
        callable, as ``RewardPool`` takes it).
      tokenizer: the policy's tokenizer (chat template, stop ids).
      lengths: the prompt lengths measured.
      data: the ``data`` section with its prompt limits set (``config.prompt_limits``).
      reward_spec: the ``reward`` section (workers, deadline; ``fn`` for the console).
      rollout: the ``rollout`` section (truncation, sampling, deadlines, retries).
      eval: the ``eval`` section (samples per held-out prompt).
      advantage: the advantage estimator's name.
      seed: the run seed (evaluation's sampling seed).
      clock: the reward pool's clock (default: real time).
    """

    def __init__(
        self, *, task: TaskData, reward: Any, tokenizer: Any, lengths: PromptLengths,
        data: DataSpec, reward_spec: RewardSpec, rollout: RolloutSpec, eval: EvalSpec,
        advantage: str, seed: int, clock: Clock | None = None,
    ) -> None:  # fmt: skip
        self.task, self.reward, self.tokenizer, self.lengths = task, reward, tokenizer, lengths
        self._data, self._reward_spec, self._rollout = data, reward_spec, rollout
        self._clock = clock
        self._pool: RewardPool | None = None  # started with the rollout (``rollout``)
        prompts = eval_prompts(task, tokenizer, data.max_prompt_tokens)
        self.held_out = TaskHeldOut(
            prompts, self._reward_pool, tokenizer, samples_per_prompt=eval.samples_per_prompt,
            sampling=rollout.sampling, seed=seed,
        )  # fmt: skip
        self.truncation = TruncationPolicy(
            mode=rollout.truncation, penalty=rollout.truncation_penalty
        )
        self.advantage_fn = get_advantage_estimator(advantage)

    def describe(self) -> str:
        """One console line."""
        return f"task {self._data.task}, reward {self._reward_spec.fn}; {self.lengths.describe()}"

    def prompt_lengths(self) -> PromptLengths:
        """The prompt lengths measured (``run_config.json``)."""
        return self.lengths

    @property
    def plays_episodes(self) -> bool:
        """False: a prompt's G samples are generated and scored one by one."""
        return False

    # ------------------------------------------------------------------ the rollout's side

    def rollout(self, start: int, open_ids: Sequence[int]) -> WorkloadRollout:
        """The training prompts from row ``start`` (a checkpoint's data cursor), the prompts
        in flight at the checkpoint rendered again (generated from scratch), and the prompt
        dispatcher (``rollout.dispatch.prompt_dispatch``: G single-sample requests per
        prompt, each decoded with the policy's tokenizer and scored as it comes back by the
        reward pool, started here); the batch timeout covers hung servers."""
        train = self.task.train
        source = PromptSource(
            train,
            self.tokenizer,
            max_prompt_tokens=self._data.max_prompt_tokens,
            start=start,
            cycle=not callable(train),  # a file is read in epochs; ids keep growing
        )
        resume: tuple[Prompt | Any, ...] = tuple(
            prompt_by_id(train, source, pid) for pid in sorted(open_ids)
        )
        r = self._rollout
        timeout_s = r.sample_deadline_s * (r.max_retries + 2) + 4 * self._reward_spec.timeout_s
        dispatch = prompt_dispatch(self._reward_pool(), self.tokenizer)
        return WorkloadRollout(source, resume, dispatch, batch_timeout_s=timeout_s)

    def _reward_pool(self) -> RewardPool:
        """The reward worker processes, started at the first call (``close`` ends them)."""
        if self._pool is None:
            spec = self._reward_spec
            self._pool = RewardPool(
                self.reward, num_workers=spec.num_workers, timeout_s=spec.timeout_s,
                clock=self._clock,
            )  # fmt: skip
        return self._pool

    # ------------------------------------------------------------------ learner, the end

    def learner_batch(
        self,
        groups: Sequence[Group],
        *,
        pad_id: int,
        max_len: int,
        num_sequences: int,
        length_multiple: int = 32,
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
            length_multiple=length_multiple,
        )

    def report(self, batch: Any, tracker: Any) -> None:
        """A task's samples add nothing to a step's record beyond the batch's own."""
        del batch, tracker

    def close(self) -> None:
        """Stops the reward workers (if started)."""
        if self._pool is not None:
            self._pool.close()


class TaskHeldOut:
    """A task's held-out prompts (``HeldOut``): accuracy, mean@n, scored by the run's reward
    pool (``workloads.evaluation.evaluate``).

    Args:
      prompts: the held-out prompts, rendered (``task_setup.eval_prompts``).
      reward_pool: returns the run's reward pool (the workload's, started on first use).
      tokenizer: the policy's tokenizer.
      samples_per_prompt, sampling, seed: n, the training sampling, the run seed.
    """

    unit = "samples"

    def __init__(
        self, prompts: list[Prompt], reward_pool: Callable[[], RewardPool], tokenizer: Any, *,
        samples_per_prompt: int, sampling: Any, seed: int,
    ) -> None:  # fmt: skip
        self.prompts, self._reward_pool, self._tokenizer = prompts, reward_pool, tokenizer
        self._n, self._sampling, self._seed = samples_per_prompt, sampling, seed

    @property
    def size(self) -> int:
        """Held-out prompts (0: no evaluation)."""
        return len(self.prompts)

    def describe(self) -> str:
        """What one evaluation runs, e.g. "64 prompts x 4 samples"."""
        return f"{self.size} prompts x {self._n} samples"

    def evaluate(
        self, generate: Generate, *, version: int,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Held-out accuracy at ``version``, generated by ``generate``."""
        return evaluate(
            generate,
            self.prompts,
            samples_per_prompt=self._n,
            sampling=self._sampling,
            seed=self._seed,
            policy_version=version,
            tokenizer=self._tokenizer,
            reward_pool=self._reward_pool(),
            progress=progress,
        )
