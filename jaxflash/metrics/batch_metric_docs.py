"""What the step's batch and learner-update metrics mean: the ``batch`` and ``learner``
sections of a metrics.jsonl row (``metrics.tracker.SECTIONS``), the engine-vs-learner
consistency measured on them, and the code reward's sandbox outcomes.

Part of the one table of meanings, ``metrics.metric_docs.METRICS``.
"""

from __future__ import annotations

BATCH_METRICS: tuple[tuple[str, str], ...] = (
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
            "sampling sets differ. Exactly 0 (corr 1) under `model.exact_numerics` (on a "
            "1-device learner: tested tiny and SmolLM2-shaped configs, a real SmolLM2 run; "
            "the 2.4e-5 SmolLM2 residual was the tied head's transpose, fixed; "
            "docs/CONSISTENCY.md; "
            "`jaxflash.algorithms.consistency`)"
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
)
"""(names, meaning) rows: the step's groups, its update and the sampling consistency."""
