"""ReplayBuffer: caps, eviction, sampling rules against hand-worked numbers, resume."""

import json

import numpy as np
import pytest

from jaxflash.replay import replay_sampling as rs
from jaxflash.replay.replay_buffer import ReplayBuffer
from jaxflash.replay.replay_config import ReplayConfig
from jaxflash.replay.replay_entry import prompt_key
from tests.replay_fixtures import make_group, make_sample


def _balanced(buf: ReplayBuffer) -> bool:
    c = buf.counters()
    evicted = c["evicted_capacity"] + c["evicted_age"] + c["evicted_reuse"]
    return c["ingested"] == c["size"] + evicted and buf.reuse_histogram().sum() == evicted


def _ingest(buf, samples, v, adv=1.0):
    return buf.ingest(samples, [adv] * len(samples), learner_version=v)


# -- rules, by hand -------------------------------------------------------------


def test_recency_and_freshness_weights_by_hand():
    np.testing.assert_array_equal(rs.recency_weights(3, 1.0), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(rs.recency_weights(3, 2.0), [1.0, 4.0, 9.0])
    np.testing.assert_array_equal(rs.recency_weights(3, 0.0), [1.0, 1.0, 1.0])
    p = rs.freshness_priorities(np.array([1.0, 2.0]), np.array([0, 2]), tau=2.0)
    np.testing.assert_allclose(p, [1.0, 2.0 * np.exp(-1.0)], rtol=1e-12)
    with pytest.raises(ValueError, match="tau"):
        rs.freshness_priorities(np.ones(1), np.zeros(1), tau=0.0)


def test_per_prompt_strategies_by_hand():
    rewards = np.array([0.0, 1.0, 1.0, 0.0, 0.5])
    order = np.arange(5)
    assert rs.recent_k(order, 2).tolist() == [4, 3]
    assert rs.highest_reward_k(rewards, order, 2).tolist() == [2, 1]  # ties: newest first
    # k=2: {0 (newest: 3), 1 (newest: 2)} has variance 0.25, every other split 0.
    assert rs.max_variance_k(rewards, order, 2).tolist() == [3, 2]
    # k=3: j=1 -> {0, 1, 1} and j=2 -> {0, 0, 1} both 2/9; the smaller j wins.
    assert rs.max_variance_k(rewards, order, 3).tolist() == [3, 2, 1]
    assert np.var(rewards[[3, 2, 1]]) == pytest.approx(2 / 9)
    assert sorted(rs.max_variance_k(rewards, order, 5).tolist()) == [0, 1, 2, 3, 4]
    assert rs.recent_k(order, 9).tolist() == [4, 3, 2, 1, 0]


def test_max_variance_is_the_best_subset_by_brute_force():
    from itertools import combinations

    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 8))
        k = int(rng.integers(1, n + 1))
        rewards = rng.integers(0, 4, n).astype(np.float64) / 2
        got = rs.max_variance_k(rewards, np.arange(n), k)
        assert len(set(got.tolist())) == k
        best = max(np.var(rewards[list(c)]) for c in combinations(range(n), k))
        assert np.var(rewards[got]) == pytest.approx(best)


def test_draw_never_picks_zero_weight_and_caps_k():
    rng = np.random.default_rng(0)
    for _ in range(20):
        got = rs.draw_without_replacement(rng, 5, np.array([0.0, 1.0, 0.0, 2.0]))
        assert sorted(got.tolist()) == [1, 3]


# -- caps and eviction, by hand ------------------------------------------------


def test_capacity_evicts_oldest_and_counts():
    buf = ReplayBuffer(ReplayConfig(capacity=3, max_age=4, drop_uniform_groups=False))
    for pid in range(5):
        _ingest(buf, [make_sample(pid, start=0)], v=0)
    got = buf.sample(10, learner_version=1)
    assert sorted(r.sample.prompt_id for r in got) == [2, 3, 4]
    c = buf.counters()
    assert c["evicted_capacity"] == 2 and c["ingested"] == 5
    assert buf.reuse_histogram().tolist() == [2, 3]  # 2 evicted unused, 3 retired after 1 replay
    assert _balanced(buf)


