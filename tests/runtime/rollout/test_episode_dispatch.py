"""The environment manager (runtime.episode_dispatch) under the real RolloutScheduler.

Time is a VirtualClock (runtime.simulate.episodes): environment latency and turn
generation cost virtual seconds, so the async-vs-barrier comparison is exact and
nothing here asserts a wall time. Environments are real FrozenLake maps, wrapped
to add latency, stragglers and faults.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

from jaxflash.envs.base import StepResult
from jaxflash.envs.chat import TurnRenderer
from jaxflash.envs.latency import LatencyConfig, LatencyEnv
from jaxflash.envs.registry import env_config, make_env
from jaxflash.envs.training import sample_token_advantages
from jaxflash.learner.episode_batching import pack_episode_batch
from jaxflash.runtime.clock import RealClock, VirtualClock
from jaxflash.runtime.rollout.env_calls import thread_runner
from jaxflash.runtime.rollout.episode_groups import EPISODE_ENDS, EpisodeSettings
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.runtime.simulate.episodes import (
    VirtualEnvTime,
    VirtualTurnServer,
    episode_scheduler,
    run_steps,
)
from jaxflash.types import FailureReason, PromptOutcome, SamplingParams
from tests.envs_fixtures import chatml_tokenizer

OPTS = dict(size=4, max_turns=4, max_tokens_per_turn=24, step_timeout_s=30.0)
ACTIONS = ("Left", "Down", "Right", "Up")
TOK = chatml_tokenizer()


def _reply(request):
    """A valid move chosen from the request's identity and context length."""
    move = ACTIONS[(request.prompt_id * 7 + request.sample_index + len(request.prompt_tokens)) % 4]
    return TOK.encode(f"<answer>{move}</answer>")


class Faulty:
    """A FrozenLake whose steps ``raise``, ``hang`` (sleep far past the deadline),
    return a non-string observation (``bad_obs``) or a ``tool`` message (``tool_role``)."""

    def __init__(self, env, mode, sleep):
        self.env, self.mode, self.sleep = env, mode, sleep

    @property
    def config(self):
        return self.env.config

    def reset(self, seed):
        return self.env.reset(seed)

    def step(self, action_text):
        if self.mode == "raise":
            raise RuntimeError("environment crashed")
        if self.mode == "hang":
            self.sleep(1e9)
        result = self.env.step(action_text)
        if self.mode == "bad_obs":
            return StepResult(None, result.reward, False, False, {})
        if self.mode == "tool_role":
            return StepResult("output", result.reward, False, False, {"role": "tool"})
        return result

    def close(self):
        self.env.close()


class Factory:
    """Environment instances, numbered in creation order: instance k waits its latency
    (seeded by k, so episodes of a group differ), ``slow[k]`` extra seconds per step, and
    fails as ``faults[k]`` says."""

    def __init__(self, env_time, *, mean_s=1.0, std_s=0.0, slow=None, faults=None):
        self.env_time, self.mean_s, self.std_s = env_time, mean_s, std_s
        self.slow, self.faults, self.made = dict(slow or {}), dict(faults or {}), 0

    def __call__(self):
        k, self.made = self.made, self.made + 1
        latency = LatencyConfig(
            mean_s=self.mean_s * (1 + self.slow.get(k, 0)), std_s=self.std_s, seed=k
        )
        env = LatencyEnv(make_env("frozenlake", **OPTS), latency, sleep=self.env_time.sleep)
        return Faulty(env, self.faults[k], self.env_time.sleep) if k in self.faults else env


def _setup(
    *, B=2, G=4, redundancy=0, barrier=False, alpha=0, factory_kw=None, restarts=2, tok=TOK, **kw
):
    clock, inbox = VirtualClock(), Inbox()
    env_time = VirtualEnvTime(clock, barrier=barrier)
    factory = Factory(env_time, **(factory_kw or {}))
    server = VirtualTurnServer(
        inbox.generated, clock, reply=_reply, stop_id=TOK.eos_id, slots=64, decode_s=0.01,
        barrier=barrier,
    )  # fmt: skip
    settings = EpisodeSettings(
        make_env=factory,
        renderer=TurnRenderer(tok),
        limits=env_config("frozenlake", **OPTS),
        max_context_tokens=1024,
        redundancy=redundancy,
        max_env_restarts=restarts,
        runner=env_time,
    )
    sched = episode_scheduler(
        [server], inbox, settings, clock, batch_groups=B, group_size=G,
        sampling=SamplingParams(max_new_tokens=OPTS["max_tokens_per_turn"]), async_ratio=alpha,
        **kw,
    )  # fmt: skip
    return sched, clock, server, env_time, factory


