"""What leaves the rollout scheduler untrained: dropped groups and surplus aborts.

Dropped groups (stale, filtered, failed) are closed in the ledger or resubmitted.
Once a batch is full, a prompt whose start version is below v + 1 - α would be
stale at the next step; it is aborted at once instead of finishing to be dropped.
Each such sample still gets its rollouts.jsonl row."""

from __future__ import annotations

from typing import Any

from jaxflash.replay.group_buffer import DroppedGroup
from jaxflash.replay.staleness import start_version_of
from jaxflash.runtime.ledger import failure_reason
from jaxflash.runtime.rollout import _correct
from jaxflash.types import PromptOutcome


class DropsAndSurplus:
    """Mixed into ``RolloutScheduler`` (scheduler.py); uses its state."""

    def _start_estimate(self, pid: int) -> float:
        """The start version an in-flight prompt's group will have (oldest sample's).

        Finished samples count with their own start version. An outstanding sample
        on a ``continue``/``recompute`` server keeps its start across weight updates
        (slot_loop stamps it when the sample first gets a slot): the estimate is the
        version its server held at dispatch -- exact when it got a slot before the
        server's next weight update, too old by the updates it spent queued
        otherwise (then it is aborted one step early, never kept too long). On a
        ``restart`` server a sample still running at the next publish is restarted
        at the new version, so it bounds nothing (inf).
        """
        start: float = self._min_start.get(pid, float("inf"))
        for k, r in self._out.items():
            server = self.servers[r.server]
            if k[0] == pid and getattr(server, "partial_rollout", "continue") != "restart":
                start = min(start, r.version)
        return start

    def _abort_surplus(
        self, learner_version: int
    ) -> tuple[list[DroppedGroup], list[dict[str, Any]]]:
        """The batch is full: abort in-flight prompts that would be stale at the next step.

        A prompt is doomed when its group's start version < (v + 1) - α. With
        ``stale_policy="drop"`` it is aborted on its servers, its pending group is
        discarded from the buffer and it is closed in the ledger as STALE
        "surplus_stale"; its capacity is freed now if a prompt started now would
        be fresh at the next step, else at the next ``release`` (as the synchronous
        loop). With "regenerate" its G requests are resubmitted (now, or at the next
        ``release`` when a sample started now would be doomed as well). Samples of
        it still arriving are counted ``samples_late`` and never trained.

        Returns:
          (groups discarded from the buffer with reason "surplus_stale", their rows).
        """
        oldest_fresh = learner_version + 1 - self.alpha
        now_fresh = self.clock.version >= oldest_fresh
        doomed = [
            pid
            for pid in sorted({k[0] for k in self._out})
            if pid in self._active and self._start_estimate(pid) < oldest_fresh
        ]
        dropped: list[DroppedGroup] = []
        rows: list[dict[str, Any]] = []
        for pid in doomed:
            regen = self.stale_policy == "regenerate"
            self.counters["samples_aborted_surplus"] += sum(k[0] == pid for k in self._out)
            self._abort_prompt(pid)
            for k in [k for k in self._scoring if k[0] == pid]:
                del self._scoring[k]  # its score arrives late and is discarded
            self._min_start.pop(pid, None)
            d = self.buffer.discard(pid, PromptOutcome.STALE, "surplus_stale", regenerate=regen)
            if d is not None:
                self.counters["samples_dropped_surplus_stale"] += len(d.samples)
                dropped.append(d)
                rows += [self._row(s, d.reason) for s in d.samples]
            if regen:
                self.counters["prompts_regenerated_stale"] += 1
                if now_fresh:
                    for i in range(self.G):
                        self._dispatch(self._request(self._active[pid], i))
                else:
                    self._regen_at_publish.append(pid)
                continue
            self.ledger.close(pid, PromptOutcome.STALE, "surplus_stale")
            if now_fresh:  # a replacement started now is fresh at the next step
                self._active.pop(pid, None)
            else:
                self._to_release.append(pid)
        return dropped, rows

    def _resolve_dropped(self, d: DroppedGroup) -> None:
        """Close a dropped group in the ledger, or resubmit it (regenerate)."""
        self._abort_prompt(d.prompt_id)  # e.g. siblings of a failed sample
        self.counters[f"samples_dropped_{d.reason}"] += len(d.samples)
        if d.regenerate and d.prompt_id in self._active:
            self.counters["prompts_regenerated_stale"] += 1
            self._min_start.pop(d.prompt_id, None)
            for i in range(self.G):
                self._dispatch(self._request(self._active[d.prompt_id], i))
            return
        failed = d.outcome == PromptOutcome.FAILED
        self.ledger.close(d.prompt_id, d.outcome, failure_reason(d.detail) if failed else d.reason)
        if d.outcome == PromptOutcome.FAILED:
            print(f"failed: {d.detail or d.reason}", flush=True)
        if self.refill_dropped:  # dynamic sampling: start a replacement now
            self._active.pop(d.prompt_id, None)
            self._min_start.pop(d.prompt_id, None)
        else:  # as the synchronous loop: the next prompts start at the next version
            self._to_release.append(d.prompt_id)

    def _row(self, s: Any, outcome: str) -> dict[str, Any]:
        prompt = self._active.get(s.prompt_id)
        versions = s.token_versions
        return {
            "prompt_id": int(s.prompt_id),
            "sample_index": int(s.sample_index),
            "prompt": getattr(prompt, "text", ""),
            "answer": getattr(prompt, "answer", ""),
            "response": s.response_text,
            "reward": s.reward,
            "correct": _correct(s),
            "reward_error": (s.reward_info or {}).get("error"),
            "finish_reason": str(s.finish_reason),
            "outcome": outcome,
            "start_version": int(start_version_of(s)),
            "token_version_min": int(versions.min()) if len(versions) else None,
            "token_version_max": int(versions.max()) if len(versions) else None,
            "response_len": len(s.response_tokens),
            "response_tokens": [int(t) for t in s.response_tokens],
        }
