"""Replay buffer of recent trajectories: host-side numpy, no threads, its own RNG.

ReFlow (arXiv 2610.21640) replays *recent* trajectories to amortise rollout cost
without heavy staleness; its paper is not available here, so every rule below
follows a named published mechanism:

- Storage and caps follow Marin's replay buffer: FIFO capacity with the oldest
  evicted; a trajectory retires after ``max_reuse`` replays (Marin's
  ``max_samples``); it is kept only while its age (learner version - the oldest
  version among its tokens) is at most ``max_age`` (Marin's
  ``max_rollout_step_delay``); advantages are computed once, at ingestion.
- Buffer-wide sampling: uniform without removal (Arnal et al., arXiv 2604.08706),
  recency weights (i + 1)^a (Marin), freshness-decayed priority
  p_base * exp(-age / tau) (FreshPER, arXiv 2604.16918); see ``replay_sampling``.
- Per-prompt sampling: RePO (arXiv 2506.09340) recent-k / highest-reward-k /
  max-variance-k among the stored samples of the same prompt.

Guarantees (tested): a drawn trajectory has age <= max_age at the version it is
drawn for and has been drawn at most ``max_reuse`` times; it is never drawn at the
version it was ingested (its fresh use); learner versions only go up. Every
ingested trajectory is accounted for:
    ingested == size + evicted_capacity + evicted_age + evicted_reuse
(``rejected_*`` count offered trajectories that were never stored).

``state_dict()`` / ``from_state_dict`` capture contents, counters and the RNG
state, so a restored buffer draws exactly what the uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxflash.replay.replay_config import ReplayConfig
from jaxflash.replay.replay_entry import (
    Replayed,
    ReplayEntry,
    advantage_array,
    check_sample,
    decode_arrays,
    encode_arrays,
    freeze_sample,
    pack_entries,
    prompt_key,
    unpack_entries,
)
from jaxflash.replay.replay_sampling import (
    PRIORITY_FLOOR,
    draw_without_replacement,
    freshness_priorities,
    recency_weights,
    select_for_prompt,
)
from jaxflash.replay.staleness import start_version_of
from jaxflash.types import Sample

EVICTION_REASONS = ("capacity", "age", "reuse")
_STATE_FORMAT = 1


class ReplayBuffer:
    """Trajectories of the last few policy versions (see module docstring)."""

    def __init__(self, config: ReplayConfig):
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self._entries: dict[int, ReplayEntry] = {}  # insertion order == uid order
        self._by_prompt: dict[str, list[int]] = {}
        self._next_uid = 0
        self._version: int | None = None
        self._counts = dict.fromkeys(
            (
                "ingested",
                "rejected_age",
                "rejected_anomaly",
                "rejected_uniform",
                "replayed",
                *(f"evicted_{r}" for r in EVICTION_REASONS),
            ),
            0,
        )
        # reuse_hist[k]: trajectories that left the buffer after k replays.
        self._reuse_hist = np.zeros(config.max_reuse + 1, np.int64)
        # age_hist[a]: replays drawn at age a (cumulative).
        self._age_hist = np.zeros(config.max_age + 1, np.int64)

    # ---------------------------------------------------------------- versions
    def _check_version(self, learner_version: int) -> int:
        v = int(learner_version)
        if self._version is not None and v < self._version:
            raise ValueError(
                f"ReplayBuffer: learner version {v} after version {self._version}; "
                "versions only go up"
            )
        return v

    def _advance(self, learner_version: int) -> None:
        v = self._check_version(learner_version)
        self._version = v
        expired = [u for u, e in self._entries.items() if e.age(v) > self.config.max_age]
        for uid in expired:
            self._evict(uid, "age")

    def _evict(self, uid: int, reason: str) -> None:
        e = self._entries.pop(uid)
        keys = self._by_prompt[e.prompt_key]
        keys.remove(uid)
        if not keys:
            del self._by_prompt[e.prompt_key]
        self._counts[f"evicted_{reason}"] += 1
        self._reuse_hist[e.replays] += 1

    # ---------------------------------------------------------------- ingest
    def ingest(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[Any],
        *,
        learner_version: int,
    ) -> int:
        """Store the fresh samples trained at ``learner_version`` with their advantages.

        Samples are grouped by prompt_id for ``drop_uniform_groups`` (rewards
        within 1e-6 of each other count as equal). A sample whose age one version
        later would exceed ``max_age`` is never replayable and is not stored
        (``rejected_age``); one with a start or token version above
        ``learner_version`` (a version from the future: a bug upstream) is not stored
        (``rejected_anomaly``). A refused call changes nothing.

        Args:
          samples: scored Samples (finite reward; arrays of equal length T_resp).
          advantages: per sample a float (per-sequence) or float [T_resp].
          learner_version: the version these samples are trained at (fresh cycle).

        Returns:
          Number of samples stored.

        Raises:
          ValueError: lengths differ, a bad sample / advantage (names the sample),
            or a learner version lower than one seen before.
        """
        if len(samples) != len(advantages):
            raise ValueError(
                f"ReplayBuffer.ingest: {len(samples)} samples but {len(advantages)} advantages"
            )
        v = self._check_version(learner_version)
        checked = []
        for s, a in zip(samples, advantages, strict=True):
            what = f"ReplayBuffer.ingest sample (prompt {s.prompt_id}, index {s.sample_index})"
            check_sample(s, what)
            # Everything is checked (and copied) before anything is stored.
            checked.append((freeze_sample(s), advantage_array(a, s, what)))
        self._advance(v)
        rewards_by_prompt: dict[int, list[float]] = {}
        for s, _ in checked:
            rewards_by_prompt.setdefault(s.prompt_id, []).append(float(s.reward))
        stored = 0
        for s, a in checked:
            group = rewards_by_prompt[s.prompt_id]
            if self.config.drop_uniform_groups and max(group) - min(group) <= 1e-6:
                self._counts["rejected_uniform"] += 1
                continue
            start = start_version_of(s)
            newest = int(np.max(s.token_versions)) if len(s.token_versions) else start
            if max(start, newest) > v:
                reason = "anomaly"
            elif v + 1 - start > self.config.max_age:
                reason = "age"
            else:
                reason = None
            if reason:
                self._counts[f"rejected_{reason}"] += 1
                continue
            entry = ReplayEntry(
                uid=self._next_uid,
                sample=s,
                advantage=np.array(a, copy=True),
                prompt_key=prompt_key(s.prompt_tokens),
                start_version=start,
                ingest_version=v,
            )
            entry.advantage.flags.writeable = False
            self._next_uid += 1
            self._entries[entry.uid] = entry
            self._by_prompt.setdefault(entry.prompt_key, []).append(entry.uid)
            self._counts["ingested"] += 1
            stored += 1
        while len(self._entries) > self.config.capacity:
            self._evict(next(iter(self._entries)), "capacity")
        return stored

    # ---------------------------------------------------------------- draws
    def _eligible(self, uids: Sequence[int]) -> list[int]:
        # Never replay at the version of its fresh use (same step = same data twice).
        return [u for u in uids if self._entries[u].ingest_version < self._version]

    def _take(self, uids: Sequence[int]) -> list[Replayed]:
        out = []
        for uid in uids:
            e = self._entries[uid]
            e.replays += 1
            age = e.age(self._version)
            self._age_hist[age] += 1
            out.append(
                Replayed(
                    sample=e.sample,
                    advantage=e.advantage,
                    uid=uid,
                    prompt_key=e.prompt_key,
                    age=age,
                    replay_count=e.replays,
                )
            )
        self._counts["replayed"] += len(out)
        for uid in uids:
            if self._entries[uid].replays >= self.config.max_reuse:
                self._evict(uid, "reuse")
        return out

    def _base_priority(self, e: ReplayEntry) -> float:
        if self.config.freshness_base == "uniform":
            return 1.0
        a = e.advantage
        if a.ndim == 1:
            m = e.sample.response_mask
            a = a if m is None else a[np.asarray(m) > 0]
            a = np.abs(a).mean() if a.size else np.float32(0.0)
        return float(abs(a)) + PRIORITY_FLOOR

    def sample(self, n: int, *, learner_version: int) -> list[Replayed]:
        """Draw up to ``n`` distinct trajectories with the buffer-wide rule.

        Expired trajectories (age > max_age at ``learner_version``) are evicted
        first; fewer than ``n`` come back when fewer are eligible.

        Args:
          n: trajectories wanted, >= 0.
          learner_version: the version the replay cycle is trained at.

        Returns:
          Replayed records in draw order; each one's replay count is incremented
          and it retires (``evicted_reuse``) at ``max_reuse``.

        Raises:
          ValueError: n < 0, a per_prompt buffer (use ``sample_for_prompts``),
            or a learner version lower than one seen before.
        """
        if self.config.per_prompt:
            raise ValueError(
                "ReplayBuffer.sample: sampler='per_prompt' draws via sample_for_prompts"
            )
        if n < 0:
            raise ValueError(f"ReplayBuffer.sample: n must be >= 0, got {n}")
        self._advance(learner_version)
        uids = self._eligible(list(self._entries))
        cfg = self.config
        if cfg.sampler == "uniform":
            weights = np.ones(len(uids))
        elif cfg.sampler == "recency":
            exponent = 1.0 if cfg.recency_exponent is None else cfg.recency_exponent
            weights = recency_weights(len(uids), exponent)
        else:
            tau = 2.0 if cfg.freshness_tau is None else cfg.freshness_tau
            es = [self._entries[u] for u in uids]
            weights = freshness_priorities(
                np.array([self._base_priority(e) for e in es], np.float64),
                np.array([e.age(self._version) for e in es], np.int64),
                tau,
            )
        picked = draw_without_replacement(self._rng, int(n), weights)
        return self._take([uids[i] for i in picked])

    def sample_for_prompts(
        self, requests: Sequence[tuple[str, int]], *, learner_version: int
    ) -> list[Replayed]:
        """RePO: for each (prompt_key, k), up to k stored samples of that prompt.

        Args:
          requests: (prompt key, k >= 0) pairs, served in order; a trajectory is
            drawn at most once per call.
          learner_version: the version the replay cycle is trained at.

        Returns:
          Replayed records grouped by request, each group in the strategy's order.

        Raises:
          ValueError: not a per_prompt buffer, a negative k, or a learner version
            lower than one seen before.
        """
        if not self.config.per_prompt:
            raise ValueError(
                f"ReplayBuffer.sample_for_prompts needs sampler='per_prompt', "
                f"this buffer uses {self.config.sampler!r}"
            )
        self._advance(learner_version)
        strategy = self.config.prompt_strategy or "recent"
        taken: list[int] = []
        for key, k in requests:
            if k < 0:
                raise ValueError(f"ReplayBuffer.sample_for_prompts: k must be >= 0, got {k}")
            uids = [u for u in self._eligible(self._by_prompt.get(key, ())) if u not in taken]
            if not uids or k == 0:
                continue
            rewards = np.array([self._entries[u].sample.reward for u in uids], np.float64)
            picked = select_for_prompt(strategy, rewards, np.array(uids, np.int64), k)
            taken.extend(uids[i] for i in picked)
        return self._take(taken)

    def stored_for(self, key: str) -> int:
        """Trajectories of the prompt ``key`` currently stored (any age)."""
        return len(self._by_prompt.get(key, ()))

    # ---------------------------------------------------------------- counters
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def version(self) -> int | None:
        """The latest learner version seen (None before the first call)."""
        return self._version

    def counters(self) -> dict[str, int]:
        """Cumulative counts (see the module docstring for the identity they satisfy)."""
        return {**self._counts, "size": len(self._entries)}

    def reuse_histogram(self) -> np.ndarray:
        """int64 [max_reuse + 1]: trajectories that left the buffer after k replays."""
        return self._reuse_hist.copy()

    def age_histogram(self) -> np.ndarray:
        """int64 [max_age + 1]: replays drawn at each age (cumulative)."""
        return self._age_hist.copy()

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """JSON-able snapshot: entries (base64 npz), counters, histograms, RNG state.

        Store it in ``CheckpointMeta.extra["replay"]``; ``from_state_dict`` with the
        same config restores a buffer whose future draws equal this one's.
        """
        arrays, meta = pack_entries(list(self._entries.values()))
        return {
            "format": _STATE_FORMAT,
            "config": dataclasses.asdict(self.config),
            "arrays": encode_arrays(arrays),
            "entries": meta,
            "next_uid": self._next_uid,
            "version": self._version,
            "counts": dict(self._counts),
            "reuse_hist": self._reuse_hist.tolist(),
            "age_hist": self._age_hist.tolist(),
            "rng": self._rng.bit_generator.state,
        }

    @classmethod
    def from_state_dict(cls, config: ReplayConfig, state: dict[str, Any]) -> ReplayBuffer:
        """Rebuild a buffer saved by ``state_dict``.

        Raises:
          ValueError: an unknown format, or ``config`` differing from the saved one
            (names the fields): resuming with other caps would not replay the same.
        """
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"ReplayBuffer state format {state.get('format')!r} != {_STATE_FORMAT}"
            )
        saved = state["config"]
        differ = sorted(k for k, v in dataclasses.asdict(config).items() if saved.get(k) != v)
        if differ:
            raise ValueError(
                f"ReplayBuffer.from_state_dict: config differs from the saved one in {differ}"
            )
        buf = cls(config)
        for e in unpack_entries(decode_arrays(state["arrays"]), state["entries"]):
            buf._entries[e.uid] = e
            buf._by_prompt.setdefault(e.prompt_key, []).append(e.uid)
        buf._next_uid = int(state["next_uid"])
        buf._version = None if state["version"] is None else int(state["version"])
        buf._counts.update({k: int(v) for k, v in state["counts"].items()})
        buf._reuse_hist = np.asarray(state["reuse_hist"], np.int64)
        buf._age_hist = np.asarray(state["age_hist"], np.int64)
        buf._rng.bit_generator.state = state["rng"]
        return buf
