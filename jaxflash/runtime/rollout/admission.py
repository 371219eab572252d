"""Admission: how many prompts may be in flight, and when their capacity comes back.

ROLL Flash's async ratio α (arXiv 2510.11345) bounds how far generation may run
ahead of the learner: at most ``(α+1)·B`` prompts are admitted and not yet
released. A prompt's capacity is released when the weights it was trained on (or
dropped before) are published, so with α = 0 the next prompts start at the new
version -- the synchronous loop. Dynamic sampling (DAPO, arXiv 2503.14476) frees a
filtered prompt's capacity at once so a replacement starts now, up to a refill
budget per learner step, so that a run whose every group is filtered cannot read
its whole dataset in one step. With ``stale_policy="pace"`` a ``Pacer``
(``rollout.pacing``) also gates each admission on every prompt meeting its
training deadline, and learns each one's. Prompts to regenerate (surplus ones aborted as
stale, in-flight ones of a resumed run) re-enter here.

Thread-free: the scheduler serialises access.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from jaxflash.data.prompts import PromptFailure
from jaxflash.types import Prompt

Item = Prompt | PromptFailure


class Admission:
    """Capacity accounting over a prompt source.

    Args:
      source: ``take(n) -> list[Prompt | PromptFailure]`` (fewer at its end).
      capacity: (α+1)·B prompts admitted and not yet released.
      refill_budget: prompts per release interval whose capacity ``free_for_refill``
        returns at once (0 = never: everything waits for the next release).
      resume: prompts in flight at a checkpoint, admitted first (already taken
        from the source and open in the ledger).
      pacer: ``rollout.pacing.Pacer`` (``stale_policy="pace"``): admits only while it
        ``admits()``, told of each admission (``admitted``); None = capacity only.

    Raises:
      ValueError: capacity < 1 or refill_budget < 0.
    """

    def __init__(
        self,
        source: Any,
        *,
        capacity: int,
        refill_budget: int = 0,
        resume: Iterable[Item] = (),
        pacer: Any = None,
    ) -> None:
        _check(capacity, refill_budget)
        self.source = source
        self.capacity = capacity
        self.refill_budget = refill_budget
        self._refills_left = refill_budget
        self._active: dict[int, Item] = {}
        self._requeue: collections.deque[Item] = collections.deque(resume)
        self._at_release: list[int] = []  # capacity returns at the next release
        self._regenerate_at_release: list[int] = []
        self._exhausted = False
        self._halted = False  # no more admissions (e.g. no generation server left)
        self.pacer = pacer

    # -- the owner's controls ---------------------------------------------------

    @property
    def halted(self) -> bool:
        """Nothing is admitted (every generation server died)."""
        return self._halted

    def halt(self) -> None:
        """Admit nothing more (every generation server died)."""
        self._halted = True

    def reopen(self) -> None:
        """Admit again (a generation server came back)."""
        self._halted = False

    def resize(self, *, capacity: int, refill_budget: int) -> None:
        """A step boundary's new capacity and refill budget (the step controller's).

        A lower capacity admits nothing new until enough prompts are released (none is
        aborted); the refill budget in force this step is unchanged until ``release``.

        Raises:
          ValueError: capacity < 1 or refill_budget < 0.
        """
        _check(capacity, refill_budget)
        self.capacity, self.refill_budget = capacity, refill_budget

    # -- admitting --------------------------------------------------------------

    def can_admit(self) -> bool:
        """A prompt could be admitted now (capacity free and a prompt available)."""
        if self._halted or len(self._active) >= self.capacity:
            return False
        if self.pacer is not None and not self.pacer.admits():
            return False
        return bool(self._requeue) or not self._exhausted

    def held_by(self) -> str | None:
        """Why nothing is admitted now, if it is the staleness bound: "capacity" ((α+1)·B
        prompts active) or "pacer" (``Pacer.admits`` is False with capacity free); None
        when a prompt could be admitted, none is left, or admission is halted (no server).
        ``rollout.stalls`` times it."""
        if self._halted or not (self._requeue or not self._exhausted):
            return None
        if len(self._active) >= self.capacity:
            return "capacity"
        if self.pacer is not None and not self.pacer.admits():
            return "pacer"
        return None

    def next(self) -> tuple[Item, bool] | None:
        """Admit the next prompt if capacity allows.

        Returns:
          (item, from_source) -- ``from_source`` False for a resumed prompt (already
          in the ledger) -- or None when full, halted or the source is exhausted.
        """
        if not self.can_admit():
            return None
        if self._requeue:
            item, from_source = self._requeue.popleft(), False
        else:
            items = self.source.take(1)
            if not items:
                self._exhausted = True
                return None
            item, from_source = items[0], True
        self._active[item.prompt_id] = item
        if self.pacer is not None:
            self.pacer.admitted(item.prompt_id)
        return item, from_source

    # -- looking up -------------------------------------------------------------

    def is_active(self, prompt_id: int) -> bool:
        return prompt_id in self._active

    def prompt(self, prompt_id: int) -> Item | None:
        """The admitted item of ``prompt_id`` (None once released)."""
        return self._active.get(prompt_id)

    def __len__(self) -> int:
        return len(self._active)

    # -- releasing --------------------------------------------------------------

    def release_at_publish(self, prompt_id: int) -> None:
        """Its capacity returns at the next ``release`` (trained or dropped this step)."""
        self._at_release.append(prompt_id)

    def free(self, prompt_id: int) -> None:
        """Its capacity returns now (a prompt started now is still useful)."""
        self._active.pop(prompt_id, None)

    def free_for_refill(self, prompt_id: int) -> bool:
        """Dynamic sampling: free now while the refill budget lasts, else at release.

        Returns:
          True if freed now.
        """
        if self._refills_left > 0:
            self._refills_left -= 1
            self.free(prompt_id)
            return True
        self.release_at_publish(prompt_id)
        return False

    def regenerate_at_release(self, prompt_id: int) -> None:
        """Keep it admitted; hand it back from the next ``release`` to be regenerated."""
        self._regenerate_at_release.append(prompt_id)

    def release(self) -> list[Prompt]:
        """New weights are published: free what was waiting, renew the refill budget.

        Returns:
          Prompts to regenerate now (still admitted), in the order they were marked.
        """
        for pid in self._at_release:
            self._active.pop(pid, None)
        self._at_release = []
        self._refills_left = self.refill_budget
        again = [self._active[p] for p in self._regenerate_at_release if p in self._active]
        self._regenerate_at_release = []
        return [p for p in again if isinstance(p, Prompt)]


def _check(capacity: int, refill_budget: int) -> None:
    if capacity < 1 or refill_budget < 0:
        raise ValueError(
            f"Admission needs capacity >= 1 and refill_budget >= 0, got {capacity}, {refill_budget}"
        )


def admit_all(
    admission: Admission, ledger: Any, buffer: Any, dispatch_prompt: Callable[[Prompt], None]
) -> int:
    """Admits prompts while ``admission`` has capacity; how many were admitted.

    A prompt new from the source is taken in ``ledger``; a row that did not become a
    prompt (``PromptFailure``) is failed in ``buffer`` with its reason; every other
    prompt goes to ``dispatch_prompt`` (G requests, or a group of episodes).
    """
    n = 0
    while (nxt := admission.next()) is not None:
        n += 1
        item, from_source = nxt
        if from_source:
            ledger.take(item.prompt_id)
        if isinstance(item, PromptFailure):
            buffer.fail(item.prompt_id, item.failure, item.reason)
            continue
        dispatch_prompt(item)
    return n
