"""One group's episodes (runtime.episode_groups): launching, the group's start version,
cancelling; and the settings' refusals. No scheduler, no threads."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from jaxflash.envs.chat import TurnRenderer
from jaxflash.envs.registry import env_config, make_env
from jaxflash.runtime.rollout.episode_groups import EpisodeGroup, EpisodeSettings
from jaxflash.types import Prompt
from tests.envs_fixtures import chatml_tokenizer

OPTS = dict(size=4, max_turns=4, max_tokens_per_turn=24, step_timeout_s=30.0)


class Closing:
    """A FrozenLake that records being closed."""

    def __init__(self):
        self.env, self.closed = make_env("frozenlake", **OPTS), 0

    def close(self):
        self.closed += 1
        self.env.close()


class Calls:
    """Stands in for ``EnvCalls``: records the calls cancelled."""

    def __init__(self):
        self.cancelled = []

    def cancel(self, call_id):
        self.cancelled.append(call_id)


def _settings(**kw):
    made = []

    def factory():
        made.append(Closing())
        return made[-1]

    settings = EpisodeSettings(
        make_env=factory,
        renderer=TurnRenderer(chatml_tokenizer()),
        limits=env_config("frozenlake", **OPTS),
        max_context_tokens=256,
        **kw,
    )
    return settings, made


def _group(pid=7, seed=3):
    return EpisodeGroup(
        Prompt(
            prompt_id=pid,
            text="",
            prompt_tokens=np.zeros(0, np.int32),
            answer="",
            meta={"env_seed": seed},
        )
    )


@pytest.mark.parametrize(
    "kw", [{"redundancy": -1}, {"max_env_restarts": -1}, {"max_context_tokens": 1}]
)
def test_settings_refused(kw):
    settings = dict(make_env=lambda: None, renderer=None, limits=None, max_context_tokens=8)
    with pytest.raises(ValueError, match="EpisodeSettings"):
        EpisodeSettings(**{**settings, **kw})


def test_new_run_numbers_launches_and_uses_the_group_seed():
    settings, made = _settings()
    group = _group(pid=7, seed=3)
    runs = [group.new_run(settings, start_version=v) for v in (5, 6)]
    assert [i for i, _ in runs] == [0, 1] and group.next_index == 2
    assert list(group.runs) == [0, 1] and len(made) == 2
    for (index, run), env, v in zip(runs, made, (5, 6), strict=True):
        assert run.env is env and run.call is None
        ep = run.episode
        assert (ep.prompt_id, ep.episode_index, ep.env_seed, ep.start_version) == (7, index, 3, v)


def test_start_version_is_the_oldest_kept_or_running():
    settings, _ = _settings()
    group = _group()
    assert group.start_version() == float("inf")
    group.new_run(settings, start_version=4)
    group.kept.append(6)
    assert group.start_version() == 4.0
    group.runs.clear()
    assert group.start_version() == 6.0


def test_cancel_counts_each_run_cancels_pending_calls_closes_idle_envs():
    settings, made = _settings()
    group = _group()
    for v in range(3):
        group.new_run(settings, start_version=v)
    group.runs[1].call = 42  # its environment is busy: cancelled, closed when it returns
    group.runs[2].env = None  # a hung environment, already dropped
    calls, counters = Calls(), collections.Counter()
    group.cancel(calls, counters, "episodes_aborted_redundant")
    assert counters == {"episodes_aborted_redundant": 3}
    assert calls.cancelled == [42]
    assert [e.closed for e in made] == [1, 0, 0]
    assert group.runs == {}
