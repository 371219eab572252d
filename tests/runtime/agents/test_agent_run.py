"""An agent trained through the endpoint by the one loop: tiny random model, generation
in separate programs, asynchronous (alpha 1) so sessions run across weight updates, a
flaky agent whose failures are counted while the run goes on (raises, malformed
requests; a hanging agent is tests/runtime/agents/test_agent_sessions.py's)."""

from __future__ import annotations

import json
import os

import pytest

from configs import agent_smoke
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.rollout.episode_groups import EPISODE_ENDS
from tests.runtime.agents import scripted_agents


@pytest.mark.timeout(600)
def test_agent_trains_on_sampled_ids_across_weight_updates_on_generation_programs(tmp_path):
    from jaxflash.runtime import loop  # noqa: PLC0415

    os.environ["AGENT_TEST_WORKDIR"] = str(tmp_path)
    c = agent_smoke.get_config()
    c.mesh.colocated = False
    c.mesh.generation_processes = True
    c.rollout.async_ratio = 1
    c.rollout.stale_policy = "pace"  # tasks 2 and 3 wait on purpose: train them, not drop
    c.total_steps = 3
    c.env.eval_seeds = 0
    c.env.options = json.dumps(
        {
            "agent": "tests.runtime.agents.scripted_agents:two_turns_flaky",
            "tasks": "tests.runtime.agents.scripted_agents:tasks",
            "max_turns": 2,
            "max_tokens_per_turn": 6,
            "step_timeout_s": 60.0,
        }
    )
    c.env.max_context_tokens = 128
    c.env.max_env_restarts = 4
    loop.run(ExperimentConfig.from_config_dict(c), workdir=str(tmp_path))
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    last = rows[-1]
    assert last["episodes_started"] == sum(last[k] for k in EPISODE_ENDS) + last["episodes_running"]
    ends = ("returned", "failed", "closed", "running")
    assert last["agent_sessions_started"] == sum(last[f"agent_sessions_{e}"] for e in ends)
    assert last["agent_sessions_failed_raised"] >= 1
    assert last["agent_sessions_failed_malformed"] >= 1
    # Each env failure is a session that ended failed, or closed first: the run can
    # close a session (its episode ended, e.g. a redundant spare) while the agent's
    # episode is failing, and the session then counts closed (1 run in ~10 here).
    # The converse does not hold either (a closed spare's agent that then times out
    # counts failed_timeout and is no env failure); both are known gaps of the
    # counters, not lost sessions: every session ends exactly once (asserted above).
    sessions_ended_badly = last["agent_sessions_failed"] + last["agent_sessions_closed"]
    assert sessions_ended_badly >= last["env_failures_raised"]
    # Trained episodes hold exactly what the engine sampled: the first turn's ids, the
    # delta of the agent's message, the second turn's ids (as the replies gave them).
    seen = {
        tuple(v[0]["token_ids"]): [t["token_ids"] for t in v]
        for v in scripted_agents.SEEN.values()
        if len(v) == 2
    }
    rollouts = [json.loads(x) for x in open(tmp_path / "rollouts.jsonl")]
    trained = [r for r in rollouts if r["outcome"] == "trained"]
    assert len(trained) == 3 * 2 * 2
    for row in trained:
        tokens = row["response_tokens"]
        first, second = next(v for k, v in seen.items() if tokens[: len(k)] == list(k))
        assert tokens[-len(second) :] == second
    # Task 4's agent raises in every session: its group fails after the spare and 4
    # restarts (env_failure). Each episode the failure ended has a failed row (G = 2:
    # the last to fail and the restart it stopped, both before any request: no tokens),
    # and the failed rows' prompts are the ledger's failed prompts.
    failed = [r for r in rollouts if r["outcome"] == "failed"]
    assert len({r["prompt_id"] for r in failed}) == last["prompts_failed"] >= 1
    broken = [r for r in failed if r["prompt_id"] == scripted_agents.BROKEN_TASK]
    assert [r["sample_index"] for r in broken] == [0, 1]
    assert last["prompt_outcomes"]["failed"].get("env_failure", 0) >= 1
    for r in broken:
        assert (r["failure"], r["finish_reason"], r["reward"]) == ("env_failure", "aborted", None)
        assert r["response_tokens"] == [] and r["loss_masked"]
    assert broken[0]["reward_error"].startswith("environment raised in reset")
    # Tasks 2 and 3 waited for step 1 between their turns: their episodes span the update.
    spanning = [r for r in trained if r["token_version_min"] < r["token_version_max"]]
    assert {r["prompt_id"] for r in spanning} >= {2, 3}, [
        (r["prompt_id"], r["token_version_min"], r["token_version_max"]) for r in trained
    ]
