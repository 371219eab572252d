"""The ``rollout`` config section: B prompts x G samples per step, sampling, slots,
the staleness bound alpha, truncation, dynamic-sampling filters, partial rollout at a
weight update (ROLL Flash, arXiv 2510.11345) and per-sample deadlines.

``ExperimentConfig`` (``runtime.config.experiment``) holds one and checks its combinations
with the other sections; the checks here need only the section's own fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxflash.runtime.config.specs import check
from jaxflash.types import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """Generation: B prompts x G samples per step, sampling, slots, staleness bound.

    ``max_prefill_length`` 0 = ``data.max_prompt_tokens`` (see ``runtime.prompt_lengths``).
    """

    prompts_per_step: int = 8
    group_size: int = 4
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    num_slots: int = 32
    max_prefill_length: int = 0
    async_ratio: int = 0
    truncation: str = "penalty"
    truncation_penalty: float = 0.0
    filter_zero_variance: bool = False
    filter_min_mean: float | None = None  # drop groups with mean reward below
    filter_max_mean: float | None = None  # drop groups with mean reward above
    filter_min_std: float | None = None  # drop groups with reward std below
    # In-flight samples at a weight update; only with async_ratio > 0 (disjoint slices).
    partial_rollout: str = "continue"  # continue | recompute | restart
    # A group older than alpha allows (alpha > 0): "drop" it, "regenerate" it, or "pace":
    # admit and train earliest-deadline-first so none exceeds alpha and none is
    # discarded -- the learner waits for a due straggler instead (runtime.rollout.pacing).
    stale_policy: str = "drop"
    sample_deadline_s: float = 600.0  # a sample not back by then is aborted and retried
    max_retries: int = 1  # retries of a timed-out sample before its prompt fails
    # Agentic (env.name set): extra episodes per group; the first group_size to finish
    # are kept, the rest aborted (ROLL's group_size_redundancy).
    group_redundancy: int = 0
    # Decode steps per engine dispatch: fewer host round trips per token; admissions,
    # aborts and weight updates wait for the block's end. Tokens do not depend on it.
    decode_block: int = 1
    # KV cache of the engines: "dense" reserves prompt + response positions per slot;
    # "paged" holds num_pages pages of page_size positions, taken as samples grow
    # (0 pages = the dense reservation; see generation.page_pool).
    kv_cache: str = "dense"
    page_size: int = 16
    num_pages: int = 0

    def __post_init__(self) -> None:
        check(
            self.prompts_per_step >= 1,
            f"rollout.prompts_per_step must be >= 1, got {self.prompts_per_step}",
        )
        check(self.group_size >= 1, f"rollout.group_size must be >= 1, got {self.group_size}")
        check(self.num_slots >= 1, f"rollout.num_slots must be >= 1, got {self.num_slots}")
        check(
            self.max_prefill_length >= 0,
            f"rollout.max_prefill_length must be >= 0 (0 = data.max_prompt_tokens), "
            f"got {self.max_prefill_length}",
        )
        check(self.async_ratio >= 0, f"rollout.async_ratio must be >= 0, got {self.async_ratio}")
        check(
            self.truncation in ("penalty", "mask", "none"),
            f"rollout.truncation must be penalty | mask | none, got {self.truncation!r}",
        )
        check(
            self.partial_rollout in ("continue", "recompute", "restart"),
            "rollout.partial_rollout must be continue | recompute | restart, "
            f"got {self.partial_rollout!r}",
        )
        check(
            self.stale_policy in ("drop", "regenerate", "pace"),
            f"rollout.stale_policy must be drop | regenerate | pace, got {self.stale_policy!r}",
        )
        check(
            self.sample_deadline_s > 0,
            f"rollout.sample_deadline_s must be > 0, got {self.sample_deadline_s}",
        )
        check(self.max_retries >= 0, f"rollout.max_retries must be >= 0, got {self.max_retries}")
        check(
            self.group_redundancy >= 0,
            f"rollout.group_redundancy must be >= 0, got {self.group_redundancy}",
        )
        check(self.decode_block >= 1, f"rollout.decode_block must be >= 1, got {self.decode_block}")
        check(
            self.kv_cache in ("dense", "paged"),
            f"rollout.kv_cache must be dense | paged, got {self.kv_cache!r}",
        )
        check(self.page_size >= 1, f"rollout.page_size must be >= 1, got {self.page_size}")
        check(
            self.num_pages >= 0,
            f"rollout.num_pages must be >= 0 (0 = slots x positions / page_size), "
            f"got {self.num_pages}",
        )
        if self.kv_cache == "dense":
            for name, value, default in (
                ("page_size", self.page_size, 16),
                ("num_pages", self.num_pages, 0),
            ):
                check(
                    value == default,
                    f"rollout.{name}={value} is used only with rollout.kv_cache='paged'",
                )
        # Settings that would be silently ignored are refused, naming the fields.
        if self.async_ratio == 0:
            for name, value, default in (
                ("partial_rollout", self.partial_rollout, "continue"),
                ("stale_policy", self.stale_policy, "drop"),
            ):
                check(
                    value == default,
                    f"rollout.{name}={value!r} needs rollout.async_ratio > 0: with "
                    "async_ratio=0 no sample is in flight at a weight update and none is stale",
                )
        check(
            self.truncation == "penalty" or self.truncation_penalty == 0.0,
            f"rollout.truncation_penalty={self.truncation_penalty} is used only with "
            f"rollout.truncation='penalty', got {self.truncation!r}",
        )
        check(
            self.filter_min_std is None or self.filter_min_std > 0,
            f"rollout.filter_min_std={self.filter_min_std} filters nothing (a std is >= 0); "
            "use a positive threshold or None",
        )
        lo, hi = self.filter_min_mean, self.filter_max_mean
        check(
            lo is None or hi is None or lo <= hi,
            f"rollout.filter_min_mean={lo} > rollout.filter_max_mean={hi} filters every group",
        )

    def group_filter_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments of the dynamic-sampling ``GroupFilter`` asked for (None =
        keep every group)."""
        knobs = dict(
            min_mean=self.filter_min_mean,
            max_mean=self.filter_max_mean,
            min_std=self.filter_min_std,
        )
        if not self.filter_zero_variance and all(v is None for v in knobs.values()):
            return None
        return dict(zero_variance=self.filter_zero_variance, **knobs)