def test_age_cap_off_by_one():
    # Tokens spanning versions {3, 4}: start version 3; max_age 2 -> drawable up to v = 5.
    buf = ReplayBuffer(ReplayConfig(max_age=2, max_reuse=5, drop_uniform_groups=False))
    _ingest(buf, [make_sample(1, versions=[3, 4, 4])], v=4)
    assert buf.sample(1, learner_version=4) == []  # never at the version of its fresh use
    assert [r.age for r in buf.sample(1, learner_version=5)] == [2]
    assert buf.sample(1, learner_version=6) == []
    assert buf.counters()["evicted_age"] == 1 and len(buf) == 0
    # Started at 4, fresh-trained at 6 (age 2): one version later its age is 3 > 2, so
    # it could never be replayed and is not stored.
    assert _ingest(buf, [make_sample(2, versions=[4, 5, 6])], v=6) == 0
    assert buf.counters()["rejected_age"] == 1
    assert _balanced(buf)


def test_reuse_cap_retires_after_max_reuse():
    buf = ReplayBuffer(ReplayConfig(max_age=8, max_reuse=2, drop_uniform_groups=False))
    _ingest(buf, [make_sample(1)], v=0)
    assert [r.replay_count for r in buf.sample(1, learner_version=1)] == [1]
    assert [r.replay_count for r in buf.sample(1, learner_version=2)] == [2]
    assert buf.sample(1, learner_version=3) == []
    assert buf.counters()["evicted_reuse"] == 1
    assert buf.reuse_histogram().tolist() == [0, 0, 1]
    assert buf.counters()["replayed"] == 2


def test_uniform_groups_not_stored_and_versions_only_go_up():
    buf = ReplayBuffer(ReplayConfig())
    assert _ingest(buf, make_group(1, [1.0, 1.0, 1.0]), v=3) == 0
    assert _ingest(buf, make_group(2, [1.0, 0.0, 1.0]), v=3) == 3
    assert buf.counters()["rejected_uniform"] == 3
    with pytest.raises(ValueError, match="version 2 after version 3"):
        buf.sample(1, learner_version=2)


def test_bad_inputs_are_refused_with_names():
    with pytest.raises(ValueError, match=r"\['recency_exponent'\] would be ignored"):
        ReplayConfig(sampler="uniform", recency_exponent=2.0)
    with pytest.raises(ValueError, match="max_reuse"):
        ReplayConfig(max_reuse=0)
    buf = ReplayBuffer(ReplayConfig(drop_uniform_groups=False))
    with pytest.raises(ValueError, match="advantage must be a scalar or"):
        buf.ingest([make_sample(1)], [np.zeros(2)], learner_version=0)
    with pytest.raises(ValueError, match=r"prompt 1, index 0\): reward"):
        s = make_sample(1)
        s.reward = float("nan")
        buf.ingest([s], [0.0], learner_version=0)
    with pytest.raises(ValueError, match="sample_for_prompts"):
        buf.sample_for_prompts([("k", 1)], learner_version=0)


def test_stored_arrays_are_read_only_copies():
    buf = ReplayBuffer(ReplayConfig(drop_uniform_groups=False))
    s = make_sample(1)
    mu = s.behaviour_logprobs.copy()
    _ingest(buf, [s], v=0)
    s.behaviour_logprobs[:] = 0.0  # the runtime's object changes later: the buffer's does not
    (r,) = buf.sample(1, learner_version=1)
    np.testing.assert_array_equal(r.sample.behaviour_logprobs, mu)
    with pytest.raises(ValueError, match="read-only"):
        r.sample.behaviour_logprobs[0] = 1.0


# -- sampling rules through the buffer equal the documented draw ---------------


@pytest.mark.parametrize(
    "cfg,weights",
    [
        (dict(sampler="uniform"), None),
        (dict(sampler="recency", recency_exponent=1.0), [1.0, 2.0, 3.0, 4.0]),
        # |A| = [0.5, 1, 2, 4] + 1e-6, ages [3, 2, 2, 1] at v = 4, tau = 2.
        (dict(sampler="freshness", freshness_tau=2.0), "fresh"),
    ],
)
def test_buffer_draw_equals_rule(cfg, weights):
    buf = ReplayBuffer(ReplayConfig(seed=7, max_age=4, drop_uniform_groups=False, **cfg))
    advs, starts = [0.5, 1.0, 2.0, 4.0], [1, 2, 2, 3]
    for pid, (a, st) in enumerate(zip(advs, starts, strict=True)):
        buf.ingest([make_sample(pid, start=st)], [a], learner_version=3)
    got = [r.sample.prompt_id for r in buf.sample(2, learner_version=4)]
    rng = np.random.default_rng(7)
    if weights is None:
        want = rng.choice(4, size=2, replace=False)
    else:
        if weights == "fresh":
            weights = (np.array(advs) + 1e-6) * np.exp(-np.array([3, 2, 2, 1]) / 2.0)
        w = np.asarray(weights)
        want = rng.choice(4, size=2, replace=False, p=w / w.sum())
    assert got == want.tolist()