def _books_add_up(sched):
    c = sched.watch.counters
    running = ThreadFree(sched).parts.dispatcher.watch.stats()["episodes_running"]
    assert c["episodes_started"] == sum(c[k] for k in EPISODE_ENDS) + running, dict(c)
    ThreadFree(sched).parts.ledger.check()


def _episodes(runs):
    return [s for r in runs for g in r.batch.groups for s in g.samples]


@pytest.mark.parametrize("std_s", [0.5, 1.0])
def test_env_level_async_beats_a_batch_barrier_on_skewed_latency(std_s):
    """Same episodes, same latencies (keyed by env instance), virtual time: with σ/μ >= 0.5
    the per-episode loops finish the steps before lockstep turns do (measured here:
    1.22x at σ/μ = 0.5, 8 episodes of <= 4 turns a step; a barrier anywhere gives 1.0x;
    benchmarks/agentic_async.py measures larger workloads)."""
    times, returns = {}, {}
    for barrier in (True, False):
        sched, clock, server, env_time, _ = _setup(barrier=barrier, factory_kw={"std_s": std_s})
        runs = run_steps(sched, clock, [server], env_time, steps=3)
        times[barrier] = clock.now()
        eps = _episodes(runs)
        assert len(eps) == 3 * 2 * 4
        returns[barrier] = sorted(
            (s.prompt_id, s.reward_info["episode_index"], s.reward) for s in eps
        )
        _books_add_up(sched)
    assert returns[True] == returns[False]  # the same episodes were played and trained
    assert times[False] < 0.9 * times[True], times


def test_redundancy_keeps_the_first_group_size_and_counts_the_aborted():
    """G=4 + r=1 per group; the first instance of each group is a 50x straggler: it is
    never trained, it is aborted and counted, and the step does not wait for it."""
    G, r, B = 4, 1, 2
    stragglers = {g * (G + r) for g in range(2 * B)}  # instance 0 of each group, 2 steps
    sched, clock, server, env_time, factory = _setup(
        B=B, G=G, redundancy=r, factory_kw={"slow": {k: 49 for k in stragglers}}
    )
    runs = run_steps(sched, clock, [server], env_time, steps=2)
    for run in runs:
        assert len(run.batch.groups) == B
        for g in run.batch.groups:
            assert [s.sample_index for s in g.samples] == list(range(G))
            launched = sorted(s.reward_info["episode_index"] for s in g.samples)
            assert 0 not in launched and len(set(launched)) == G  # the straggler is not kept
    c = sched.watch.counters
    assert c["episodes_started"] == 2 * B * (G + r)
    assert c["episodes_finished"] == 2 * B * G
    assert c["episodes_aborted_redundant"] == 2 * B * r
    assert clock.now() < 50 * OPTS["max_turns"]  # a straggler's episode alone takes 200 s
    _books_add_up(sched)


@pytest.mark.parametrize(
    ("mode", "reason"), [("raise", "raised"), ("hang", "timeout"), ("bad_obs", "bad_observation")]
)
def test_env_crash_hang_garbage_is_isolated_counted_and_the_batch_still_fills(mode, reason):
    faults = {1: mode, 6: mode}  # one episode in each group of step 1
    sched, clock, server, env_time, factory = _setup(factory_kw={"faults": faults})
    runs = run_steps(sched, clock, [server], env_time, steps=2)
    assert [len(r.batch.groups) for r in runs] == [2, 2]
    assert all(len(g.samples) == 4 for r in runs for g in r.batch.groups)
    c = sched.watch.counters
    assert c["episodes_env_failed"] == c[f"env_failures_{reason}"] == 2
    assert c["episodes_restarted"] == 2  # each group restarted one episode in its place
    assert ThreadFree(sched).parts.ledger.outcomes["failed"] == {}
    for s in _episodes(runs):
        assert s.reward_info["episode_end"] != "env_failure"
    _books_add_up(sched)


