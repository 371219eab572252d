"""The loop's workload, chosen once: the RLVR task side, the agentic side, and what a
checkpoint keeps beside the learner state."""

from __future__ import annotations

import pytest

from configs import agentic_smoke, smoke
from jaxflash.data.prompts import PromptSource
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.runtime.config.replay_spec import ControllerSpec, ReplaySpec, check_replay_learner
from jaxflash.runtime.console import Console
from jaxflash.runtime.resume import checkpoint_meta
from jaxflash.runtime.workloads.agentic import EnvGroupSource, EpisodeRollout
from jaxflash.runtime.workloads.task_workload import TaskWorkload
from jaxflash.runtime.workloads.workload import make_workload


def test_make_workload_picks_the_task_or_the_environment_once():
    _, task = make_workload(ExperimentConfig.from_config_dict(smoke.get_config()), Console(None))
    assert isinstance(task, TaskWorkload)
    exp, agentic = make_workload(
        ExperimentConfig.from_config_dict(agentic_smoke.get_config()), Console(None)
    )
    assert isinstance(agentic, EpisodeRollout)
    assert agentic.held_out.size > 0 and agentic.held_out.unit == "episodes"
    assert agentic.held_out.describe().startswith(f"{exp.env.eval_seeds} seeds x ")
    side = agentic.rollout(3, [])
    assert isinstance(side.source, EnvGroupSource) and side.source.cursor == 3
    agentic.close()  # no reward workers: nothing to stop


def test_task_workload_derives_the_limits_and_regenerates_prompts_in_flight():
    c = smoke.get_config()
    c.data.max_prompt_tokens, c.rollout.max_prefill_length = 0, 0  # derive them
    exp, w = make_workload(ExperimentConfig.from_config_dict(c), Console(None))
    assert isinstance(w, TaskWorkload)
    lengths = w.prompt_lengths()
    assert lengths.derived and exp.data.max_prompt_tokens == lengths.limit >= lengths.longest
    assert w.held_out.size == len(w.held_out.prompts) > 0 and w.held_out.unit == "samples"
    assert w.held_out.describe() == (
        f"{w.held_out.size} prompts x {exp.eval.samples_per_prompt} samples"
    )
    try:
        side = w.rollout(5, [])
        source = side.source
        assert isinstance(source, PromptSource) and source.cursor == 5 and side.resume_prompts == ()
        fresh = {p.prompt_id: p for p in w.rollout(0, []).source.take(8)}
        again = w.rollout(5, [6, 2])  # rendered again in id order, the cursor untouched
        assert [p.prompt_id for p in again.resume_prompts] == [2, 6]
        assert again.source.cursor == 5
        assert [p.text for p in again.resume_prompts] == [fresh[2].text, fresh[6].text]
        r = exp.rollout
        assert side.batch_timeout_s == (
            r.sample_deadline_s * (r.max_retries + 2) + 4 * exp.reward.timeout_s
        )
        assert not w.plays_episodes
        assert w._pool is not None  # the workload's own reward pool, started with the rollout
    finally:
        w.close()


def test_checkpoint_meta_keeps_what_resuming_reads():
    ledger, counts = {"open": [3]}, {"prompts_trained": 4}
    buffer = {"produced": 5, "returned": 4, "dropped_stale": 1}
    meta = checkpoint_meta(7, (ledger, counts, 12, buffer))
    assert (meta.step, meta.policy_version, meta.data_cursor, meta.counters) == (7, 7, 12, counts)
    assert meta.extra == {"ledger": ledger, "counters": counts, "group_buffer": buffer}
    with_replay = checkpoint_meta(7, (ledger, counts, 12, buffer), {"buffer": []})
    assert with_replay.extra["replay"] == {"buffer": []}


def test_replay_on_a_multi_process_learner_is_refused():
    replay, off = ReplaySpec(ratio=0.5), ReplaySpec()
    controller = ControllerSpec()
    with pytest.raises(ConfigError, match="multi-process"):
        check_replay_learner(replay, controller, multi_process=True)
    check_replay_learner(replay, controller, multi_process=False)
    check_replay_learner(off, controller, multi_process=True)
