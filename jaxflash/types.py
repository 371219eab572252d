"""Messages that cross jaxflash's boundaries (layer 0: imports nothing of ours).

Every message is a plain dataclass stamped with a policy version. Host-side
arrays are numpy (never jax) so they can cross threads, processes and queues
without touching a device.

Dimension letters used in names across the package: B batch, T time (tokens),
V vocabulary, D model width, N query heads, K key/value heads, H head dim,
F MLP hidden width, L layers, S cache length, G group size (samples per prompt).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

PolicyVersion = int
"""Learner step count whose weights produced a token; 0 = initial weights."""

RequestKey = tuple[int, int]
"""(prompt_id, sample_index): the identity of one sample's request everywhere."""


class FinishReason(enum.StrEnum):
    """Why a sample stopped generating."""

    EOS = "eos"  # the model emitted an end-of-sequence token
    LENGTH = "length"  # hit max_new_tokens: the response is truncated
    ABORTED = "aborted"  # stopped by the scheduler (stale, surplus, restart)


class PromptOutcome(enum.StrEnum):
    """How a prompt taken from the dataset ended. Counters over these add up."""

    TRAINED = "trained"
    FILTERED = "filtered"  # e.g. all rewards in the group equal (with reason)
    STALE = "stale"  # dropped: older than the async ratio allows
    FAILED = "failed"  # bad input, reward error/timeout, generation error (with reason)


class FailureReason(enum.StrEnum):
    """Why a prompt FAILED: set where the failure happens, carried to the ledger unchanged.

    The ledger counts failed prompts by these values (``prompt_outcomes["failed"]``);
    the human-readable detail (file and line, the exception, the deadline) travels
    next to it for logs and rollouts.jsonl, and is never parsed.
    """

    MALFORMED_ROW = "malformed_row"  # a dataset row that is not {prompt: str, answer: str}
    PROMPT_TOO_LONG = "prompt_too_long"  # rendered prompt longer than data.max_prompt_tokens
    REQUEST_REJECTED = "request_rejected"  # the engine refused the request (length, sampling)
    REWARD_ERROR = "reward_error"  # the reward raised, or returned an error
    REWARD_TIMEOUT = "reward_timeout"  # the reward missed its per-sample deadline
    REWARD_CRASH = "reward_crash"  # the reward worker process died while scoring
    REWARD_UNAVAILABLE = "reward_unavailable"  # the reward pool was closed or broken
    NON_FINITE_REWARD = "non_finite_reward"  # a reward of NaN or +-inf
    GENERATION_TIMEOUT = "generation_timeout"  # a sample missed its deadline on every try
    SERVER_DIED = "server_died"  # every generation server died with the sample in flight
    ENV_FAILURE = "env_failure"  # an episode's environment failed after every restart
    SHUTDOWN = "shutdown"  # still pending when the buffer was drained at shutdown


class RunStoppedError(RuntimeError):
    """A run that cannot make progress stops with this (the message says why and what
    to check); the launcher prints it in one line."""