def test_a_message_the_chat_template_rejects_fails_its_episode_and_the_run_goes_on():
    """A template that raises on a message (here: any ``tool`` role) while an episode's
    delta is rendered: that episode is an environment failure (bad_observation),
    isolated, counted and restarted, as an environment's garbage is; nothing raises."""
    rejects_tool = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool "
        "role') }}{% endif %}{% endfor %}" + TOK.chat_template
    )
    tok = TOK.with_chat_template(rejects_tool)
    faults = {1: "tool_role", 6: "tool_role"}  # one episode in each group of step 1
    sched, clock, server, env_time, _ = _setup(factory_kw={"faults": faults}, tok=tok)
    runs = run_steps(sched, clock, [server], env_time, steps=2)
    assert all(len(g.samples) == 4 for r in runs for g in r.batch.groups)
    c = sched.watch.counters
    assert c["episodes_env_failed"] == c["env_failures_bad_observation"] == 2
    assert c["episodes_restarted"] == 2 and ThreadFree(sched).parts.ledger.outcomes["failed"] == {}
    _books_add_up(sched)


def test_a_group_whose_environment_keeps_failing_is_failed_with_its_reason():
    """Every instance of group 0 crashes; with 1 restart allowed its second failure
    fails the group (ENV_FAILURE, counted in the ledger), its 3 other running episodes
    are aborted (counted), and a fresh group takes its place in the batch. Each of the
    4 episodes the failure ended has its rollouts.jsonl row (outcome failed, the
    reason, its tokens so far), so the failed rows' prompts are the ledger's."""
    faults = {k: "raise" for k in range(4)}  # group 0's four episodes
    sched, clock, server, env_time, _ = _setup(factory_kw={"faults": faults}, restarts=1)
    runs = run_steps(sched, clock, [server], env_time, steps=1)
    trained = {g.prompt_id for g in runs[0].batch.groups}
    assert 0 not in trained and len(trained) == 2  # a fresh group took its place
    outcomes = ThreadFree(sched).parts.ledger.outcomes
    assert outcomes["failed"] == {str(FailureReason.ENV_FAILURE): 1}, outcomes
    c = sched.watch.counters
    assert c["env_failures_raised"] == 2 and c["episodes_restarted"] == 1
    assert c["episodes_aborted"] == 3
    _books_add_up(sched)
    rows = runs[0].batch.rows
    failed = [r for r in rows if r["outcome"] == "failed"]
    assert len({r["prompt_id"] for r in failed}) == sum(outcomes["failed"].values()) == 1
    assert [r["sample_index"] for r in failed] == [0, 1, 2, 3]  # one row per episode
    for r in failed:
        assert (r["prompt_id"], r["reason"], r["failure"]) == (0, "failed", "env_failure")
        assert r["finish_reason"] == "aborted" and r["reward"] is None and r["loss_masked"]
        assert r["response_len"] == len(r["response_tokens"])
    # The episode whose crash failed the group played one turn (its step raised): its
    # row holds that turn's sampled tokens and names the environment's failure.
    assert failed[0]["reward_error"].startswith("environment raised in step")
    assert TOK.eos_id in failed[0]["response_tokens"]
    assert all(r["reward_error"] is None for r in failed[1:])  # stopped, not failed
    assert len(rows) == len(failed) + 2 * 4  # and the two trained groups' rows


def test_a_hung_environment_thread_is_abandoned_at_its_deadline():
    """Real threads and a real clock: a step that blocks is expired at its 0.2 s deadline,
    its episode restarted, and the batch returned (the thread is released afterwards)."""
    release = threading.Event()
    opts = {**OPTS, "step_timeout_s": 0.2}
    made = collections.Counter()

    def factory():
        made["n"] += 1
        env = make_env("frozenlake", **opts)
        return Faulty(env, "hang", lambda s: release.wait(10)) if made["n"] == 1 else env

    clock, inbox = RealClock(), Inbox()

    class Instant(VirtualTurnServer):
        def submit(self, request):
            super().submit(request)
            self.deliver_due()

    server = Instant(inbox.generated, clock, reply=_reply, stop_id=TOK.eos_id, decode_s=0.0)
    settings = EpisodeSettings(
        make_env=factory, renderer=TurnRenderer(TOK), limits=env_config("frozenlake", **opts),
        max_context_tokens=1024, runner=thread_runner,
    )  # fmt: skip
    sched = episode_scheduler(
        [server], inbox, settings, clock, batch_groups=1, group_size=2,
        sampling=SamplingParams(max_new_tokens=24),
    )  # fmt: skip
    sched.start()
    try:
        batch = sched.next_batch(0, timeout_s=30)
    finally:
        sched.close()
        release.set()
    assert len(batch.groups[0].samples) == 2
    assert sched.watch.counters["env_failures_timeout"] == 1
    assert sched.watch.counters["env_calls_abandoned"] == 1
    assert sched.watch.counters["episodes_restarted"] == 1


