"""Dual replay cycle: mixed batches, caps over many steps, stored behaviour logprobs."""

import math

import numpy as np
import pytest

from jaxflash.algorithms.importance import per_sample_ratio_stats, ratio_metrics_by_cycle
from jaxflash.learner.batching import pack_batch
from jaxflash.replay.dual_cycle import (
    DualCycleComposer,
    DualCycleConfig,
    fresh_groups_needed,
    replay_count,
)
from jaxflash.replay.replay_buffer import ReplayBuffer
from jaxflash.replay.replay_config import ReplayConfig
from tests.replay_fixtures import make_group


def test_replay_count_and_fresh_groups_by_hand():
    assert replay_count(8, 0.0) == 0
    assert replay_count(8, 0.5) == 8  # half of 16
    assert replay_count(6, 0.25) == 2  # 2 / 8
    assert fresh_groups_needed(8, 0.5) == 4 and fresh_groups_needed(8, 0.0) == 8
    assert fresh_groups_needed(1, 0.9) == 1
    with pytest.raises(ValueError, match="replay_ratio"):
        replay_count(4, 1.0)


def test_compose_by_hand_draws_before_ingesting():
    buf = ReplayBuffer(ReplayConfig(max_age=2, max_reuse=1))
    comp = DualCycleComposer(buf)
    g0 = make_group(0, [1.0, 0.0], start=0)
    mb = comp.compose(g0, [1.0, -1.0], learner_version=0, replay_ratio=0.5)
    # Nothing stored yet: the fresh samples are not replayed in their own step.
    assert mb.cycle_b.tolist() == [0, 0] and mb.metrics["cycle_replay_shortfall"] == 2
    assert mb.metrics["cycle_fresh_stored"] == 2
    g1 = make_group(1, [0.0, 1.0, 1.0, 0.0], start=1)
    mb = comp.compose(g1, [-1.0, 1.0, 1.0, -1.0], learner_version=1, replay_ratio=0.5)
    assert mb.cycle_b.tolist() == [0, 0, 0, 0, 1, 1]
    assert sorted(s.prompt_id for s in mb.samples[4:]) == [0, 0]
    assert [float(a) for a in mb.advantages[:4]] == [-1.0, 1.0, 1.0, -1.0]
    assert sorted(float(a) for a in mb.advantages[4:]) == [-1.0, 1.0]  # fixed at ingestion
    m = mb.metrics
    assert (m["cycle_replay_requested"], m["cycle_replay_samples"]) == (4, 2)
    assert m["cycle_replay_ratio"] == pytest.approx(2 / 6)
    assert m["replay_age_hist"] == [0, 2, 0] and m["replay_reuse_hist"] == [0, 2]
    assert m["replay_evicted_reuse"] == 2 and m["replay_size"] == 4
    # rho = 0: plain async, but the buffer keeps filling so replay can start later.
    mb = comp.compose(
        make_group(2, [1.0, 0.0], start=2), [1.0, -1.0], learner_version=2, replay_ratio=0.0
    )
    assert mb.cycle_b.tolist() == [0, 0] and len(buf) == 6


def test_joint_and_split_through_the_composer_by_hand():
    prompt = (4, 4)
    cfg = ReplayConfig(sampler="per_prompt", prompt_strategy="recent", max_age=3)
    for mode, want_replay, want_fresh in [
        # Replayed [1, 0]: split -> +-0.7071 (own set); fresh kept as given.
        ("split", [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)], [9.0, 9.0]),
        # Joint set [1, 1, 1, 0]: mean 0.75, std 0.5 -> fresh 0.5, 0.5; replayed 0.5, -1.5.
        ("joint", [0.5, -1.5], [0.5, 0.5]),
    ]:
        comp = DualCycleComposer(ReplayBuffer(cfg), DualCycleConfig(advantages=mode))
        comp.compose(
            make_group(0, [1.0, 0.0], prompt=prompt),
            [7.0, -7.0],
            learner_version=0,
            replay_ratio=0.5,
        )
        mb = comp.compose(
            make_group(1, [1.0, 1.0], prompt=prompt),
            [9.0, 9.0],
            learner_version=1,
            replay_ratio=0.5,
        )
        assert mb.cycle_b.tolist() == [0, 0, 1, 1]
        replay_rewards = [s.reward for s in mb.samples[2:]]
        got = dict(zip(replay_rewards, [float(a) for a in mb.advantages[2:]], strict=True))
        np.testing.assert_allclose([got[1.0], got[0.0]], want_replay, rtol=1e-5)
        np.testing.assert_allclose([float(a) for a in mb.advantages[:2]], want_fresh, rtol=1e-5)


def test_config_refusals_name_the_fields():
    with pytest.raises(ValueError, match="estimator would be ignored"):
        DualCycleConfig(advantages="fixed", estimator="rloo")
    with pytest.raises(ValueError, match="sampler='per_prompt'"):
        DualCycleComposer(ReplayBuffer(ReplayConfig()), DualCycleConfig(advantages="joint"))
    comp = DualCycleComposer(ReplayBuffer(ReplayConfig()))
    with pytest.raises(ValueError, match="2 samples but 1 advantages"):
        comp.compose(make_group(0, [1.0, 0.0]), [1.0], learner_version=0, replay_ratio=0.5)


