"""What the rollout's per-step metrics mean: the ``staleness``, ``generation``, ``time``,
``version``, ``rollout`` and ``outcomes`` sections of a metrics.jsonl row
(``metrics.tracker.SECTIONS``): the servers, the step's times and weight publish, the
prompt ledger, the scheduler's queues and the group buffer.

Part of the one table of meanings, ``metrics.metric_docs.METRICS``.
"""

from __future__ import annotations

ROLLOUT_METRICS: tuple[tuple[str, str], ...] = (
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
            " under `mesh.delta_publish` the compressed deltas, or the full tree of a server"
            " that fell back; generation programs report what their pulls moved)"
        ),
    ),
    (
        "`publish_changed_frac`, `publish_full_fallbacks`",
        (
            "thread engines under delta publish (`mesh.delta_publish`, full fine-tuning):"
            " the fraction of engine-side (bf16) weight elements whose bits changed since the"
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
        (
            "`admission_holds_capacity`, `admission_holds_pacer`, "
            "`admission_held_capacity_s`, `admission_held_pacer_s`, "
            "`slots_idle_held_capacity_s`, `slots_idle_held_pacer_s`, `slots_idle_held_frac`"
        ),
        (
            "generation stalled by the staleness bound, since this process started "
            "(`jaxflash/runtime/rollout/stalls.py`): times admission went from open to held "
            "by the (α+1)·B capacity or by the pacer (`stale_policy='pace'` refusing a "
            "prompt that would push an open one past its deadline; 0 under drop and "
            "regenerate); seconds held; slot-seconds a decode slot "
            "(`rollout.num_slots` per live server) had nothing to run or queue meanwhile; "
            "both idle figures over every slot-second (the runtime's counterpart of the "
            "simulator's `admission_idle`)"
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
)
"""(names, meaning) rows: staleness, servers, times, publish, prompts, samples, buffer."""