class NothingTrainedError(RuntimeError):
    """A run that reached its last step without one update: every step was skipped with
    nothing to train (e.g. a reward that raises on every sample), so the weights are the
    ones it started with. The launcher prints the message in one line and exits with
    status 3 (docs/RUNNING.md), so a wrapper script does not take it for a success.

    Attributes:
      record: the run's last metrics row (what ``runtime.loop.run`` would have returned).
    """

    def __init__(self, message: str, record: dict[str, Any]):
        super().__init__(message)
        self.record = record


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How tokens are drawn; the learner rescores under the same distribution.

    Attributes:
      temperature: softmax temperature T > 0 (logits are divided by T).
      top_k: keep the k most likely tokens; 0 disables.
      top_p: keep the smallest set with cumulative probability >= p; 1.0 disables.
      max_new_tokens: response budget in tokens; hitting it marks the sample truncated.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
    """One dataset item, rendered and tokenized.

    Attributes:
      prompt_id: unique, stable id (dataset cursor position); keys sampling RNG.
      text: the user message (before the chat template).
      prompt_tokens: int32 [T_prompt] tokens of the rendered chat prompt.
      answer: reference answer for the verifier.
      meta: free-form provenance (source file and line, task knobs).
    """

    prompt_id: int
    text: str
    prompt_tokens: np.ndarray
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One sample to generate: prompt replication turns a prompt into G of these.

    The sampling RNG is keyed by (seed, prompt_id, sample_index), so the tokens do
    not depend on which slot, server or batch the request lands in.
    """

    prompt_id: int
    sample_index: int
    prompt_tokens: np.ndarray  # int32 [T_prompt]
    sampling: SamplingParams
    seed: int = 0


@dataclasses.dataclass(kw_only=True)
class Sample:
    """A finished (or aborted) generation with everything the learner needs.

    Attributes:
      prompt_id, sample_index: identity of the request.
      prompt_tokens: int32 [T_prompt].
      response_tokens: int32 [T_resp] (includes the EOS token when finish_reason is EOS).
      behaviour_logprobs: float32 [T_resp], log mu(token) under the processed
        (temperature, top-k, top-p) distribution of the weights that sampled it.
      token_versions: int32 [T_resp], policy version that sampled each token.
      start_version: policy version when the sample started (staleness is measured from it).
      finish_reason: EOS, LENGTH (truncated) or ABORTED.
      reward: scalar reward, set after scoring; None before.
      reward_info: per-component rewards and errors.
      response_text: decoded response (set by the scheduler for logging/rewards).
      response_mask: optional float32 [T_resp]: 1.0 on tokens the policy sampled
        (trained), 0.0 on tokens inserted between turns of a multi-turn episode
        (chat-template glue, environment observations, tool output). None means
        every response token was sampled (single-turn). Where it is 0,
        ``behaviour_logprobs`` is 0.0 and ``token_versions`` holds the sample's
        start version (so staleness, the oldest stamp, is unchanged by it).
      routed_experts: mixture-of-experts engines only: int16 [T_prompt + T_resp, L, k],
        the top-k experts each layer's router chose for each token when the engine
        fed it (prompt tokens at prefill, response token i at the decode step that
        sampled token i + 1); -1 rows for tokens it never fed (the last response
        token) or fed without recording. Partial rollout ("continue") keeps earlier
        tokens' routes; "recompute" takes the re-prefill's. What the learner replays
        under ``LearnerConfig.router_replay``. None: no routes (a dense model).
    """

    prompt_id: int
    sample_index: int
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    start_version: PolicyVersion
    finish_reason: FinishReason
    reward: float | None = None
    reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    response_text: str = ""
    response_mask: np.ndarray | None = None
    routed_experts: np.ndarray | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == FinishReason.LENGTH

    def staleness(self, learner_version: PolicyVersion) -> int:
        """learner_version - start_version (>= 0 in a correct system)."""
        return int(learner_version) - int(self.start_version)


@dataclasses.dataclass(kw_only=True)
class TrainBatch:
    """Padded, time-aligned arrays for one learner step (host numpy or device jax).

    Position t predicts target t: ``target_ids_bt[b, t] == input_ids_bt[b, t + 1]``.
    Only response targets carry loss (``loss_mask_bt``).

    Attributes:
      input_ids_bt: int32 [B, T].
      positions_bt: int32 [B, T] absolute positions (0-based).
      target_ids_bt: int32 [B, T].
      loss_mask_bt: float32 [B, T], 1.0 on response targets, else 0.0.
      advantages_bt: float32 [B, T] (per-sequence advantage broadcast over tokens).
      behaviour_logp_bt: float32 [B, T] engine logprobs of the targets (0 where masked).
      token_versions_bt: int32 [B, T] version that sampled each target (-1 where masked).
      cycle_bt: int32 [B, T], the row's replay cycle, constant along the row: 0 fresh
        (from the generation servers), 1 replayed from the buffer (ReFlow's dual
        cycle); broadcast over tokens like the advantages so every field shares one
        layout. None means every row is fresh.
      segment_ids_bt: int32 [B, T]: the sequence each token belongs to within its
        row, 1, 2, ... (0 on a packed row's padding); positions restart at 0 per
        sequence. ``pack_batch`` writes 1 everywhere (one sequence per row),
        ``learner.packing.pack_rows`` packs rows. None also means one per row.
      routed_experts_btlk: int16 [B, T, L, k]: the experts the engine routed input
        token t of each row to, per layer (``Sample.routed_experts``; -1: none
        recorded, route live). None: no routes (dense model, or a sample without).
    """

    input_ids_bt: Any
    positions_bt: Any
    target_ids_bt: Any
    loss_mask_bt: Any
    advantages_bt: Any
    behaviour_logp_bt: Any
    token_versions_bt: Any
    cycle_bt: Any = None
    segment_ids_bt: Any = None
    routed_experts_btlk: Any = None