def test_recency_frequencies_follow_weights():
    rng = np.random.default_rng(1)
    w = rs.recency_weights(4, 1.0)
    counts = np.zeros(4)
    for _ in range(4000):
        counts[rs.draw_without_replacement(rng, 1, w)] += 1
    np.testing.assert_allclose(counts / 4000, w / w.sum(), atol=0.025)


def test_per_prompt_buffer_keys_on_prompt_tokens():
    buf = ReplayBuffer(ReplayConfig(sampler="per_prompt", prompt_strategy="highest_reward"))
    # Same question under two prompt ids (two epochs), plus another question.
    buf.ingest(make_group(10, [0.0, 1.0], prompt=(5, 6)), [-1.0, 1.0], learner_version=0)
    buf.ingest(make_group(11, [0.5, 0.0], prompt=(5, 6)), [1.0, -1.0], learner_version=1)
    buf.ingest(make_group(12, [1.0, 0.0], prompt=(8, 9)), [1.0, -1.0], learner_version=1)
    key = prompt_key(np.array([5, 6]))
    got = buf.sample_for_prompts([(key, 2), ("missing", 3)], learner_version=2)
    assert [(r.sample.prompt_id, r.sample.reward) for r in got] == [(10, 1.0), (11, 0.5)]


# -- randomised: never past the caps; counters add up --------------------------


@pytest.mark.parametrize("sampler", ["uniform", "recency", "freshness", "per_prompt"])
def test_randomised_caps_hold_over_many_steps(sampler):
    rng = np.random.default_rng(hash(sampler) % 2**32)
    extra = {"per_prompt": dict(prompt_strategy="max_variance")}.get(sampler, {})
    cfg = ReplayConfig(capacity=40, max_age=3, max_reuse=2, sampler=sampler, seed=3, **extra)
    buf = ReplayBuffer(cfg)
    uses: dict[int, int] = {}
    ingested_at: dict[int, int] = {}
    pid = 0
    for v in range(200):
        keys = []
        for _ in range(int(rng.integers(0, 4))):
            lag = int(rng.integers(0, 4))  # staleness of the fresh group at v
            prompt = (1, int(rng.integers(0, 5)))  # few questions: per-prompt hits
            group = make_group(
                pid, rng.integers(0, 2, 3).astype(float), start=max(0, v - lag), prompt=prompt
            )
            keys.append(prompt)
            pid += 1
            buf.ingest(group, rng.normal(size=3).tolist(), learner_version=v)
            for s in group:
                ingested_at.setdefault(s.prompt_id * 10 + s.sample_index, v)
        if sampler == "per_prompt":
            reqs = [(prompt_key(np.array(p)), int(rng.integers(0, 4))) for p in keys]
            got = buf.sample_for_prompts(reqs, learner_version=v + 1)
        else:
            got = buf.sample(int(rng.integers(0, 8)), learner_version=v + 1)
        assert len({r.uid for r in got}) == len(got)
        for r in got:
            assert 0 <= r.age <= cfg.max_age
            assert r.age == v + 1 - int(np.min(r.sample.token_versions))
            uses[r.uid] = uses.get(r.uid, 0) + 1
            assert uses[r.uid] == r.replay_count <= cfg.max_reuse
            key = r.sample.prompt_id * 10 + r.sample.sample_index
            assert ingested_at[key] < v + 1
        assert _balanced(buf)
        assert len(buf) <= cfg.capacity
    assert buf.counters()["replayed"] == sum(uses.values()) > 50
    assert buf.age_histogram().sum() == sum(uses.values())


# -- resume: the restored buffer draws what the uninterrupted one draws --------


