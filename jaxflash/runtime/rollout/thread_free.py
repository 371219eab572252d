"""The thread-free seam of the rollout scheduler: what a discrete-event simulator
(``runtime.simulate``) and the tests drive instead of its pump thread and its blocking
``next_batch``. The loop never sees it (it sees ``scheduler.Rollout``).

Driving it without threads (a discrete-event simulator; see
tests/runtime/rollout/test_scheduler_parts.py for a complete driver)::

    clock, inbox = VirtualClock(), Inbox()
    servers = [SimServer(on_finished=inbox.generated, clock=clock) for _ in range(n)]
    books = RolloutBooks(source=source, ledger=PromptLedger(), buffer=GroupBuffer(G))
    settings = RolloutSettings(batch_prompts=B, group_size=G, async_ratio=α, ...)
    sched = RolloutScheduler(
        servers, inbox, books, settings, prompt_dispatch(scorer, tokenizer), clock=clock
    )
    steps = ThreadFree(sched)
    while v < steps:
        steps.poll()
        batch = steps.try_batch(v)
        if batch is None:  # jump to the next event; servers deliver what is due
            clock.advance_to(min(next server completion, steps.next_deadline()))
            continue
        clock.advance(learner time)
        steps.mark_trained(batch.groups)
        v += 1
        sched.servers_changed(ServersChanged(version=v, weights=[None] * n))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from jaxflash.replay.groups import Group
from jaxflash.runtime.rollout.admission import Admission
from jaxflash.runtime.rollout.batches import Batch, BatchAssembler
from jaxflash.runtime.rollout.books import BooksSnapshot
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.scheduler import RolloutScheduler
from jaxflash.runtime.rollout.server_pool import ServerPool

__all__ = ["ThreadFree", "ThreadFreeParts"]


class ThreadFree:
    """The thread-free seam of a ``RolloutScheduler``: what a discrete-event simulator
    (``runtime.simulate``) and the tests drive instead of the pump thread and the blocking
    ``next_batch``. Not the loop's: the loop sees ``Rollout``.

    ``poll()``: one pump step (reports, deaths, deadlines, admission), events handled;
    ``try_batch(v)``: the batch at learner version ``v`` if complete, else None (never
    blocks; RuntimeError when every server died and nothing is left);
    ``mark_trained(groups)``: close a batch's prompts in the ledger (TRAINED, or FILTERED
    "all_truncated" when no sample carried loss), their capacity returns at the next
    version; ``next_deadline()``: clock time at which the oldest outstanding sample misses
    its deadline (None if nothing is out); ``snapshot()``: the books under one lock;
    ``parts``: the scheduler's parts (``ThreadFreeParts``) for tests to inspect.
    """

    def __init__(self, scheduler: RolloutScheduler) -> None:
        self._s = scheduler  # its thread-free methods: the scheduler's private half

    def poll(self) -> int:
        return self._s._poll()

    def try_batch(self, learner_version: int) -> Batch | None:
        return self._s._try_batch(learner_version)

    def mark_trained(self, groups: Sequence[Group]) -> None:
        self._s._mark_trained(groups)

    def next_deadline(self) -> float | None:
        return self._s._next_deadline()

    def snapshot(self) -> BooksSnapshot:
        return self._s._books.snapshot()

    @property
    def parts(self) -> ThreadFreeParts:
        s = self._s
        return ThreadFreeParts(
            s._dispatcher, s._ledger, s._buffer, s._pool, s._admission, s._assembler, s._inbox
        )


class ThreadFreeParts(NamedTuple):
    """A scheduler's parts, each owning its state (tests read them; ``ThreadFree.parts``)."""

    dispatcher: Any
    ledger: Any
    buffer: Any
    pool: ServerPool
    admission: Admission
    assembler: BatchAssembler
    inbox: Inbox
