"""The samples a ``SlotBatcher`` holds: each one's tokens so far, and the queue order.

A ``RunningSample`` is one request in flight: its sampled tokens, behaviour
logprobs and the policy version of each token, until it finishes (``append`` says
when: a stop id, or ``max_new_tokens``) and becomes a ``Sample`` (``to_sample``).
A ``SampleQueue`` holds those waiting for a slot, first come first served; a sample
sent back (new weights under "restart" or "recompute", a preemption) goes to the
front, so it is the next to start.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection

import numpy as np

from jaxflash.generation.slot_types import RequestKey
from jaxflash.types import FinishReason, GenerationRequest, PolicyVersion, Sample


def request_key(request: GenerationRequest) -> RequestKey:
    """(prompt_id, sample_index) as ints: a request's identity in the batcher."""
    return (int(request.prompt_id), int(request.sample_index))


@dataclasses.dataclass
class RunningSample:
    """A queued or running sample; queued with tokens = waiting for a recompute.

    Attributes:
      request: what it generates.
      start_version: the policy version of its first token; None until it first
        gets a slot.
      tokens, logps, versions: sampled token ids, their behaviour logprobs and the
        policy version each was sampled under, in order.
      admitted: admission order (paged: the newest is preempted first).
      routes: MoE engines: int16 [n, L, k] routes of the first n tokens of prompt +
        response the engine fed (``record_routes``); None before the first fill or
        for a dense model.
    """

    request: GenerationRequest
    start_version: PolicyVersion | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    admitted: int = 0
    routes: np.ndarray | None = None

    @property
    def key(self) -> RequestKey:
        return request_key(self.request)

    def append(
        self, token: int, logp: float, version: PolicyVersion, stop_ids: Collection[int]
    ) -> FinishReason | None:
        """Add one sampled token; EOS if it is a stop id (kept in the response), LENGTH
        at ``max_new_tokens``, else None."""
        self.tokens.append(token)
        self.logps.append(logp)
        self.versions.append(int(version))
        if token in stop_ids:
            return FinishReason.EOS
        if len(self.tokens) >= self.request.sampling.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def record_routes(self, routes_xlk: np.ndarray) -> None:
        """Routes of prompt + response tokens from the first one not recorded yet on:
        ``routes_xlk`` int16 [n, L, k] covers tokens 0..n-1 (a prefill of prompt +
        prefix) or, as one row [1, L, k] after what is recorded, the token a decode step
        fed. A token keeps the route it was first fed with (a recompute's re-prefill
        only adds the rows past them)."""
        routes_xlk = np.asarray(routes_xlk, np.int16)
        if self.routes is None:
            self.routes = routes_xlk
        elif len(routes_xlk) == 1:
            self.routes = np.concatenate([self.routes, routes_xlk])
        elif len(routes_xlk) > len(self.routes):
            self.routes = np.concatenate([self.routes, routes_xlk[len(self.routes) :]])

    def to_sample(self, reason: FinishReason, version: PolicyVersion) -> Sample:
        """The finished (or aborted) sample; ``version`` is its start version if it never
        started (an abort while queued)."""
        r = self.request
        return Sample(
            prompt_id=r.prompt_id,
            sample_index=r.sample_index,
            prompt_tokens=np.asarray(r.prompt_tokens, np.int32),
            response_tokens=np.asarray(self.tokens, np.int32),
            behaviour_logprobs=np.asarray(self.logps, np.float32),
            token_versions=np.asarray(self.versions, np.int32),
            start_version=version if self.start_version is None else self.start_version,
            finish_reason=reason,
            routed_experts=self._routed_experts(),
        )

    def _routed_experts(self) -> np.ndarray | None:
        """int16 [T_prompt + T_resp, L, k]: the routes, -1 on tokens never fed."""
        if self.routes is None:
            return None
        total = len(self.request.prompt_tokens) + len(self.tokens)
        out = np.full((total, *self.routes.shape[1:]), -1, np.int16)
        n = min(total, len(self.routes))
        out[:n] = self.routes[:n]
        return out


class SampleQueue:
    """Samples waiting for a slot, in start order (the head starts first)."""

    def __init__(self) -> None:
        self._runs: collections.OrderedDict[RequestKey, RunningSample] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._runs

    def add(self, run: RunningSample) -> None:
        """Queue ``run`` last."""
        self._runs[run.key] = run

    def add_first(self, run: RunningSample) -> None:
        """Queue ``run`` first (it starts before everything queued)."""
        self._runs[run.key] = run
        self._runs.move_to_end(run.key, last=False)

    def head(self) -> RunningSample:
        """The sample that starts next (raises StopIteration when empty)."""
        return next(iter(self._runs.values()))

    def pop_head(self) -> RunningSample:
        return self._runs.popitem(last=False)[1]

    def pop(self, key: RequestKey) -> RunningSample:
        """Remove and return the sample ``key`` (KeyError if not queued)."""
        return self._runs.pop(key)

    def fresh_prompts(self) -> list[np.ndarray]:
        """Prompt tokens of the queued samples that start from nothing (no prefix)."""
        return [r.request.prompt_tokens for r in self._runs.values() if not r.tokens]