def test_counters_add_up_across_a_restart_and_nothing_is_trained_twice():
    """α = 1 with training time: groups are in flight at the checkpoint. A new scheduler
    built from the checkpoint's books replays them from scratch (counted), and every
    group is trained at most once over both runs."""
    kw = dict(B=2, G=2, alpha=1, factory_kw={"std_s": 1.0})
    sched, clock, server, env_time, _ = _setup(**kw)
    first = run_steps(sched, clock, [server], env_time, steps=2, train_s=3.0)
    ledger_state, counters, cursor, _ = ThreadFree(sched).snapshot()
    running = ThreadFree(sched).parts.dispatcher.watch.stats()["episodes_running"]
    assert running > 0 and ThreadFree(sched).parts.ledger.open_ids  # something was in flight
    open_ids = sorted(ThreadFree(sched).parts.ledger.open_ids)

    ledger = PromptLedger.from_state_dict(ledger_state)
    sched2, clock2, server2, env_time2, _ = _setup(
        **kw, ledger=ledger, start_group=cursor, resume_groups=open_ids, counters=counters
    )
    assert sched2.watch.counters["episodes_aborted_on_resume"] == running
    second = run_steps(sched2, clock2, [server2], env_time2, steps=2, train_s=3.0)
    trained = [g.prompt_id for r in first + second for g in r.batch.groups]
    assert len(trained) == len(set(trained)) == 8
    for r in second:  # staleness is bounded by α in the resumed run too
        assert all(0 <= r.version - g.start_version <= 1 for g in r.batch.groups)
    _books_add_up(sched2)
    assert ledger.count(PromptOutcome.TRAINED) == 8  # the books carried over: 2 x 2 x 2


def test_observation_tokens_carry_no_loss():
    """rl_pitfalls "Multi-turn": in the packed learner batch only the tokens the server
    sampled have loss mask 1 (content + end-of-turn); observations and glue have 0 and
    no advantage."""
    sched, clock, server, env_time, _ = _setup(factory_kw={"std_s": 0.5})
    runs = run_steps(sched, clock, [server], env_time, steps=1)
    groups = runs[0].batch.groups
    samples = [s for g in groups for s in g.samples]
    advantages = sample_token_advantages([g.samples for g in groups])
    batch = pack_episode_batch(
        samples, [a for row in advantages for a in row], pad_id=0, max_len=1024
    )
    mask_bt, adv_bt = np.asarray(batch.loss_mask_bt), np.asarray(batch.advantages_bt)
    for b, s in enumerate(samples):
        mask = np.asarray(s.response_mask)
        P, R = len(s.prompt_tokens), len(s.response_tokens)
        assert mask.sum() > 0 and (mask == 0).sum() > 0  # both sampled and observation tokens
        # Sampled tokens are exactly the server's replies, one per turn.
        turns = s.reward_info["turns"]
        sampled = s.response_tokens[mask > 0]
        assert sampled.tolist().count(TOK.eos_id) == turns
        row = mask_bt[b, P - 1 : P - 1 + R]  # position t predicts token t + 1
        np.testing.assert_array_equal(row, mask)
        assert np.all(adv_bt[b, P - 1 : P - 1 + R][mask == 0] == 0)
        assert mask_bt[b, : P - 1].sum() == 0 and mask_bt[b, P - 1 + R :].sum() == 0


def test_fault_counters_are_reported_as_zero_before_any_fault():
    """A reader of metrics.jsonl finds every documented episode counter in every row,
    zero until it counts (a healthy run has no env_failures_* / episodes_env_failed)."""
    from jaxflash.envs.base import EnvFailureReason

    sched, clock, server, env_time, _ = _setup(B=1, G=2)
    run_steps(sched, clock, [server], env_time, steps=1)
    c = sched.watch.counters
    names = ["episodes_env_failed", "episodes_aborted", "env_failures", "env_calls_abandoned"]
    names += ["env_close_errors", *(f"env_failures_{r}" for r in EnvFailureReason)]
    assert {name: c.get(name) for name in names} == dict.fromkeys(names, 0)
    assert c["episodes_finished"] == 2 and c["env_calls"] > 0
