"""The run's rollout scheduler, built from the config, the workload and the fleet's pool."""

from __future__ import annotations

from typing import Any

from jaxflash.checkpoint.checkpointer import CheckpointMeta
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.replay.groups import GroupFilter
from jaxflash.runtime.clock import Clock
from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.scheduler import RolloutScheduler
from jaxflash.runtime.rollout.server_pool import ServerPool
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings


def make_scheduler(
    spec: RolloutSpec,
    workload: Any,
    pool: ServerPool,
    inbox: Inbox,
    meta: CheckpointMeta,
    *,
    seed: int,
    batch_prompts: int,
    async_ratio: int,
    clock: Clock,
) -> RolloutScheduler:
    """The scheduler feeding ``pool`` (the fleet's servers, reporting to ``inbox``).

    Args:
      spec: the ``rollout`` section. seed: the run seed.
      workload: the run's ``workloads.workload.Workload`` (its side of the rollout:
        ``rollout(start, open_ids)``; whether it plays episodes).
      meta: the learner's checkpoint metadata (step = the servers' version); the
        rollout's books are restored from it here: the prompt ledger (its prompts in
        flight generated again first), the data cursor, the counters and the group
        buffer's counters.
      batch_prompts, async_ratio: B and alpha in force (the step controller's).
    """
    knobs = spec.group_filter_kwargs()
    group_filter = GroupFilter(**knobs) if knobs is not None else None
    ledger = PromptLedger.restore(meta.extra)  # the rollout's own books, as it saved them
    side = workload.rollout(meta.data_cursor, ledger.open_ids)  # prompts, or episodes
    # The checkpoint's books: buffer_* counters go on, as prompts_* / samples_* do.
    books = RolloutBooks(
        source=side.source, ledger=ledger, resume_prompts=side.resume_prompts,
        buffer=GroupBuffer(spec.group_size, group_filter=group_filter,
                           state=meta.extra.get("group_buffer")),
        counters=meta.extra.get("counters", {}),
    )  # fmt: skip
    settings = RolloutSettings.from_spec(
        spec, batch_prompts=batch_prompts, async_ratio=async_ratio, seed=seed,
        policy_version=int(meta.step),
        # Dynamic sampling: a filtered group's prompt is replaced at once (up to B a step);
        # so is a group of episodes whose environment kept failing.
        refill_dropped=group_filter is not None or workload.plays_episodes,
        batch_timeout_s=side.batch_timeout_s,
    )  # fmt: skip
    return RolloutScheduler(pool, inbox, books, settings, side.dispatch, clock=clock)
