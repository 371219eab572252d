"""What a rollout scheduler is built from: its settings, its books and its dispatcher.

``RolloutSettings`` (frozen, validated) are the knobs of the run; ``RolloutBooks``
are what a checkpoint restores (prompt source and its cursor, ledger, group
buffer, prompts in flight, counters); a ``DispatchFactory`` is how the workload
plays an admitted prompt: the task workload sends G samples to the servers and
scores them (``rollout.dispatch.prompt_dispatch``), the agentic workload plays G
episodes (``rollout.episode_dispatch.episode_dispatch``). The scheduler never
learns which, so an RLVR run never imports ``jaxflash.envs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from jaxflash.data.prompts import PromptFailure
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.rollout.admission import Admission
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.routing import RequestRouter
from jaxflash.runtime.rollout.scoring import TruncationPolicy
from jaxflash.runtime.rollout.server_pool import ServerPool
from jaxflash.types import Prompt, SamplingParams

STALE_POLICIES = ("drop", "regenerate", "pace")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """The rollout's knobs, fixed for a run (``reconfigure`` moves B, α and capacity).

    Attributes:
      batch_prompts: B groups per learner step (>= 1).
      group_size: G samples (or episodes) per prompt (>= 1).
      async_ratio: α >= 0: a group may be at most α versions older than the learner.
      sampling, seed: of every request (the sampling RNG is keyed per sample).
      policy_version: the version the servers hold at the start.
      stale_policy: "drop" | "regenerate" a group too stale to train, or "pace" admission
        and batches so none is (``rollout.pacing``; nothing discarded for staleness).
      sample_deadline_s, max_retries: per-request deadline (seconds, queue time on
        the server included) and retries before the prompt fails.
      truncation: what a truncated response gets.
      refill_dropped: dynamic sampling (DAPO, arXiv 2503.14476): a dropped prompt's
        capacity returns at once (up to B per step) instead of at the next publish.
      prompt_replication: each of a prompt's G samples goes to the best server on
        its own (ROLL Flash, arXiv 2510.11345 §5.1.2); False keeps them on one.
      batch_timeout_s: how long ``next_batch`` waits for a batch before giving up
        (the workload's, ``WorkloadRollout.batch_timeout_s``).
      slots_per_server: decode slots per generation server (``rollout.num_slots``), for
        the idle slot-seconds while admission is held (``rollout.stalls``); 0 = unknown.

    Raises:
      ValueError: B < 1, G < 1, α < 0 (naming the three), or an unknown stale_policy.
    """

    batch_prompts: int
    group_size: int
    async_ratio: int
    sampling: SamplingParams
    seed: int
    policy_version: int = 0
    stale_policy: str = "drop"
    sample_deadline_s: float = 600.0
    max_retries: int = 1
    truncation: TruncationPolicy = TruncationPolicy()
    refill_dropped: bool = False
    prompt_replication: bool = True
    batch_timeout_s: float = 3600.0
    slots_per_server: int = 0

    def __post_init__(self) -> None:
        if self.batch_prompts < 1 or self.group_size < 1 or self.async_ratio < 0:
            raise ValueError(
                f"need batch_prompts >= 1, group_size >= 1, async_ratio >= 0; got "
                f"{self.batch_prompts}, {self.group_size}, {self.async_ratio}"
            )
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(
                f"stale_policy must be drop | regenerate | pace, got {self.stale_policy!r}"
            )

    @classmethod
    def from_spec(
        cls,
        spec: RolloutSpec,
        *,
        batch_prompts: int,
        async_ratio: int,
        seed: int,
        policy_version: int,
        refill_dropped: bool,
        batch_timeout_s: float = 3600.0,
    ) -> RolloutSettings:
        """The settings of a run's ``rollout`` section (G, sampling, stale policy,
        deadline, retries, truncation) with B and α in force (the step controller's),
        the run's seed, the servers' version, whether dropped prompts refill and the
        workload's batch timeout."""
        return cls(
            batch_prompts=batch_prompts,
            group_size=spec.group_size,
            async_ratio=async_ratio,
            sampling=spec.sampling,
            seed=seed,
            policy_version=policy_version,
            stale_policy=spec.stale_policy,
            sample_deadline_s=spec.sample_deadline_s,
            max_retries=spec.max_retries,
            truncation=TruncationPolicy(mode=spec.truncation, penalty=spec.truncation_penalty),
            refill_dropped=refill_dropped,
            batch_timeout_s=batch_timeout_s,
            slots_per_server=spec.num_slots,
        )

    @property
    def capacity(self) -> int:
        """(α+1)·B: prompts admitted and not yet released."""
        return (self.async_ratio + 1) * self.batch_prompts

    @property
    def refill_budget(self) -> int:
        """Prompts per step whose capacity returns at once (B with refill_dropped, else 0)."""
        return self.batch_prompts if self.refill_dropped else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutBooks:
    """What a checkpoint restores: where the data is and what was counted.

    Attributes:
      source: prompt source (``take(n) -> list[Prompt | PromptFailure]``; ``cursor``).
      ledger: the run's PromptLedger.
      buffer: GroupBuffer of group size G (its buffer_* counters restored).
      resume_prompts: prompts in flight at the checkpoint (open in the ledger),
        generated again first (``prompts_regenerated_on_resume``).
      counters: the checkpoint's prompts_* / samples_* / episodes_* counters (they
        keep adding up).
    """

    source: Any
    ledger: PromptLedger
    buffer: GroupBuffer
    resume_prompts: Sequence[Prompt | PromptFailure] = ()
    counters: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchParts:
    """What a dispatcher works with; each part is owned by the scheduler and is
    reached only through its methods.

    Attributes:
      pool: the generation servers.
      inbox: the servers', reward futures' and environments' report queue.
      admission: capacity over the prompt source.
      ledger: every prompt taken enters it.
      buffer: samples (or episodes) and failures go here.
      clock: time of dispatch and deadlines.
      restored: the checkpoint's counters (read only: a dispatcher counts its own).
    """

    pool: ServerPool
    inbox: Inbox
    admission: Admission
    ledger: PromptLedger
    buffer: GroupBuffer
    clock: Clock
    restored: Mapping[str, int]


class InFlight(NamedTuple):
    """A prompt (group) with something running (``Dispatch.in_flight``).

    Attributes:
      running: its samples (episodes) running now.
      start_version: the start version its group will have (inf: nothing bounds it).
    """

    running: int
    start_version: float


class DispatchWatch(NamedTuple):
    """What a dispatcher reports (``Dispatch.watch``), read by the scheduler's metrics.

    Attributes:
      stats: () -> instantaneous state for metrics.jsonl (samples outstanding, scoring).
      counts: () -> what it counted since it was built (added to the restored counters).
      take_score_spans: () -> (submitted, scored) clock times of rewards scored since
        the last call (the timeline's reward spans; none for episodes).
    """

    stats: Callable[[], dict[str, Any]]
    counts: Callable[[], dict[str, int]]
    take_score_spans: Callable[[], list[tuple[float, float]]]


class Dispatch(Protocol):
    """How admitted prompts are played (``Dispatcher``: G samples scored by a reward
    pool; ``EpisodeDispatcher``: G episodes); what the scheduler and
    ``BatchAssembler`` drive. Thread-free: the scheduler serialises every call.

    Attributes:
      router: its ``RequestRouter``, where the servers' events go directly: versions
        (``publish``, ``version``), deaths, retirements, the first request's time.
      watch: what it reports (``DispatchWatch``: stats, counts, score spans).
    """

    router: RequestRouter
    watch: DispatchWatch

    def poll(self) -> int:
        """Handle reports, deaths and deadlines, then admit; events handled."""

    def idle(self) -> bool:
        """Nothing in flight, nothing to report, nothing admissible."""

    def dispatch_prompt(self, prompt: Prompt) -> None:
        """Start (or start again) ``prompt`` (admitted: ``admission.admit_all``)."""

    def end_prompt(self, prompt_id: int, *, abort: bool = False, scoring: bool = False) -> None:
        """Drop what is kept of ``prompt_id`` (trained, dropped or regenerated); with
        ``abort``, first stop everything of it that is in flight (counted); with
        ``scoring``, also its samples awaiting a reward (late scores are discarded)."""

    def in_flight(self) -> dict[int, InFlight]:
        """Prompts with something running, by id (sorted)."""

    def next_deadline(self) -> float | None:
        """Clock time of the next deadline (None when nothing is pending)."""


class DispatchFactory(Protocol):
    """Builds the run's dispatcher (the workload provides it: ``Workload.rollout``)."""

    def __call__(self, parts: DispatchParts, settings: RolloutSettings) -> Dispatch: ...


class WorkloadRollout(NamedTuple):
    """The workload's side of the rollout (``Workload.rollout(start, open_ids)``).

    Attributes:
      source: the prompt source (``take(n)``, ``cursor``) from the checkpoint's cursor.
      resume_prompts: prompts (groups) in flight at the checkpoint, generated again.
      dispatch: builds the dispatcher: prompts scored by the workload's reward pool, or
        groups of episodes scored by their environments.
      batch_timeout_s: how long the loop waits for a batch before giving up.
    """

    source: Any
    resume_prompts: tuple[Prompt | PromptFailure, ...]
    dispatch: DispatchFactory
    batch_timeout_s: float