@pytest.mark.parametrize("sampler", ["uniform", "recency", "freshness", "per_prompt"])
def test_randomised_training_never_exceeds_caps(sampler):
    """Over 150 steps every sample is trained fresh once, then replayed at most
    max_reuse times, never at an age above max_age, never in its fresh step."""
    rng = np.random.default_rng(7)
    cfg = ReplayConfig(capacity=30, max_age=3, max_reuse=2, sampler=sampler, seed=1)
    comp = DualCycleComposer(ReplayBuffer(cfg))
    trained: dict[tuple[int, int], list[int]] = {}  # identity -> versions it was trained at
    pid = 0
    total_replayed = 0
    for v in range(150):
        fresh = []
        for _ in range(int(rng.integers(1, 4))):
            lag = int(rng.integers(0, 3))
            fresh += make_group(
                pid, rng.integers(0, 2, 2).astype(float), start=max(0, v - lag), prompt=(3, pid % 4)
            )
            pid += 1
        rho = float(rng.choice([0.0, 0.25, 0.5, 0.75]))
        mb = comp.compose(
            fresh, rng.normal(size=len(fresh)).tolist(), learner_version=v, replay_ratio=rho
        )
        total_replayed += mb.metrics["cycle_replay_samples"]
        for s, c in zip(mb.samples, mb.cycle_b, strict=True):
            ident = (s.prompt_id, s.sample_index)
            age = v - int(min(s.start_version, np.min(s.token_versions)))
            if c == 1:
                assert 1 <= age <= cfg.max_age
                assert trained[ident] and trained[ident][-1] < v  # never in its fresh step
            trained.setdefault(ident, []).append(v)
        n = len(mb.samples)
        assert mb.metrics["cycle_replay_samples"] + mb.metrics["cycle_fresh_samples"] == n
        assert mb.metrics["cycle_replay_samples"] <= mb.metrics["cycle_replay_requested"]
    assert max(len(vs) for vs in trained.values()) <= 1 + cfg.max_reuse
    assert total_replayed == comp.buffer.counters()["replayed"] > 30


def test_replayed_ratios_use_the_stored_behaviour_logprobs():
    comp = DualCycleComposer(ReplayBuffer(ReplayConfig(max_age=2, drop_uniform_groups=False)))
    old = make_group(0, [1.0, 0.0], start=0, length=4)
    mu_stored = [s.behaviour_logprobs.copy() for s in old]
    comp.compose(old, [1.0, -1.0], learner_version=0, replay_ratio=0.0)
    for s in old:  # the runtime reuses / overwrites its own objects afterwards
        s.behaviour_logprobs[:] = 0.0
    fresh = make_group(1, [0.0, 1.0], start=1, length=4)
    mb = comp.compose(fresh, [-1.0, 1.0], learner_version=1, replay_ratio=0.5)
    batch = pack_batch(list(mb.samples), [float(a) for a in mb.advantages], length_multiple=8)
    mask = batch.loss_mask_bt
    for row in (2, 3):  # the replayed rows carry the logprobs stored at generation
        idx = mb.samples[row].sample_index
        np.testing.assert_array_equal(batch.behaviour_logp_bt[row][mask[row] > 0], mu_stored[idx])
        assert (batch.token_versions_bt[row][mask[row] > 0] == 0).all()
    # The current policy: on fresh tokens equal to mu; replayed tokens log pi = mu + 0.3.
    logp = batch.behaviour_logp_bt + np.where(mb.cycle_b[:, None] == 1, 0.3, 0.0) * mask
    stats = per_sample_ratio_stats(logp - batch.behaviour_logp_bt, mask)
    m = ratio_metrics_by_cycle(stats, mb.cycle_b)
    assert m["fresh_ratio_mean"] == pytest.approx(1.0)
    assert m["replay_ratio_mean"] == pytest.approx(math.exp(0.3), rel=1e-6)
    assert m["replay_ess_token"] == pytest.approx(1.0)  # equal weights
    assert m["replay_sequences"] == 2 and m["replay_ratio_tokens"] == 8


def test_resumed_composer_builds_the_same_batches():
    import json

    cfg = ReplayConfig(sampler="per_prompt", prompt_strategy="max_variance", max_age=3, seed=4)
    mode = DualCycleConfig(advantages="joint", estimator="rloo")

    def steps(comp, vs):
        out = []
        for v in vs:
            rng = np.random.default_rng(v)
            fresh = make_group(v, rng.integers(0, 3, 4) / 2.0, start=v, prompt=(1, v % 3))
            mb = comp.compose(
                fresh, rng.normal(size=4).tolist(), learner_version=v, replay_ratio=0.5
            )
            out.append(
                (
                    [r.uid for r in mb.replayed],
                    [float(a) for a in mb.advantages],
                    mb.cycle_b.tolist(),
                )
            )
        return out

    full = steps(DualCycleComposer(ReplayBuffer(cfg), mode), range(20))
    first = DualCycleComposer(ReplayBuffer(cfg), mode)
    head = steps(first, range(10))
    state = json.loads(json.dumps(first.buffer.state_dict()))
    resumed = DualCycleComposer(ReplayBuffer.from_state_dict(cfg, state), mode)
    assert head + steps(resumed, range(10, 20)) == full
    assert sum(len(u) for u, _, _ in full) > 10
