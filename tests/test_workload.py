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
    task = make_workload(ExperimentConfig.from_config_dict(smoke.get_config()), Console(None))
    assert isinstance(task, TaskWorkload)
    agentic = make_workload(
        ExperimentConfig.from_config_dict(agentic_smoke.get_config()), Console(None)
    )
    assert isinstance(agentic, EpisodeRollout)
    assert agentic.reward_pool(clock=None) is None and agentic.eval_size > 0
    assert agentic.describe_eval().startswith(f"{agentic.exp.env.eval_seeds} seeds x ")
    assert isinstance(agentic.source(3), EnvGroupSource) and agentic.source(3).cursor == 3


def test_task_workload_derives_the_limits_and_regenerates_prompts_in_flight():
    c = smoke.get_config()
    c.data.max_prompt_tokens, c.rollout.max_prefill_length = 0, 0  # derive them
    w = TaskWorkload.build(ExperimentConfig.from_config_dict(c), Console(None))
    lengths = w.prompt_lengths()
    assert lengths.derived and w.exp.data.max_prompt_tokens == lengths.limit >= lengths.longest
    assert w.eval_size == len(w.held_out) > 0
    assert w.describe_eval() == f"{w.eval_size} prompts x {w.exp.eval.samples_per_prompt} samples"
    source = w.source(5)
    assert isinstance(source, PromptSource) and source.cursor == 5
    fresh = {p.prompt_id: p for p in w.source(0).take(8)}
    again = w.resume(source, [6, 2])  # rendered again in id order, the cursor untouched
    assert [p.prompt_id for p in again] == [2, 6] and source.cursor == 5
    assert [p.text for p in again] == [fresh[2].text, fresh[6].text]
    r = w.exp.rollout
    assert w.batch_timeout_s() == (
        r.sample_deadline_s * (r.max_retries + 2) + 4 * w.exp.reward.timeout_s
    )
    assert not w.plays_episodes
    with pytest.raises(ValueError, match="needs a scorer"):
        w.dispatch(None)
    with pytest.raises(ValueError, match="reward_pool"):
        w.evaluate(None, None, version=0)


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
