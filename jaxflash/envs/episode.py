"""One multi-turn episode as a token-level state machine (no I/O, no threads).

The runtime drives it; the environment calls happen outside (on a worker, under a
deadline), so one scheduler can drive any number of episodes:

    ep = Episode(renderer, env.config, prompt_id=g, episode_index=i, env_seed=s,
                 start_version=v, max_context_tokens=C)
    ep.begin(checked_reset(env, s))                    # first prompt
    while not ep.done:
        sample = generate(ep.next_request(sampling))   # one turn = one GenerationRequest
        action_text = ep.record_turn(sample)           # sampled tokens kept as sampled
        ep.record_step(checked_step(env, action_text)) # observation delta appended
    traj = ep.trajectory()

Token layout (``Trajectory``): ``prompt_tokens`` is the first prompt; the response
side holds every later token in order -- each turn's sampled tokens (loss mask 1:
content and the end-of-turn token; behaviour logprob and policy version as sampled)
followed by the between-turn delta of the renderer (mask 0: closing glue, the
observation message, the next generation prompt; logprob 0, version -1). A turn's
request prompt is the whole context so far (prompt + response side).

Turn identity: turn t of episode i of prompt (group) g is the request
``(prompt_id=g, sample_index=i * max_turns + t)``, so every turn has its own
sampling RNG stream and key, and ``abort_prompt(g)`` stops the whole group (what
redundancy needs). ``split_turn_index`` inverts it.

How it ends (``EpisodeEnd``): the environment terminates (TERMINATED) or truncates
(ENV_TRUNCATED); ``max_turns`` turns were played (MAX_TURNS); the next turn would
not fit ``max_context_tokens`` (CONTEXT_FULL); an environment call failed
(ENV_FAILURE, with the ``EnvFailure``; a message the chat template rejects is a
``bad_observation``) -- the episode is then isolated, never trained, and counted
by reason.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from jaxflash.envs.base import (
    EnvConfig,
    EnvFailure,
    EnvFailureReason,
    ResetOutcome,
    StepOutcome,
)
from jaxflash.envs.chat import TurnRenderer
from jaxflash.types import FinishReason, GenerationRequest, PolicyVersion, Sample, SamplingParams


class EpisodeEnd(enum.StrEnum):
    """Why an episode ended."""

    TERMINATED = "terminated"
    ENV_TRUNCATED = "env_truncated"
    MAX_TURNS = "max_turns"
    CONTEXT_FULL = "context_full"
    ENV_FAILURE = "env_failure"


def turn_sample_index(episode_index: int, turn: int, max_turns: int) -> int:
    """``sample_index`` of turn ``turn`` of episode ``episode_index`` (see module)."""
    if not 0 <= turn < max_turns:
        raise ValueError(f"turn {turn} outside [0, max_turns={max_turns})")
    return episode_index * max_turns + turn


def split_turn_index(sample_index: int, max_turns: int) -> tuple[int, int]:
    """Inverse of ``turn_sample_index``: (episode_index, turn)."""
    return divmod(sample_index, max_turns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnRecord:
    """One policy turn and the environment's answer to it.

    Attributes:
      turn: 0-based turn number.
      offset: index of the turn's first sampled token on the response side.
      num_sampled: tokens the policy sampled this turn (its stop token included).
      finish_reason: EOS (ended by a stop id) or LENGTH (cut at the turn budget).
      action_text: the decoded response up to its stop id (what the env parsed).
      reward: the environment's reward for it (None until the step returned).
      invalid_action: the environment found no valid action in it.
      env_time_s: seconds the environment step took.
      observation: the environment's reply (None if the step failed).
      info: the step's info dict.
    """

    turn: int
    offset: int
    num_sampled: int
    finish_reason: FinishReason
    action_text: str
    reward: float | None = None
    invalid_action: bool = False
    env_time_s: float = 0.0
    observation: str | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trajectory:
    """A finished (or failed) episode, token in / token out.

    Arrays [R] are on the response side (everything after ``prompt_tokens``).

    Attributes:
      prompt_id, episode_index, env_seed, start_version: identity and the policy
        version when the episode started (its staleness is measured from the older of
        this and its oldest sampled token).
      prompt_tokens: int32 [P].
      response_tokens: int32 [R].
      loss_mask: float32 [R], 1.0 exactly on tokens the policy sampled.
      behaviour_logprobs: float32 [R], 0.0 where the mask is 0.
      token_versions: int32 [R], -1 where the mask is 0.
      token_turn: int32 [R], turn each token belongs to (a delta belongs to the turn
        it follows).
      turns: per-turn records; messages: the chat transcript (for logs).
      end: why it ended; failure: the environment failure (ENV_FAILURE only).
    """

    prompt_id: int
    episode_index: int
    env_seed: int
    start_version: PolicyVersion
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    token_turn: np.ndarray
    turns: tuple[TurnRecord, ...]
    messages: tuple[dict[str, str], ...]
    end: EpisodeEnd | None
    failure: EnvFailure | None

    @property
    def turn_rewards(self) -> np.ndarray:
        """float32 [K] rewards of the turns whose step returned."""
        return np.array([t.reward for t in self.turns if t.reward is not None], np.float32)

    @property
    def episode_return(self) -> float:
        """Sum of the turn rewards (undiscounted)."""
        return float(np.sum(self.turn_rewards, dtype=np.float64))

    @property
    def success(self) -> bool:
        """The last step reported ``info["success"]``."""
        return bool(self.turns and self.turns[-1].info.get("success", False))

    @property
    def invalid_actions(self) -> int:
        return sum(t.invalid_action for t in self.turns)

    @property
    def env_time_s(self) -> float:
        return float(sum(t.env_time_s for t in self.turns))


class Episode:
    """Token bookkeeping of one episode (see module). Not thread-safe: one driver at a time.

    Args:
      renderer: chat rendering of first prompts and between-turn deltas.
      limits: the environment's ``EnvConfig`` (``max_turns``, ``max_tokens_per_turn``).
      prompt_id: the group id (episodes sharing an environment seed share it).
      episode_index: index of this episode in its group (>= 0).
      env_seed: the environment seed of the group.
      start_version: policy version when the episode started.
      max_context_tokens: prompt + response limit (the engine's max_target_length).
    """

    def __init__(
        self,
        renderer: TurnRenderer,
        limits: EnvConfig,
        *,
        prompt_id: int,
        episode_index: int,
        env_seed: int,
        start_version: PolicyVersion,
        max_context_tokens: int,
    ) -> None:
        if episode_index < 0 or start_version < 0 or max_context_tokens < 2:
            raise ValueError(
                f"Episode: need episode_index >= 0, start_version >= 0, max_context_tokens "
                f">= 2; got {episode_index}, {start_version}, {max_context_tokens}"
            )
        self.renderer, self.limits = renderer, limits
        self.prompt_id, self.episode_index, self.env_seed = prompt_id, episode_index, env_seed
        self.start_version, self.max_context_tokens = start_version, max_context_tokens
        self._prompt: list[int] = []
        self._tokens: list[int] = []
        self._mask: list[float] = []
        self._logp: list[float] = []
        self._versions: list[int] = []
        self._token_turn: list[int] = []
        self._turns: list[TurnRecord] = []
        self._messages: list[dict[str, str]] = []
        self._state = "new"  # new -> policy <-> env -> done
        self.end: EpisodeEnd | None = None
        self.failure: EnvFailure | None = None

    # ------------------------------------------------------------------ state

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def awaiting(self) -> str | None:
        """ "policy" (call next_request), "env" (step the env), or None (new / done)."""
        return self._state if self._state in ("policy", "env") else None

    @property
    def num_turns(self) -> int:
        return len(self._turns)

    def context(self) -> np.ndarray:
        """int32 [P + R]: the prompt of the next turn."""
        return np.asarray(self._prompt + self._tokens, np.int32)

    def _expect(self, state: str, what: str) -> None:
        if self._state != state:
            raise RuntimeError(
                f"Episode {self.prompt_id}/{self.episode_index}: {what} while in state "
                f"{self._state!r} (expected {state!r})"
            )

    def _finish(self, end: EpisodeEnd, failure: EnvFailure | None = None) -> None:
        self._state, self.end, self.failure = "done", end, failure

    # ------------------------------------------------------------------ transitions

    def begin(self, reset: ResetOutcome) -> None:
        """Start from the environment's first observation (or its reset failure)."""
        self._expect("new", "begin")
        if reset.failure is not None:
            self._finish(EpisodeEnd.ENV_FAILURE, reset.failure)
            return
        self._messages = self.renderer.first_messages(reset.observation)
        self._prompt = self.renderer.first_prompt(reset.observation)
        self._state = "policy"
        if len(self._prompt) >= self.max_context_tokens:
            self._finish(EpisodeEnd.CONTEXT_FULL)

    def next_request(self, sampling: SamplingParams, *, seed: int = 0) -> GenerationRequest:
        """The request for the next turn: the whole context as prompt.

        ``sampling.max_new_tokens`` is replaced by the turn budget:
        min(limits.max_tokens_per_turn, max_context_tokens - len(context)).
        """
        self._expect("policy", "next_request")
        context = self.context()
        budget = min(self.limits.max_tokens_per_turn, self.max_context_tokens - len(context))
        # An agent session narrows it to the request's max_tokens (envs.agent_turns).
        sampling = self.renderer.turn_sampling(dataclasses.replace(sampling, max_new_tokens=budget))
        return GenerationRequest(
            prompt_id=self.prompt_id,
            sample_index=turn_sample_index(
                self.episode_index, self.num_turns, self.limits.max_turns
            ),
            prompt_tokens=context,
            sampling=sampling,
            seed=seed,
        )

    def record_turn(self, sample: Sample) -> str:
        """Append one turn's sampled tokens exactly as sampled; returns its action text.

        Raises:
          ValueError: an aborted sample (request the turn again), a sample of another
            turn or episode, one whose prompt is not this context, or per-token arrays
            whose lengths differ.
        """
        self._expect("policy", "record_turn")
        want = turn_sample_index(self.episode_index, self.num_turns, self.limits.max_turns)
        tag = f"episode {self.prompt_id}/{self.episode_index} turn {self.num_turns}"
        if (sample.prompt_id, sample.sample_index) != (self.prompt_id, want):
            raise ValueError(
                f"{tag}: got sample {(sample.prompt_id, sample.sample_index)}, expected "
                f"{(self.prompt_id, want)}"
            )
        if sample.finish_reason == FinishReason.ABORTED:
            raise ValueError(f"{tag}: the sample was aborted; request the turn again")
        tokens = np.asarray(sample.response_tokens).reshape(-1)
        logp = np.asarray(sample.behaviour_logprobs, np.float32).reshape(-1)
        versions = np.asarray(sample.token_versions).reshape(-1)
        if tokens.size < 1 or logp.size != tokens.size or versions.size != tokens.size:
            raise ValueError(
                f"{tag}: {tokens.size} tokens, {logp.size} logprobs, {versions.size} versions"
            )
        if not np.array_equal(np.asarray(sample.prompt_tokens), self.context()):
            raise ValueError(f"{tag}: the sample's prompt is not this episode's context")
        self.renderer.observe_turn(sample)
        action_text = self.renderer.response_text(tokens)
        self._turns.append(
            TurnRecord(
                turn=self.num_turns,
                offset=len(self._tokens),
                num_sampled=int(tokens.size),
                finish_reason=sample.finish_reason,
                action_text=action_text,
            )
        )
        self._append(tokens.tolist(), 1.0, logp.tolist(), versions.tolist())
        self._messages.append({"role": "assistant", "content": action_text})
        self._state = "env"
        return action_text

    def record_step(self, outcome: StepOutcome) -> None:
        """Record the environment's answer to the last turn; append its delta or end."""
        self._expect("env", "record_step")
        last = self._turns[-1]
        if outcome.failure is not None:
            self._turns[-1] = dataclasses.replace(last, env_time_s=outcome.elapsed_s)
            self._finish(EpisodeEnd.ENV_FAILURE, outcome.failure)
            return
        obs, reward, terminated, truncated, info = outcome.result
        self._turns[-1] = dataclasses.replace(
            last,
            reward=float(reward),
            invalid_action=bool(info.get("invalid_action", False)),
            env_time_s=outcome.elapsed_s,
            observation=obs,
            info=dict(info),
        )
        role = str(info.get("role", "user"))
        self._messages.append({"role": role, "content": obs})
        earlier = info.get("turn_rewards")  # an agent scores its turns when it returns
        if terminated and earlier is not None:
            for i, r in enumerate(list(earlier)[: len(self._turns) - 1]):
                self._turns[i] = dataclasses.replace(self._turns[i], reward=float(r))
        if terminated:
            return self._finish(EpisodeEnd.TERMINATED)
        if truncated:
            return self._finish(EpisodeEnd.ENV_TRUNCATED)
        if self.num_turns >= self.limits.max_turns:
            return self._finish(EpisodeEnd.MAX_TURNS)
        ended_with_eot = last.finish_reason == FinishReason.EOS and (
            self._tokens[-1] == self.renderer.eot_id
        )
        try:
            delta = self.renderer.between_turns(obs, role=role, ended_with_eot=ended_with_eot)
        except ValueError as e:  # the template rejects the message: the env's, not the run's
            failure = EnvFailure(
                reason=EnvFailureReason.BAD_OBSERVATION, phase="step", detail=str(e)
            )
            return self._finish(EpisodeEnd.ENV_FAILURE, failure)
        # The next turn needs at least one token of room after the delta.
        if len(self._prompt) + len(self._tokens) + len(delta) + 1 > self.max_context_tokens:
            return self._finish(EpisodeEnd.CONTEXT_FULL)
        self._append(delta, 0.0, [0.0] * len(delta), [-1] * len(delta))
        self._state = "policy"

    def _append(self, tokens: list[int], mask: float, logp: list[float], versions: list[int]):
        self._tokens += [int(t) for t in tokens]
        self._mask += [mask] * len(tokens)
        self._logp += [float(x) for x in logp]
        self._versions += [int(v) for v in versions]
        self._token_turn += [len(self._turns) - 1] * len(tokens)

    # ------------------------------------------------------------------ result

    def trajectory(self) -> Trajectory:
        """Snapshot of the episode so far (complete once ``done``)."""
        return Trajectory(
            prompt_id=self.prompt_id,
            episode_index=self.episode_index,
            env_seed=self.env_seed,
            start_version=self.start_version,
            prompt_tokens=np.asarray(self._prompt, np.int32),
            response_tokens=np.asarray(self._tokens, np.int32),
            loss_mask=np.asarray(self._mask, np.float32),
            behaviour_logprobs=np.asarray(self._logp, np.float32),
            token_versions=np.asarray(self._versions, np.int32),
            token_turn=np.asarray(self._token_turn, np.int32),
            turns=tuple(self._turns),
            messages=tuple(dict(m) for m in self._messages),
            end=self.end,
            failure=self.failure,
        )
