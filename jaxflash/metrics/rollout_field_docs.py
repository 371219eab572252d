"""What each rollouts.jsonl field means, in the order rows are written.

``jaxflash.metrics.reference`` renders it into docs/METRICS.md and
tests/metrics/test_metrics_reference.py checks it against the row writer's keys
(``jaxflash.runtime.rollout.rows.ROLLOUT_FIELDS``).
"""

from __future__ import annotations

ROLLOUT_FIELDS: tuple[tuple[str, str], ...] = (
    (
        "`learner_step`",
        "the step whose batch this sample's group was taken (or dropped) for",
    ),
    (
        "`prompt_id`, `sample_index`",
        (
            "the sample's identity (prompt id = dataset cursor; an agentic group's "
            "prompt id is its environment seed, and a failed group's unfinished "
            "episodes follow its finished ones, so with redundancy up to G + r rows)"
        ),
    ),
    (
        "`prompt`, `answer`",
        "the user message and the reference answer",
    ),
    (
        "`response`, `response_tokens`, `response_len`",
        "decoded response (without EOS), its token ids (EOS included), their count",
    ),
    (
        "`finish_reason`",
        (
            "`eos`, `length` (truncated) or `aborted` (a failed prompt's sample cut "
            "short or never generated)"
        ),
    ),
    (
        "`reward`, `correct`, `reward_error`",
        (
            "the reward (null if never scored), answer correctness (as `accuracy`), the "
            "reward's error text (an episode cut short by its group's failure: its "
            "environment's failure, if that was the one that failed)"
        ),
    ),
    (
        "`outcome`, `reason`",
        (
            "`trained`, `filtered`, `stale`, `failed` or `regenerated`; with its reason "
            "(`trained`, a filter reason such as `zero_variance` or `all_truncated`, "
            "`stale`, `surplus_stale`, `failed`)"
        ),
    ),
    (
        "`failure`",
        "the `FailureReason` of a failed prompt, else null",
    ),
    (
        "`loss_masked`",
        "true if the sample carried no loss",
    ),
    (
        "`start_version`, `staleness`",
        (
            "the oldest policy version among its tokens; learner version − it (null for "
            "a sample that never came back)"
        ),
    ),
    (
        "`token_version_min`, `token_version_max`",
        (
            "range of the versions that sampled its tokens (they differ when weights "
            "changed mid-sample)"
        ),
    ),
)
"""(names, meaning) rows of rollouts.jsonl (``runtime.rollout.rows.ROLLOUT_FIELDS`` in order)."""
