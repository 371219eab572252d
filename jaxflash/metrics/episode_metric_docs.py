"""What held-out evaluation's and the agentic episodes' metrics mean: ``eval_*`` and
the ``episodes`` section of a metrics.jsonl row (``metrics.tracker.SECTIONS``), the agent
sessions and the environment manager's calls and failures.

Part of the one table of meanings, ``metrics.metric_docs.METRICS``.
"""

from __future__ import annotations

EPISODE_METRICS: tuple[tuple[str, str], ...] = (
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
)
"""(names, meaning) rows: evaluation, episodes, agent sessions, environment calls."""
