"""Episodes -> learner samples and advantages (trajectory and step level), by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms import episode_advantages as ea
from jaxflash.envs.base import EnvConfig, StepResult, checked_reset, checked_step
from jaxflash.envs.chat import TurnRenderer
from jaxflash.envs.episode import Episode, EpisodeEnd
from jaxflash.envs.training import (
    group_token_advantages,
    token_advantages,
    trajectory_to_sample,
    turn_reward_arrays,
    unfinished_sample,
)
from jaxflash.learner.batching import pack_batch
from jaxflash.learner.episode_batching import pack_episode_batch
from jaxflash.types import FinishReason, SamplingParams
from tests.envs_fixtures import chatml_tokenizer, text_sample

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64)
NAN = float("nan")


class RewardEnv:
    """Gives the listed rewards turn by turn and terminates after the last one."""

    def __init__(self, rewards):
        self.config = EnvConfig(max_turns=8, max_tokens_per_turn=16)
        self.rewards = list(rewards)
        self.t = 0

    def reset(self, seed):
        return "go"

    def step(self, action_text):
        r = self.rewards[self.t]
        self.t += 1
        done = self.t == len(self.rewards)
        return StepResult(f"o{self.t}", r, done, False, {"success": done and r > 0})

    def close(self):
        pass


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


def episode(tok, rewards, *, index=0, versions=None, start_version=0, last_finish=None):
    env = RewardEnv(rewards)
    ep = Episode(
        TurnRenderer(tok),
        env.config,
        prompt_id=5,
        episode_index=index,
        env_seed=1,
        start_version=start_version,
        max_context_tokens=1024,
    )
    ep.begin(checked_reset(env, 1))
    k = 0
    while not ep.done:
        finish = FinishReason.EOS
        if last_finish is not None and k == len(rewards) - 1:
            finish = last_finish
        v = versions[k] if versions else start_version
        sample = text_sample(tok, ep.next_request(SAMPLING), "ab", version=v, finish=finish)
        ep.record_step(checked_step(env, ep.record_turn(sample)))
        k += 1
    return ep.trajectory()


# Group used by hand below: A = [-0.01, 0, 1] (invalid action, move, success),
# B = [0, 0] (two moves, fails), C = [0.5] (one turn).
A, B, C = [-0.01, 0.0, 1.0], [0.0, 0.0], [0.5]


def arrays():
    rewards = np.array([[A, B + [0.0], C + [0.0, 0.0]]], np.float32)
    mask = np.array([[[1, 1, 1], [1, 1, 0], [1, 0, 0]]], np.float32)
    return rewards, mask


def test_returns_to_go_by_hand():
    rewards, mask = arrays()
    np.testing.assert_allclose(
        ea.returns_to_go(rewards, mask, gamma=1.0)[0], [[0.99, 1, 1], [0, 0, 0], [0.5, 0, 0]]
    )
    # gamma 0.5: A: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = -0.01 + 0.5 * 0.5 = 0.24.
    np.testing.assert_allclose(
        ea.returns_to_go(rewards, mask, gamma=0.5)[0],
        [[0.24, 0.5, 1], [0, 0, 0], [0.5, 0, 0]],
        rtol=1e-6,
    )


def test_trajectory_advantages_by_hand():
    rewards, mask = arrays()
    # Scores [0.99, 0, 0.5]: mean 0.496667, deviations [0.493333, -0.496667, 0.003333],
    # sum of squares 0.490067, std (ddof 1) 0.495008.
    adv = ea.trajectory_advantages(rewards, mask, eps=0.0)
    np.testing.assert_allclose(adv, [[0.99661605, -1.00334994, 0.00673389]], rtol=1e-5)
    # A missing 4th episode (all-zero mask) changes nothing and gets 0; NaN behind it too.
    r4 = np.concatenate([rewards, np.full((1, 1, 3), NAN, np.float32)], axis=1)
    m4 = np.concatenate([mask, np.zeros((1, 1, 3), np.float32)], axis=1)
    np.testing.assert_allclose(
        ea.trajectory_advantages(r4, m4, eps=0.0),
        [[0.99661605, -1.00334994, 0.00673389, 0]],
        rtol=1e-5,
    )


def test_step_advantages_by_hand():
    rewards, mask = arrays()
    # Turn returns {0.99, 1, 1 | 0, 0 | 0.5}: mean 0.581667, sum of squared deviations
    # 1.200083, std (ddof 1) 0.489915.
    adv = ea.step_advantages(rewards, mask, eps=0.0)
    np.testing.assert_allclose(
        adv[0],
        [[0.833478, 0.853890, 0.853890], [-1.187281, -1.187281, 0], [-0.166696, 0, 0]],
        rtol=1e-5,
    )
    # gamma 0.5: {0.24, 0.5, 1 | 0, 0 | 0.5}: mean 0.373333, std 0.379825.
    adv = ea.step_advantages(rewards, mask, gamma=0.5, eps=0.0)
    np.testing.assert_allclose(
        adv[0],
        [[-0.351039, 0.333487, 1.649885], [-0.982910, -0.982910, 0], [0.333487, 0, 0]],
        rtol=1e-5,
    )


def test_all_equal_returns_give_exact_zero_and_bad_inputs_are_refused():
    rewards = np.full((1, 4, 2), 0.35, np.float32)
    mask = np.ones((1, 4, 2), np.float32)
    assert np.all(np.asarray(ea.trajectory_advantages(rewards, mask)) == 0)
    assert np.all(np.asarray(ea.step_advantages(rewards[:, :, :1], mask[:, :, :1])) == 0)
    with pytest.raises(ValueError, match="gamma"):
        ea.returns_to_go(rewards, mask, gamma=1.5)
    with pytest.raises(ValueError, match=r"\[B, G, K\]"):
        ea.returns_to_go(rewards[0], mask[0])
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        ea.trajectory_advantages(rewards, mask, estimator="ppo")


def test_group_token_advantages_spread_over_sampled_tokens(tok):
    trajs = [episode(tok, A, index=0), episode(tok, B, index=1), episode(tok, C, index=2)]
    rewards, mask = turn_reward_arrays([trajs])
    np.testing.assert_array_equal(mask, arrays()[1])
    np.testing.assert_allclose(rewards * mask, arrays()[0] * arrays()[1])
    out = group_token_advantages([trajs + [None]], level="trajectory", eps=0.0)[0]
    assert out[3] is None
    for traj, adv_t, want in zip(trajs, out, [0.99661605, -1.00334994, 0.00673389], strict=False):
        sampled = traj.loss_mask > 0
        np.testing.assert_allclose(adv_t[sampled], want, rtol=1e-5)
        assert np.all(adv_t[~sampled] == 0)
    step = group_token_advantages([trajs], level="step", eps=0.0)[0]
    a = trajs[0]
    per_turn = [step[0][a.loss_mask.astype(bool) & (a.token_turn == k)] for k in range(3)]
    for got, want in zip(per_turn, [0.833478, 0.853890, 0.853890], strict=True):
        assert got.size == 3  # "ab" + <|im_end|>
        np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match="level"):
        group_token_advantages([trajs], level="token")
    with pytest.raises(ValueError, match="advantages for"):
        token_advantages(a, [1.0])


def test_trajectory_to_sample(tok):
    traj = episode(tok, A, versions=[3, 4, 4], start_version=3, last_finish=FinishReason.LENGTH)
    s = trajectory_to_sample(traj)
    assert (s.prompt_id, s.sample_index) == (5, 0)
    np.testing.assert_array_equal(s.prompt_tokens, traj.prompt_tokens)
    np.testing.assert_array_equal(s.response_tokens, traj.response_tokens)
    np.testing.assert_array_equal(s.response_mask, traj.loss_mask)
    sampled = traj.loss_mask > 0
    assert s.token_versions[sampled].tolist() == [3, 3, 3, 4, 4, 4, 4, 4]  # last turn cut: no EOS
    assert np.all(s.token_versions[~sampled] == 3) and s.start_version == 3
    assert np.all(s.behaviour_logprobs[~sampled] == 0)
    assert s.finish_reason == FinishReason.LENGTH
    assert s.reward == pytest.approx(0.99)
    assert s.reward_info["turns"] == 3 and s.reward_info["episode_end"] == "terminated"
    assert "[assistant] ab" in s.response_text


def test_failed_or_unfinished_episodes_are_not_samples(tok):
    class Broken(RewardEnv):
        def step(self, action_text):
            raise OSError("socket closed")

    env = Broken([1.0])
    ep = Episode(
        TurnRenderer(tok),
        env.config,
        prompt_id=1,
        episode_index=0,
        env_seed=0,
        start_version=0,
        max_context_tokens=256,
    )
    ep.begin(checked_reset(env, 0))
    with pytest.raises(ValueError, match="not finished"):
        trajectory_to_sample(ep.trajectory())
    ep.record_step(
        checked_step(env, ep.record_turn(text_sample(tok, ep.next_request(SAMPLING), "a")))
    )
    assert ep.end == EpisodeEnd.ENV_FAILURE
    with pytest.raises(ValueError, match="failed"):
        trajectory_to_sample(ep.trajectory())
    with pytest.raises(ValueError, match="pass None"):
        group_token_advantages([[ep.trajectory()]])


def test_an_unfinished_episode_keeps_its_tokens_so_far_with_the_training_layout(tok):
    """A failed group's episodes get rollouts.jsonl rows from ``unfinished_sample``: the
    tokens so far with trajectory_to_sample's layout (mask 1 and logprobs exactly on
    the sampled ids, the closing of a turn cut at its budget and the observation at
    mask 0 / logprob 0 / the start version), ABORTED, unscored, the env failure named."""

    class Broken(RewardEnv):
        def step(self, action_text):
            if self.t == 1:
                raise OSError("socket closed")
            return super().step(action_text)

    env = Broken([0.0, 1.0])
    ep = Episode(
        TurnRenderer(tok), env.config, prompt_id=2, episode_index=5, env_seed=9,
        start_version=4, max_context_tokens=256,
    )  # fmt: skip
    ep.begin(checked_reset(env, 9))
    fresh = unfinished_sample(ep.trajectory(), sample_index=1)  # before any turn
    assert fresh.response_tokens.size == 0 and fresh.start_version == 4
    for finish in (FinishReason.LENGTH, FinishReason.EOS):
        req = ep.next_request(SAMPLING)
        sample = text_sample(tok, req, "abc", version=5, finish=finish)
        ep.record_step(checked_step(env, ep.record_turn(sample)))
    assert ep.end == EpisodeEnd.ENV_FAILURE
    s = unfinished_sample(ep.trajectory(), sample_index=3)
    assert (s.prompt_id, s.sample_index, s.finish_reason, s.reward) == (
        2, 3, FinishReason.ABORTED, None,
    )  # fmt: skip
    assert s.reward_info["episode_index"] == 5 and s.reward_info["turns"] == 2
    assert s.reward_info["error"] == "environment raised in step: OSError: socket closed"
    mask = s.response_mask > 0
    # turn 1 cut at its budget: 3 sampled ids, then the template's <|im_end|> at mask 0
    assert mask[:4].tolist() == [True, True, True, False]
    assert s.response_tokens[3] == tok.eos_id and s.behaviour_logprobs[3] == 0.0
    assert int(mask.sum()) == 3 + 4  # turn 2 ended with its own sampled <|im_end|>
    np.testing.assert_allclose(s.behaviour_logprobs[mask], [-0.1, -0.2, -0.3] * 2 + [-0.4])
    assert np.all(s.behaviour_logprobs[~mask] == 0)
    assert np.all(s.token_versions[mask] == 5) and np.all(s.token_versions[~mask] == 4)
    assert s.start_version == 4


def test_pack_episode_batch_layout(tok):
    trajs = [episode(tok, A, index=0), episode(tok, C, index=1)]
    samples = [trajectory_to_sample(t) for t in trajs]
    advs = group_token_advantages([trajs], eps=0.0)[0]
    batch = pack_episode_batch(samples, advs, length_multiple=8)
    for b, (s, adv) in enumerate(zip(samples, advs, strict=True)):
        P, R = len(s.prompt_tokens), len(s.response_tokens)
        span = slice(P - 1, P + R - 1)
        np.testing.assert_array_equal(batch.target_ids_bt[b, span], s.response_tokens)
        np.testing.assert_array_equal(batch.loss_mask_bt[b, span], s.response_mask)
        np.testing.assert_allclose(batch.advantages_bt[b, span], adv)
        keep = s.response_mask > 0
        np.testing.assert_array_equal(batch.token_versions_bt[b, span][~keep], -1)
        np.testing.assert_array_equal(batch.behaviour_logp_bt[b, span][~keep], 0)
        np.testing.assert_allclose(
            batch.behaviour_logp_bt[b, span][keep], s.behaviour_logprobs[keep]
        )
        assert batch.loss_mask_bt[b].sum() == keep.sum()  # nothing outside the span
    # Without masks (single-turn samples) it equals pack_batch with scalar advantages.
    plain = [dataclass_without_mask(s) for s in samples]
    ref = pack_batch(plain, [0.5, -0.5], length_multiple=8)
    got = pack_episode_batch(plain, [0.5, -0.5], length_multiple=8)
    for name in ("loss_mask_bt", "advantages_bt", "behaviour_logp_bt", "token_versions_bt"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name))
    with pytest.raises(ValueError, match="advantages must be"):
        pack_episode_batch(samples, [np.zeros(3), advs[1]])
    with pytest.raises(ValueError, match="response_mask must be 0/1"):
        bad = dataclass_without_mask(samples[0])
        bad.response_mask = np.full(len(bad.response_tokens), 0.5, np.float32)
        pack_episode_batch([bad], [0.0])


def dataclass_without_mask(s):
    import dataclasses

    return dataclasses.replace(s, response_mask=None)


def test_estimators_accept_jax_arrays():
    rewards, mask = arrays()
    adv = ea.trajectory_advantages(jnp.asarray(rewards), jnp.asarray(mask), estimator="rloo")
    # RLOO: A_i = r_i - mean of the others: 0.99 - 0.25, 0 - 0.745, 0.5 - 0.495.
    np.testing.assert_allclose(adv, [[0.74, -0.745, 0.005]], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_episode_batch_trains_only_sampled_tokens(tok):
    # Tiny model, 2 devices: the learner counts and scores exactly the sampled tokens.
    import jax

    from jaxflash.learner.config import LearnerConfig
    from jaxflash.learner.state import create_train_state
    from jaxflash.learner.step import make_train_step
    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.logprobs import target_logprobs
    from jaxflash.models.decoder.transformer import forward, unembed
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.sharding.rules import LEARNER_RULES

    mc, lc = get_preset("tiny"), LearnerConfig(lr=1e-2)
    mesh = make_mesh(jax.devices()[:2], {"fsdp": 2})
    state = create_train_state(mc, lc, mesh, LEARNER_RULES, seed=0)
    trajs = [episode(tok, A, index=0), episode(tok, B, index=1)]
    batch = pack_episode_batch(
        [trajectory_to_sample(t) for t in trajs], group_token_advantages([trajs])[0]
    )
    mask = batch.loss_mask_bt > 0
    assert mask.sum() == sum(int(t.loss_mask.sum()) for t in trajs) == 15  # 5 turns x 3 tokens
    # The learner's scoring, written out (forward + target_logprobs on the same weights).
    params = jax.device_get(state.params)
    h, _ = forward(params, mc, batch.input_ids_bt, batch.positions_bt)
    sp = lc.sampling
    logp0, _ = target_logprobs(
        h,
        unembed(params, mc),
        batch.target_ids_bt,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        chunk=lc.logprob_chunk,
    )
    # Behaviour logprobs as the same weights would give them (observation positions keep 0,
    # far from the model's logprobs there: a mask that let them in would show a gap).
    batch.behaviour_logp_bt = np.where(mask, logp0, 0.0).astype(np.float32)
    _, metrics = make_train_step(mc, lc, mesh, LEARNER_RULES)(state, batch)
    metrics = jax.device_get(metrics)
    assert metrics["tokens"] == 15.0 and metrics["sequences"] == 2.0
    assert metrics["logprob_gap_max"] < 1e-5
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
