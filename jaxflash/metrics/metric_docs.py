"""What each per-step metric and rollouts.jsonl field means: the one table of their meanings.

``jaxflash.metrics.reference`` checks runs against it and renders docs/METRICS.md from
it (``python -m jaxflash.metrics.reference --write docs/METRICS.md``). A metric's name
is written in backticks; per-server or per-reason families use the placeholders of
``reference.PLACEHOLDERS`` (``gen{i}_occupancy``, ``samples_dropped_<reason>``).
"""

from __future__ import annotations

METRICS: tuple[tuple[str, str], ...] = (
    (
        "`num_groups`, `num_samples`, `samples_masked`",
        (
            "groups (prompts) in the step's batch; samples that carried loss; samples of "
            "those groups left out of the loss (`rollout.truncation=mask`)"
        ),
    ),
    (
        (
            "`reward_mean`, `reward_std`, `accuracy`, `response_len_mean`, "
            "`response_len_max`, `truncated_frac`"
        ),
        (
            "over every sample of the step's groups (masked ones included); `accuracy` is"
            " the reward's `correct` component when it reports one (Math-Verify, "
            "reasoning-gym; `math/correct` of the math reward with a format bonus), else "
            "the reward itself (a custom reward); `eval_accuracy` uses the same "
            "definition, scored by the run's own reward"
        ),
    ),
    (
        "`skipped`",
        (
            "only on a step with nothing to train, why: `all_truncated`, `all_filtered`, "
            "`all_failed`, `all_stale`, `mixed`, `no_prompts`; the version still advances"
            " (weights unchanged) and `steps_skipped`, `steps_skipped_<reason>` count "
            "them; 3 `all_failed` steps in a row stop the run (`run stopped: ...`, exit "
            "1: a reward or dataset that fails everything)"
        ),
    ),
    (
        (
            "`loss`, `pg_loss`, `grad_norm`, `lr`, `entropy`, `kl`, `clip_frac`, "
            "`clip_frac_low`, `clip_frac_high`, `ratio_mean`, `ratio_max`, `ratio_min`, "
            "`masked_frac`, `nonfinite_count`, `tokens`, `sequences`"
        ),
        (
            "the learner step (`docs/CONTRACTS.md`, learner); absent on a skipped step; "
            "`is_truncated_frac` (`tis`, `seq_tis`) and `is_weight_mean` (rollout "
            "corrections) when the loss reports them; `router_aux_loss` (mixture of experts, "
            "`learner.router_aux_loss_coef` > 0: the load-balancing loss, unweighted)"
        ),
    ),
    (
        "`logprob_gap_on_policy_max`",
        (
            "max \\|log π − log μ\\| over tokens sampled by the learner's current version: "
            "engine vs learner numerics, float rounding"
        ),
    ),
    (
        (
            "`logprob_gap_on_policy_mean`, `kl_k3_on_policy`, `prob_corr_on_policy`, "
            "`sampling_set_miss_frac_on_policy`"
        ),
        (
            "on the same tokens: mean \\|log π − log μ\\|; the k3 estimate of KL(μ‖π) "
            "(mean of r − 1 − log r, r = π/μ); the Pearson correlation of the token "
            "probabilities μ and π (1 when constant); the fraction whose sampled token is "
            "outside the learner's top-k / top-p set, a lower bound on the fraction whose "
            "sampling sets differ. Exactly 0 (corr 1) under `model.exact_numerics` on the "
            "tested tiny configs; SmolLM2 bf16 still shows a 2.4e-5 residual "
            "(docs/CONSISTENCY.md; `jaxflash.algorithms.consistency`)"
        ),
    ),
    (
        "`router_mismatch_frac`, `router_mismatch_on_policy_frac`",
        (
            "mixture-of-experts runs: the share of (token, layer) routing decisions whose "
            "top-k expert set differs between the engine's record (`Sample.routed_experts`)"
            " and the learner's live router, over every token with a recorded route "
            "(prompt included), and over the loss tokens sampled by the current version; "
            "under `learner.router_replay` (R3) the forward uses the engine's experts, so "
            "this counts what replay overrode (gate weights still come from the live router)"
        ),
    ),
    (
        "`logprob_gap_off_policy_max`, `on_policy_tokens`",
        (
            "the same over tokens of older versions (policy change + rounding; 0 if "
            "none); tokens of the current version"
        ),
    ),
    (
        "`sandbox_outcomes`",
        (
            "`reward.fn=code` only: samples of the step's groups by how their sandboxed "
            "run ended (`ok`, `error`, `timeout`, `memory`, ...; docs/SANDBOX.md)"
        ),
    ),
    (
        "`staleness_mean`, `staleness_max`, `staleness_hist`",
        "learner version − start version over the samples with loss (≤ α)",
    ),
    (
        "`gen{i}_occupancy`, `gen_slot_occupancy`",
        ("fraction of decode slots live during the step's decode steps, per server and over all"),
    ),
    (
        "`gen{i}_version_lag`, `gen_version_lag_max`",
        "learner version − the version each server generated with during the step",
    ),
    (
        "`gen_idle_frac`, `gen_tokens`, `gen_tokens_per_s`",
        (
            "servers' idle share of the step; tokens generated in it (dropped ones "
            "included); per busy second"
        ),
    ),
    (
        "`gen_kv_pages_in_use`, `gen_kv_cache_usage`, `gen_kv_cache_usage_peak`",
        (
            "paged KV cache only (`rollout.kv_cache=paged`): pages mapped at the step's end,"
            " all servers; their share of the servers' page pools (KV-cache usage); the "
            "largest share one server had in use at once since it started"
        ),
    ),
    (
        (
            "`gen_preemptions`, `gen_kv_page_waits`, `gen_prefix_cache_hit_pages`, "
            "`gen_prefix_cache_copied_pages`"
        ),
        (
            "paged KV cache only, during the step, all servers: running samples preempted "
            "because their slot group ran out of pages (restarted from the queue's front, "
            "their tokens dropped); fills at which the queue's head waited for free pages "
            "while a slot was free; prompt pages mapped from another sample of the same "
            "prompt instead of written (prefix-cache hits, in pages); prompt pages written "
            "again because only another slot group held them (a pool split over a mesh)"
        ),
    ),
    (
        "`train_time_s`, `train_tokens_per_s`",
        "the learner update's wall time; `tokens` / it",
    ),
    (
        "`learner_wait_s`, `learner_idle_frac`",
        "time the learner waited for the batch; its share of `step_time_s`",
    ),
    (
        "`weight_sync_s`, `weight_copy_s`, `publish_bytes`",
        (
            "device-to-device copy + hand-over to the servers; the copy alone; bytes the"
            " publish moved, every server together (under `learner.lora` the adapters only;"
            " with generation programs, offered to each program)"
        ),
    ),
    (
        "`publish_changed_frac`, `publish_full_fallbacks`",
        (
            "thread engines under delta publish (the default for full fine-tuning): the"
            " fraction of engine-side (bf16) weight elements whose bits changed since the"
            " previous version; full-tree publishes so far to a slot that held weights"
            " (missed a version, drifted, or a delta refused by its digest)"
        ),
    ),
    (
        "`step_time_s`, `trained_at_s`, `policy_version`",
        (
            "the step's wall time; seconds from the run's first generation request to the"
            " end of this step's update; the version after it"
        ),
    ),
    (
        (
            "`prompts_taken`, `prompts_trained`, `prompts_filtered`, `prompts_stale`, "
            "`prompts_failed`, `prompts_in_flight`, `prompt_outcomes`"
        ),
        (
            "the prompt ledger: taken = in flight + the four outcomes; `prompt_outcomes` "
            "splits each outcome by reason"
        ),
    ),
    (
        "`prompts_active`, `samples_outstanding`, `samples_scoring`",
        (
            "admitted and not yet released (≤ (α+1)·B); samples on a server; samples "
            "awaiting their reward"
        ),
    ),
    (
        "`sched_batch_prompts`, `sched_async_ratio`, `sched_prompts_capacity`",
        (
            "the scheduler's settings during the step: fresh groups per batch (B), the "
            "staleness bound α, the admission capacity in prompts ((α+1)·B); with an "
            "adaptive or fixed controller, the previous step's decision"
        ),
    ),
    (
        (
            "`samples_generated`, `samples_scored`, `samples_aborted`, "
            "`samples_aborted_surplus`, `samples_timed_out`, `samples_retried`, "
            "`samples_failed`, `samples_rerouted`, `samples_requeued` (off a server "
            "retired by an elastic move), `samples_late`, `samples_dropped_<reason>`, "
            "`server_failures`, `server_recoveries` (a generation process back after a "
            "restart), `prompts_regenerated_stale`, `prompts_regenerated_on_resume`, "
            "`samples_trained_overshoot` (`stale_policy='pace'`: trained older than α, "
            "e.g. after α was lowered; never dropped)"
        ),
        "scheduler counters since the run began (kept across resumes)",
    ),
    (
        (
            "`buffer_produced`, `buffer_returned`, `buffer_dropped`, "
            "`buffer_dropped_<reason>`, `buffer_pending`, "
            "`buffer_samples_late_discarded`, `buffer_staleness_fresh`, "
            "`buffer_staleness_stale`, `buffer_staleness_anomaly`, `buffer_staleness_overshoot`"
        ),
        (
            "the group buffer: produced = returned + dropped + pending; cumulative over a"
            " resume, like prompts_* (groups pending at the checkpoint are counted "
            "produced when generated again)"
        ),
    ),
    (
        ("`eval_accuracy`, `eval_accuracy_stderr`, `eval_prompts`, `eval_failed`, `eval_time_s`"),
        (
            'held-out mean@n and its standard error (`"nan"` with fewer than 2 prompts '
            "scored), on evaluation steps (and step 0); agentic: the success rate over "
            "`env.eval_seeds` eval-split seeds (`eval_prompts`), episodes whose "
            "environment failed (`eval_failed`)"
        ),
    ),
    (
        "`eval_invalid_action_rate`, `eval_turns_per_episode`",
        "agentic evaluation: invalid actions per turn, turns per episode",
    ),
    (
        (
            "`turns_per_episode`, `env_time_per_turn_s`, `success_rate`, "
            "`invalid_action_rate`, `sampled_tokens_mean`"
        ),
        (
            "agentic, over the step's trained episodes: turns, environment seconds per "
            "turn, share that succeeded, invalid actions per turn, tokens the policy "
            "sampled per episode (the only ones with loss; `response_len_mean` also "
            "counts observations)"
        ),
    ),
    (
        "`agent_metric_<name>`",
        (
            "bring your own agent: the mean, over the step's trained episodes that "
            "report it, of each metric the agent returned (`AgentResult.metrics`)"
        ),
    ),
    (
        (
            "`stale_dropped_episodes`, `stale_dropped_turns_mean`, "
            "`stale_dropped_success_rate`, `stale_dropped_sampled_tokens_mean`, "
            "`stale_dropped_reward_mean`"
        ),
        (
            "agentic, episodes of the groups dropped as stale this step (the bias of "
            "dropping slow, hard problems: compare with the trained values)"
        ),
    ),
    (
        (
            "`episodes_started`, `episodes_finished`, `episodes_env_failed`, "
            "`episodes_aborted_redundant`, `episodes_aborted`, "
            "`episodes_aborted_on_resume`, `episodes_restarted`, `episodes_running`"
        ),
        (
            "agentic episode books since the run began: started = finished + env_failed +"
            " aborted_redundant (the spares of redundancy) + aborted (their group "
            "stopped: stale, failed) + aborted_on_resume (in flight at the checkpoint "
            "resumed from) + running; restarted = episodes started in place of a failed "
            "one"
        ),
    ),
    (
        (
            "`agent_sessions_started`, `agent_sessions_returned`, `agent_sessions_failed`, "
            "`agent_sessions_failed_raised`, `agent_sessions_failed_bad_return`, "
            "`agent_sessions_failed_no_request`, `agent_sessions_failed_malformed`, "
            "`agent_sessions_failed_history_rewritten`, `agent_sessions_failed_timeout`, "
            "`agent_sessions_closed`, `agent_sessions_running`, `agent_http_requests`"
        ),
        (
            "env.name='agent' (docs/AGENTS.md), since the run began: sessions started = "
            "returned (the agent gave a reward) + failed (the sum of the reasons) + closed "
            "(ended by the run first: spare, stale, full context, start-up check, evaluation)"
            " + running; chat requests the endpoint answered"
        ),
    ),
    (
        (
            "`agent_echo_mismatch`, `agent_retokenized_differently`, `agent_tool_calls`, "
            "`agent_tool_call_parse_errors`, `agent_sampling_overridden`"
        ),
        (
            "env.name='agent', over ended sessions: echoed assistant messages that differ "
            "from the reply (recorded ids kept), echoes whose template rendering tokenises "
            "differently from the sampled ids (sampled ids kept), tool calls parsed, "
            "<tool_call> blocks that did not parse, requests whose temperature/top_p were "
            "replaced by the run's"
        ),
    ),
    (
        (
            "`turns_generated`, `env_calls`, `env_calls_pending`, `env_calls_abandoned`, "
            "`env_close_errors`"
        ),
        (
            "agentic: turns generated; environment resets and steps started, pending now,"
            " abandoned at their deadline (a hung thread is never used again); close() "
            "errors"
        ),
    ),
    (
        (
            "`env_failures`, `env_failures_raised`, `env_failures_timeout`, "
            "`env_failures_bad_observation`, `env_failures_bad_reward`, "
            "`env_failures_bad_result`"
        ),
        "agentic: environment failures, by reason (`envs.base.EnvFailureReason`)",
    ),
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
"""(names, meaning) rows of metrics.jsonl, one per concept, in the order a reader needs them."""