def _drive(buf, steps, seed, sampler):
    """Feed a fixed stream (function of seed and step only) and record every draw."""
    out = []
    for v in steps:
        rng = np.random.default_rng([seed, v])
        group = make_group(v, rng.integers(0, 3, 4) / 2.0, start=v, prompt=(2, v % 3))
        buf.ingest(group, rng.normal(size=4).tolist(), learner_version=v)
        if sampler == "per_prompt":
            got = buf.sample_for_prompts(
                [(prompt_key(np.array((2, v % 3))), 3)], learner_version=v + 1
            )
        else:
            got = buf.sample(3, learner_version=v + 1)
        out.append(
            [
                (
                    r.uid,
                    r.age,
                    r.replay_count,
                    r.sample.behaviour_logprobs.tobytes(),
                    float(r.advantage),
                )
                for r in got
            ]
        )
    return out


@pytest.mark.parametrize("sampler", ["uniform", "recency", "freshness", "per_prompt"])
def test_resume_draws_equal_uninterrupted(sampler, tmp_path):
    extra = {
        "recency": dict(recency_exponent=2.0),
        "freshness": dict(freshness_tau=1.5),
        "per_prompt": dict(prompt_strategy="max_variance"),
    }.get(sampler, {})
    cfg = ReplayConfig(capacity=9, max_age=3, max_reuse=2, sampler=sampler, seed=11, **extra)
    full = _drive(ReplayBuffer(cfg), range(30), 5, sampler)

    first = ReplayBuffer(cfg)
    head = _drive(first, range(15), 5, sampler)
    # Through a real checkpoint's JSON metadata item.
    import jax.numpy as jnp

    from jaxflash.checkpoint import Checkpointer, CheckpointMeta

    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(
            {"x": jnp.zeros(2)}, CheckpointMeta(step=15, extra={"replay": first.state_dict()})
        )
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        _, meta = ckpt.restore(15, {"x": jnp.zeros(2)})
    resumed = ReplayBuffer.from_state_dict(cfg, meta.extra["replay"])
    assert resumed.counters() == first.counters()
    tail = _drive(resumed, range(15, 30), 5, sampler)
    assert head + tail == full
    assert sum(len(x) for x in full) > 20


def test_state_dict_is_json_and_refuses_other_config():
    buf = ReplayBuffer(ReplayConfig(drop_uniform_groups=False))
    buf.ingest([make_sample(1, mask=[1, 0, 1])], [np.array([1.0, 0.0, -1.0])], learner_version=0)
    state = json.loads(json.dumps(buf.state_dict()))
    back = ReplayBuffer.from_state_dict(ReplayConfig(drop_uniform_groups=False), state)
    (a,), (b,) = buf.sample(1, learner_version=1), back.sample(1, learner_version=1)
    np.testing.assert_array_equal(a.advantage, b.advantage)
    np.testing.assert_array_equal(a.sample.response_mask, b.sample.response_mask)
    assert a.sample.reward_info == b.sample.reward_info and a.sample.response_text == "r1.0"
    with pytest.raises(ValueError, match=r"\['max_age'\]"):
        ReplayBuffer.from_state_dict(ReplayConfig(drop_uniform_groups=False, max_age=9), state)


def test_reward_info_with_numpy_numbers_is_stored_as_json():
    buf = ReplayBuffer(ReplayConfig(drop_uniform_groups=False))
    s = make_sample(1)
    s.reward_info = {"components": {"math": np.float32(1.0)}, "error": None}
    buf.ingest([s], [1.0], learner_version=0)
    json.dumps(buf.state_dict())
    s2 = make_sample(2)
    s2.reward_info = {"bad": object()}
    with pytest.raises(TypeError, match=r"prompt 2, index 0\): reward_info"):
        buf.ingest([make_sample(3), s2], [1.0, 1.0], learner_version=0)
    assert buf.counters()["ingested"] == 1  # nothing of the refused call was stored


def test_future_versions_are_refused_and_a_refused_call_changes_nothing():
    buf = ReplayBuffer(ReplayConfig(drop_uniform_groups=False, max_age=3))
    _ingest(buf, [make_sample(1, start=0)], v=0)
    bad = make_sample(2, start=1)
    bad.reward = None
    with pytest.raises(ValueError, match="reward"):
        buf.ingest([make_sample(3, start=5), bad], [1.0, 1.0], learner_version=5)
    assert buf.version == 0 and len(buf) == 1  # no eviction, no version advance
    # A sample stamped after the learner version (negative staleness) is never stored.
    assert _ingest(buf, [make_sample(4, versions=[2, 3, 3])], v=2) == 0
    assert buf.counters()["rejected_anomaly"] == 1
    assert [r.age for r in buf.sample(2, learner_version=3)] == [3]
