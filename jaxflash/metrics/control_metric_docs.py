"""What the replay cycle's, the step controller's and the elastic pool's metrics mean:
the ``replay``, ``control`` and ``elastic`` sections of a metrics.jsonl row
(``metrics.tracker.SECTIONS``).

Part of the one table of meanings, ``metrics.metric_docs.METRICS``.
"""

from __future__ import annotations

CONTROL_METRICS: tuple[tuple[str, str], ...] = (
    (
        (
            "`cycle_fresh_samples`, `cycle_replay_samples`, `cycle_replay_requested`, "
            "`cycle_replay_shortfall`, `cycle_replay_ratio_target`, `cycle_replay_ratio`,"
            " `cycle_fresh_stored`"
        ),
        (
            "replay runs only (`replay.ratio > 0` or a `controller.kind`): the step's "
            "fresh samples and replayed ones (the learner's `sequences` = their sum), "
            "replayed ones asked for at ρ and the shortfall (buffer too small), the "
            "step's ρ and the share actually replayed, fresh samples stored in the buffer"
            " this step"
        ),
    ),
    (
        "`replay_age_hist`, `replay_reuse_hist`, `replay_age_mean`, `replay_age_max`",
        (
            "replayed samples of the step by age (versions, index 0..`replay.max_age`) "
            "and by how often each has now been replayed (index 0..`replay.max_reuse`); "
            "mean and max age (when any)"
        ),
    ),
    (
        (
            "`replay_ingested`, `replay_size`, `replay_replayed`, "
            "`replay_evicted_capacity`, `replay_evicted_age`, `replay_evicted_reuse`, "
            "`replay_rejected_age`, `replay_rejected_anomaly`, `replay_rejected_uniform`"
        ),
        (
            "the replay buffer's counters since the run began (kept across resumes): "
            "ingested = size + the three evictions; offered samples never stored"
        ),
    ),
    (
        (
            "`fresh_ratio_mean`, `fresh_ratio_max`, `fresh_ratio_min`, `fresh_ess_token`,"
            " `fresh_ess_seq`, `fresh_ratio_tokens`, `fresh_sequences`"
        ),
        (
            "replay runs: importance ratio w = π_θ/μ of the fresh rows under the params "
            "the update starts from (μ: the stored behaviour logprobs), token "
            "mean/max/min; normalised Kish ESS over tokens and over sequences (∏ w); "
            "tokens and rows counted (`algorithms.importance`)"
        ),
    ),
    (
        (
            "`replay_ratio_mean`, `replay_ratio_max`, `replay_ratio_min`, "
            "`replay_ess_token`, `replay_ess_seq`, `replay_ratio_tokens`, "
            "`replay_sequences`"
        ),
        (
            "the same over the replayed rows (ratio statistics only when the step "
            "replayed any); both from the update's own forward pass (`learner.cycles`)"
        ),
    ),
    (
        "`fresh_pg_<name>`, `replay_pg_<name>`",
        (
            "replay runs: each cycle's own policy-loss statistics (`<name>`: the loss's "
            "metrics, e.g. `clip_frac`, `ratio_mean` of the ratio it clips, "
            "`masked_frac`, `is_truncated_frac` (TIS), `m2_before` (M2PO), `num_tokens`):"
            " the fresh rows under `learner.loss`, the replayed rows under "
            "`replay.correction`"
        ),
    ),
    (
        (
            "`ctl_in_step`, `ctl_in_gen_rate`, `ctl_in_train_rate`, `ctl_in_queue_depth`,"
            " `ctl_in_staleness_mean`, `ctl_in_ess`"
        ),
        (
            "`controller.kind` fixed/adaptive: the controller's inputs after the step: "
            "the version the decision is for, samples generated per second of the step, "
            "samples trained per second of update, scored samples waiting, mean staleness"
            " of the fresh samples, `replay_ess_token` (absent when nothing was replayed)"
        ),
    ),
    (
        (
            "`ctl_replay_ratio`, `ctl_async_ratio`, `ctl_requests_in_flight`, "
            "`ctl_learner_devices`, `ctl_generation_devices`"
        ),
        (
            "its decision as put in force for the next step: ρ (fresh groups round((1 − "
            "ρ)·B) and replayed samples), α (staleness bound) and requests in flight "
            "(admission capacity, ⌈requests / G⌉ prompts) are applied; the role split is "
            "the one in force (moved at this boundary with `controller.elastic`, else the"
            " old one)"
        ),
    ),
    (
        "`ctl_proposed_learner_devices`, `ctl_proposed_generation_devices`",
        (
            "adaptive only: the role split the controller proposed (differs from "
            "`ctl_*_devices` when it proposed a move that was not applied: "
            "`controller.elastic` off)"
        ),
    ),
    (
        "`learner_devices`, `generation_slices`",
        (
            "`controller.elastic` only: the role split after this step boundary, in force"
            " for the next step"
        ),
    ),
    (
        "`elastic_moves`, `elastic_requeued`",
        (
            "`controller.elastic`: role changes and requests re-queued off retired "
            "servers since the run began (kept across resumes; a resumed run's return to "
            "its checkpointed split is not a move)"
        ),
    ),
    (
        (
            "`elastic_to_learner`, `elastic_to_generation`, `elastic_reshard_bytes`, "
            "`elastic_move_s`"
        ),
        (
            "`controller.elastic`: devices moved at this boundary each way, the learner "
            "state resharded (bytes) and the move's wall time"
        ),
    ),
    (
        "`elastic_train_step_builds`, `elastic_engine_builds`",
        (
            "`controller.elastic`: learner steps and generation engines built so far, one"
            " per device layout (moving back builds nothing)"
        ),
    ),
    (
        (
            "`ctl_supply_ratio`, `ctl_generation_bound`, `ctl_training_bound`, "
            "`ctl_ess_low`, `ctl_stale_high`, `ctl_devices_moved_to_generation`"
        ),
        (
            "adaptive only: smoothed generation / fresh demand, the conditions its rules "
            "read (`replay.controller`), devices it would move to generation (negative: "
            "to the learner)"
        ),
    ),
)
"""(names, meaning) rows: the cycle mix and buffer, ratios per cycle, controller, elastic."""
