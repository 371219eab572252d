"""The environment manager: every episode is its own loop, with no barrier between episodes.

    group (one env seed) ─► G + r episodes ─► reset (worker) ─► turn: request ─► server
                                                  ▲                                │
                       step (worker, deadline) ◄──┴──── action text ◄── sampled ◄──┘
    first G episodes to finish ─► GroupBuffer (GRPO group); the other r aborted, counted

ROLL Flash's environment-level asynchronous rollout (arXiv 2510.11345): while one
episode waits on its environment, the other episodes' turns are generated; each
turn is one request to the generation servers, routed on its own like an RLVR
sample (``runtime.routing.RequestRouter``: best server per turn -- prompt
replication per turn -- deadlines, retries, dead servers). Staleness follows the
RLVR rules: an episode's start version (the version published when it started)
bounds its staleness, so a group is as old as its oldest episode; a turn running
at a weight update continues, recomputes or restarts under the new weights
(``rollout.partial_rollout``, done by the servers).

Redundancy (ROLL's ``group_size_redundancy``): each group launches group_size + r
episodes sharing its environment seed; the first group_size to finish form the
group (renumbered 0..G-1 in finishing order; ``reward_info["episode_index"]``
keeps the launch index), the rest are aborted and counted
(``episodes_aborted_redundant``) -- a straggling environment no longer holds up its
group.

Faults are isolated per episode. An environment that raises, returns garbage or
misses its deadline (``runtime.rollout.env_calls``) ends its episode with the
``EnvFailure`` reason (counted ``env_failures_<reason>``); the environment
instance is dropped (a hung one is never touched again). The group goes on: a
spare redundant episode covers it, else the episode is restarted with a fresh
environment (``episodes_restarted``, up to ``max_env_restarts`` per group), and
only then does the group fail (``FailureReason.ENV_FAILURE``). A failed group's
episodes that did not finish -- the failing one and those it stops -- are reported
with it (their tokens so far), so each has its rollouts.jsonl row (outcome failed).

Every episode started ends exactly once (``runtime.episode_groups.EPISODE_ENDS``).

The scheduler (``runtime.scheduler.RolloutScheduler``) and ``BatchAssembler`` drive
this object through the same methods as the RLVR ``Dispatcher``. Thread-free:
environment calls run on workers that only post to the ``Inbox``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from jaxflash.envs.base import EnvFailure, EnvFailureReason, ResetOutcome
from jaxflash.envs.episode import EpisodeEnd, split_turn_index
from jaxflash.envs.training import trajectory_to_sample, unfinished_sample
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.rollout.admission import admit_all
from jaxflash.runtime.rollout.env_calls import EnvCalls, close_env
from jaxflash.runtime.rollout.episode_groups import (
    EPISODE_ENDS,
    EpisodeGroup,
    EpisodeRun,
    EpisodeSettings,
)
from jaxflash.runtime.rollout.routing import RequestRouter
from jaxflash.runtime.rollout.settings import (
    DispatchFactory,
    DispatchParts,
    DispatchWatch,
    InFlight,
    RolloutSettings,
)
from jaxflash.types import FailureReason, Prompt

log = logging.getLogger(__name__)


# Counters that only grow on a fault: present (as 0) from the first step on.
ZERO_COUNTERS = (
    "env_failures",
    *(f"env_failures_{reason}" for reason in EnvFailureReason),
    "env_calls",
    "env_calls_abandoned",
    "env_close_errors",
)


def episode_dispatch(episodes: EpisodeSettings) -> DispatchFactory:
    """The agentic workload's ``DispatchFactory``: each admitted group is played as G
    (+ redundancy) episodes by an ``EpisodeDispatcher``."""

    def build(parts: DispatchParts, settings: RolloutSettings) -> EpisodeDispatcher:
        return EpisodeDispatcher(parts, settings, episodes=episodes)

    return build


class EpisodeDispatcher:
    """Runs each admitted group's episodes as independent loops (see module).

    Args:
      parts: as ``Dispatcher`` (the buffer's group size is G; a "prompt" is a group,
        ``Prompt.meta["env_seed"]`` its seed); ``parts.restored`` tells how many
        episodes were running at the checkpoint (``episodes_aborted_on_resume``).
      settings: G episodes kept per group; sampling and seed of every turn request
        (max_new_tokens is each turn's budget); the policy version, deadline and
        retries per turn, as ``Dispatcher``.
      episodes: environments, rendering and redundancy.

    Counts (``counts``): episodes_*, turns_generated, env_failures*, env_calls*,
    env_close_errors, samples_late and its router's samples_* / server_*.

    Raises:
      ValueError: ``settings.prompt_replication`` is False (every turn is routed on
        its own).
    """

    def __init__(
        self, parts: DispatchParts, settings: RolloutSettings, *, episodes: EpisodeSettings
    ) -> None:
        if not settings.prompt_replication:
            raise ValueError("prompt_replication=False has no meaning for episodes")
        self.pool, self.inbox, self.admission = parts.pool, parts.inbox, parts.admission
        self.ledger, self.buffer, self.settings = parts.ledger, parts.buffer, episodes
        self.G, self.sampling, self.seed = settings.group_size, settings.sampling, settings.seed
        self.clock = parts.clock
        self.counters: collections.Counter = collections.Counter()
        self.max_turns = episodes.limits.max_turns
        self.router = RequestRouter(
            self.pool,
            policy_version=settings.policy_version,
            sample_deadline_s=settings.sample_deadline_s,
            max_retries=settings.max_retries,
            clock=self.clock,
            on_failed=self._fail_group,
            on_halt=self._halt,
        )
        self.calls = EnvCalls(self.inbox, self.clock, runner=episodes.runner)
        self.groups: dict[int, EpisodeGroup] = {}
        self.watch = DispatchWatch(self._stats, self._counts, lambda: [])  # envs score
        # Episodes running at the checkpoint this run resumes from were lost with it.
        restored = parts.restored
        lost = restored.get("episodes_started", 0) - sum(restored.get(k, 0) for k in EPISODE_ENDS)
        self.counters["episodes_aborted_on_resume"] += lost
        # Every documented counter is in every metrics row, zero until it counts.
        for name in ("episodes_started", *EPISODE_ENDS, *ZERO_COUNTERS):
            self.counters.setdefault(name, 0)

    # ------------------------------------------------------------------ one step

    def poll(self) -> int:
        """Handle turns and environment outcomes, deaths and deadlines, then admit."""
        events = self.inbox.drain()
        for kind, *payload in events:
            if kind == "generated":
                self._on_turn(payload[0])
            elif kind == "env":
                key = self.calls.done(payload[0])
                if key is not None:
                    self._env_returned(key, payload[1])
            else:
                raise ValueError(f"EpisodeDispatcher: unexpected inbox event {kind!r}")
        if self.router.check():  # a restarted generation process: admit again
            self.admission.reopen()
        for key, outcome in self.calls.expired(self.clock.now()):
            run = self._run(key)
            if run is not None:
                run.lose_env()  # its call may still be running: never touch it again
            self._env_returned(key, outcome)
        admit_all(self.admission, self.ledger, self.buffer, self.dispatch_prompt)
        return len(events)

    def idle(self) -> bool:
        """No episode running, nothing to report, nothing admissible."""
        return (
            not any(g.runs for g in self.groups.values())
            and not len(self.router.table)
            and not len(self.calls)
            and self.inbox.empty()
            and not self.admission.can_admit()
        )

    def dispatch_prompt(self, prompt: Prompt) -> None:
        """Start (or start again) the group of ``prompt``: G + r fresh episodes."""
        old = self.groups.pop(prompt.prompt_id, None)
        if old is not None:
            old.cancel(self.calls, self.counters, "episodes_aborted")
        group = self.groups[prompt.prompt_id] = EpisodeGroup(prompt)
        for _ in range(self.G + self.settings.redundancy):
            self._start_episode(group)

    # ------------------------------------------------------------------ for the batch side

    def next_deadline(self) -> float | None:
        """Earliest turn or environment-call deadline (None when nothing is pending)."""
        times = [t for t in (self.router.next_deadline(), self.calls.next_deadline()) if t]
        return min(times, default=None)

    def in_flight(self) -> dict[int, InFlight]:
        """Groups with an episode running (on a server or in its environment): how many,
        and the group's start version, the oldest of its kept and running episodes'
        (exact: an episode's start version is fixed when it starts)."""
        return {
            pid: InFlight(len(g.runs), g.start_version())
            for pid, g in sorted(self.groups.items())
            if g.runs
        }

    def end_prompt(self, prompt_id: int, *, abort: bool = False, scoring: bool = False) -> None:
        """The group was trained, dropped or is regenerated: drop what is left of it;
        with ``abort``, first stop its turns on servers and its running episodes
        (counted)."""
        del scoring  # episodes are scored by their environment, nothing waits on a reward
        if abort:
            self.router.abort_prompt(prompt_id)
            group = self.groups.pop(prompt_id, None)
            if group is not None:
                group.cancel(self.calls, self.counters, "episodes_aborted")
        self.router.table.forget(prompt_id)
        group = self.groups.get(prompt_id)
        if group is not None and not group.runs:
            del self.groups[prompt_id]

    def _counts(self) -> dict[str, int]:
        """What it, its router and its environment calls counted since it was built."""
        out = collections.Counter(self.counters)
        out.update(self.router.counts())
        out.update(self.calls.counts())
        return dict(out)

    def _stats(self) -> dict[str, Any]:
        """Instantaneous state for metrics.jsonl."""
        return {
            "samples_outstanding": len(self.router.table),
            "samples_scoring": 0,
            "episodes_running": sum(len(g.runs) for g in self.groups.values()),
            "env_calls_pending": len(self.calls),
        }

    # ------------------------------------------------------------------ episodes

    def _run(self, key: tuple[int, int]) -> EpisodeRun | None:
        group = self.groups.get(key[0])
        return None if group is None else group.runs.get(key[1])

    def _start_episode(self, group: EpisodeGroup) -> None:
        index, run = group.new_run(self.settings, self.router.version)
        self.counters["episodes_started"] += 1
        seed = int(group.prompt.meta["env_seed"])
        run.waits_on(self.calls.reset((group.prompt.prompt_id, index), run.env, seed))

    def _on_turn(self, sample: Any) -> None:
        """A server finished one turn: record it, then step the environment on a worker."""
        if self.router.received(sample) is None:
            return
        index, turn = split_turn_index(int(sample.sample_index), self.max_turns)
        key = (int(sample.prompt_id), index)
        run = self._run(key)
        if run is None or run.episode.awaiting != "policy" or run.episode.num_turns != turn:
            self.counters["samples_late"] += 1  # its episode was cancelled meanwhile
            return
        action_text = run.episode.record_turn(sample)
        self.counters["turns_generated"] += 1
        run.waits_on(self.calls.step(key, run.env, action_text))

    def _env_returned(self, key: tuple[int, int], outcome: Any) -> None:
        """An environment call came back (or expired): advance the episode."""
        run = self._run(key)
        if run is None:
            return
        run.waits_on(None)
        episode = run.episode
        if isinstance(outcome, ResetOutcome):
            episode.begin(outcome)
        else:
            episode.record_step(outcome)
        group = self.groups[key[0]]
        if episode.end is EpisodeEnd.ENV_FAILURE:
            self._env_failed(group, key[1], episode.failure)
        elif episode.done:
            self._finished(group, key[1])
        else:
            self.router.dispatch(episode.next_request(self.sampling, seed=self.seed))

    def _finished(self, group: EpisodeGroup, index: int) -> None:
        """An episode ended: the first G to finish form the group; then the rest stop."""
        run = group.runs.pop(index)
        close_env(run.env, self.counters)
        traj = run.episode.trajectory()
        pid = group.prompt.prompt_id
        if not traj.turns:  # the first prompt alone fills the context: a config problem
            self.counters["episodes_aborted"] += 1
            detail = f"episode {pid}/{index}: the first prompt does not fit the context"
            self._fail_group(pid, FailureReason.PROMPT_TOO_LONG, detail, ended=run)
            return
        sample = trajectory_to_sample(traj)
        sample = dataclasses.replace(
            sample,
            sample_index=len(group.kept),
            reward_info={**sample.reward_info, "episode_index": index},
        )
        group.kept.append(int(start_version_of(sample)))
        self.counters["episodes_finished"] += 1
        self.buffer.add(sample)
        if len(group.kept) == self.G and group.runs:
            group.cancel(self.calls, self.counters, "episodes_aborted_redundant")
            self.router.abort_prompt(pid)

    def _env_failed(self, group: EpisodeGroup, index: int, failure: EnvFailure) -> None:
        """Isolate a failed environment; a spare or restarted episode takes its place."""
        run = group.runs.pop(index)
        pid = group.prompt.prompt_id
        self.counters["episodes_env_failed"] += 1
        self.counters["env_failures"] += 1
        self.counters[f"env_failures_{failure.reason}"] += 1
        log.warning("environment of episode %d/%d failed: %s", pid, index, failure)
        if run.env is not None and failure.reason is not EnvFailureReason.TIMEOUT:
            close_env(run.env, self.counters)
        if len(group.kept) + len(group.runs) >= self.G:
            return  # a redundant episode covers it
        if group.restarts < self.settings.max_env_restarts:
            group.restart()
            self.counters["episodes_restarted"] += 1
            self._start_episode(group)
            return
        detail = (
            f"episode {pid}/{index}: environment {failure.reason} in {failure.phase} "
            f"({failure.detail}) after {group.restarts} restarts"
        )
        self._fail_group(pid, FailureReason.ENV_FAILURE, detail, ended=run)

    def _fail_group(
        self,
        prompt_id: int,
        failure: FailureReason,
        detail: str,
        *,
        ended: EpisodeRun | None = None,
    ) -> None:
        """The group cannot complete: fail it in the buffer, stop its episodes.

        The episodes the failure cuts short -- ``ended`` (the one whose failure
        failed the group, already out of ``runs``) and those still running -- go to
        the buffer as unfinished samples (``envs.training.unfinished_sample``: their
        tokens so far), numbered after the group's finished episodes, so the failed
        prompt has one rollouts.jsonl row per episode.
        """
        group = self.groups.get(prompt_id)
        unfinished = []
        if group is not None:
            cut = ([ended] if ended is not None else []) + [
                group.runs[i] for i in sorted(group.runs)
            ]
            unfinished = [
                unfinished_sample(run.episode.trajectory(), sample_index=len(group.kept) + j)
                for j, run in enumerate(cut)
            ]
        self.buffer.fail(prompt_id, failure, detail, unfinished=unfinished)
        self.router.abort_prompt(prompt_id)
        if group is not None:
            group.cancel(self.calls, self.counters, "episodes_aborted")

    def _halt(self) -> None:
        self.admission.halt()
        log.error("every generation server died: failing the groups in flight")
