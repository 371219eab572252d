"""The run's rollout scheduler, built from the config, the workload and the fleet's pool."""

from __future__ import annotations

from typing import Any

from jaxflash.checkpoint.checkpointer import CheckpointMeta
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.groups import GroupFilter
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.scheduler import RolloutScheduler
from jaxflash.runtime.rollout.server_pool import ServerPool
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings


def make_scheduler(
    exp: Any,
    workload: Any,
    pool: ServerPool,
    inbox: Inbox,
    meta: CheckpointMeta,
    *,
    batch_prompts: int,
    async_ratio: int,
    reward_pool: Any,
    clock: Clock,
) -> RolloutScheduler:
    """The scheduler feeding ``pool`` (the fleet's servers, reporting to ``inbox``).

    Args:
      exp: the ``ExperimentConfig`` (``rollout.*``, seed).
      workload: the run's ``workloads.workload.Workload`` (prompt source, prompts to
        generate again on resume, its dispatcher; whether it plays episodes).
      meta: the learner's checkpoint metadata (step = the servers' version); the
        rollout's books are restored from it here: the prompt ledger (its prompts in
        flight generated again first), the data cursor, the counters and the group
        buffer's counters.
      batch_prompts, async_ratio: B and alpha in force (the step controller's).
      reward_pool: the started reward workers (None: the environments score).
    """
    r = exp.rollout
    knobs = r.group_filter_kwargs()
    group_filter = GroupFilter(**knobs) if knobs is not None else None
    ledger = PromptLedger.restore(meta.extra)  # the rollout's own books, as it saved them
    source = workload.source(meta.data_cursor)
    # The checkpoint's books: buffer_* counters go on, as prompts_* / samples_* do.
    books = RolloutBooks(
        source=source, ledger=ledger, resume_prompts=workload.resume(source, ledger.open_ids),
        buffer=GroupBuffer(r.group_size, group_filter=group_filter,
                           state=meta.extra.get("group_buffer")),
        counters=meta.extra.get("counters", {}),
    )  # fmt: skip
    settings = RolloutSettings.from_spec(
        r, batch_prompts=batch_prompts, async_ratio=async_ratio, seed=exp.seed,
        policy_version=int(meta.step),
        # Dynamic sampling: a filtered group's prompt is replaced at once (up to B a step);
        # so is a group of episodes whose environment kept failing.
        refill_dropped=group_filter is not None or workload.plays_episodes,
    )  # fmt: skip
    dispatch = workload.dispatch(reward_pool)  # prompts scored, or episodes played
    return RolloutScheduler(pool, inbox, books, settings, dispatch, clock=clock)
