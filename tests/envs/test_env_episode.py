"""Multi-turn episodes, token in / token out: masks, deltas, versions, limits, failures."""

import concurrent.futures
import dataclasses
import threading

import numpy as np
import pytest

from jaxflash.envs.base import (
    EnvConfig,
    EnvFailureReason,
    StepOutcome,
    StepResult,
    checked_reset,
    checked_step,
)
from jaxflash.envs.chat import TurnRenderer
from jaxflash.envs.episode import Episode, EpisodeEnd, split_turn_index, turn_sample_index
from jaxflash.types import FinishReason, SamplingParams
from tests.envs_fixtures import chatml_tokenizer, text_sample

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64)


class ScriptEnv:
    """Replies "o<turn>" to every action; ends when told; can misbehave on demand."""

    def __init__(self, config=None, *, terminate_at=None, step_value=None, reset_value=None):
        self.config = config or EnvConfig(max_turns=4, max_tokens_per_turn=16)
        self.terminate_at, self.step_value, self.reset_value = terminate_at, step_value, reset_value
        self.turn = 0
        self.actions = []

    def reset(self, seed):
        if isinstance(self.reset_value, Exception):
            raise self.reset_value
        return "start" if self.reset_value is None else self.reset_value

    def step(self, action_text):
        self.actions.append(action_text)
        self.turn += 1
        if self.step_value is not None:
            if isinstance(self.step_value, Exception):
                raise self.step_value
            return self.step_value
        done = self.terminate_at is not None and self.turn >= self.terminate_at
        return StepResult(f"o{self.turn}", 0.5 * self.turn, done, False, {"success": done})

    def close(self):
        pass


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


def new_episode(tok, env, *, max_context_tokens=512, start_version=0, episode_index=0):
    return Episode(
        TurnRenderer(tok),
        env.config,
        prompt_id=7,
        episode_index=episode_index,
        env_seed=3,
        start_version=start_version,
        max_context_tokens=max_context_tokens,
    )


def play(tok, env, ep, replies, **sample_kw):
    """Run turns with the given reply texts until the episode ends or replies run out."""
    ep.begin(checked_reset(env, ep.env_seed))
    for reply in replies:
        if ep.done:
            break
        req = ep.next_request(SAMPLING)
        kw = reply if isinstance(reply, dict) else {"text": reply}
        action = ep.record_turn(text_sample(tok, req, **{**sample_kw, **kw}))
        ep.record_step(checked_step(env, action))
    return ep.trajectory()


def test_chatml_assistant_turn_mask_exact(tok):
    # Pitfall case: [<|im_start|>, "assistant", "\n", "Hi", "!", <|im_end|>, "\n"]
    # -> loss mask [0, 0, 0, 1, 1, 1, 0].
    env = ScriptEnv()
    traj = play(tok, env, new_episode(tok, env), ["Hi!", "Hi!", "Hi!"])
    ids = [tok.token_to_id(t) for t in ("<|im_start|>", "assistant", "\n", "Hi", "!", "<|im_end|>")]
    turn_ids = ids + [tok.token_to_id("\n")]
    resp, mask = traj.response_tokens.tolist(), traj.loss_mask.tolist()
    # Turn 2's segment: the generation prompt the delta ends with, the sampled turn, the glue.
    start = traj.turns[1].offset - 3
    assert resp[start : start + 7] == turn_ids
    assert mask[start : start + 7] == [0, 0, 0, 1, 1, 1, 0]
    # Turn 1 is on the response side from its first sampled token; its prompt is the first prompt.
    assert traj.prompt_tokens.tolist()[-3:] == ids[:3]
    assert resp[:3] == ids[3:] and mask[:3] == [1, 1, 1]
    assert int(traj.loss_mask.sum()) == 3 * 3  # exactly the sampled tokens of 3 turns


def test_generation_prompt_exactly_once_per_turn_and_context_is_the_full_render(tok):
    env = ScriptEnv(terminate_at=3)
    traj = play(tok, env, new_episode(tok, env), ["<answer>a</answer>", "b", "Hi!"])
    full = traj.prompt_tokens.tolist() + traj.response_tokens.tolist()
    gen = tok.encode("<|im_start|>assistant\n")
    starts = [i for i in range(len(full)) if full[i : i + len(gen)] == gen]
    assert len(starts) == len(traj.turns) == 3
    P = len(traj.prompt_tokens)
    assert [s + len(gen) - P for s in starts] == [t.offset for t in traj.turns]
    # Token in / token out equals rendering the whole transcript at once (up to the final
    # glue "\n" that follows the last <|im_end|>: the trajectory ends at the last sampled token).
    rendered = tok.apply_chat_template(list(traj.messages[:-1]), add_generation_prompt=False)
    assert full == tok.encode(rendered)[:-1]
    assert [m["content"] for m in traj.messages if m["role"] == "assistant"] == [
        "<answer>a</answer>",
        "b",
        "Hi!",
    ]


def test_sampled_tokens_are_kept_as_sampled_not_retokenised(tok):
    env = ScriptEnv()
    h, i = tok.token_to_id("H"), tok.token_to_id("i")
    assert tok.encode("Hi") == [tok.token_to_id("Hi")]  # the canonical tokenization differs
    traj = play(tok, env, new_episode(tok, env), [{"text": "", "tokens": [h, i]}])
    assert traj.response_tokens[:3].tolist() == [h, i, tok.eos_id]
    assert env.actions == ["Hi"]  # the environment saw the decoded text


def test_logprobs_and_versions_per_token_across_turns(tok):
    env = ScriptEnv()
    ep = new_episode(tok, env, start_version=2)
    traj = play(tok, env, ep, [{"text": "ab", "version": 2}, {"text": "c", "version": 3}])
    sampled = traj.loss_mask > 0
    assert traj.token_versions[sampled].tolist() == [2, 2, 2, 3, 3]
    assert np.all(traj.token_versions[~sampled] == -1)
    np.testing.assert_allclose(traj.behaviour_logprobs[sampled], [-0.1, -0.2, -0.3, -0.1, -0.2])
    assert np.all(traj.behaviour_logprobs[~sampled] == 0)
    assert traj.token_turn[sampled].tolist() == [0, 0, 0, 1, 1]
    np.testing.assert_allclose(traj.turn_rewards, [0.5, 1.0])


def test_truncated_turn_gets_the_closing_token_as_glue(tok):
    env = ScriptEnv()
    traj = play(tok, env, new_episode(tok, env), [{"text": "abc", "finish": FinishReason.LENGTH}])
    t0 = traj.turns[0]
    assert t0.finish_reason == FinishReason.LENGTH and t0.num_sampled == 3
    after = traj.response_tokens[3:6].tolist()
    assert after == [tok.eos_id, tok.token_to_id("\n"), tok.token_to_id("<|im_start|>")]
    assert traj.loss_mask[:6].tolist() == [1, 1, 1, 0, 0, 0]


def test_max_turns_and_turn_budget_and_request_identity(tok):
    env = ScriptEnv(EnvConfig(max_turns=2, max_tokens_per_turn=5))
    ep = new_episode(tok, env, episode_index=3)
    ep.begin(checked_reset(env, 3))
    req = ep.next_request(SAMPLING, seed=11)
    assert (req.prompt_id, req.sample_index, req.seed) == (7, 3 * 2 + 0, 11)
    assert req.sampling.max_new_tokens == 5 and req.sampling.temperature == 1.0
    assert split_turn_index(req.sample_index, 2) == (3, 0)
    ep.record_step(checked_step(env, ep.record_turn(text_sample(tok, req, "x"))))
    assert ep.next_request(SAMPLING).sample_index == turn_sample_index(3, 1, 2) == 7
    req = ep.next_request(SAMPLING)
    ep.record_step(checked_step(env, ep.record_turn(text_sample(tok, req, "y"))))
    assert ep.done and ep.end == EpisodeEnd.MAX_TURNS
    traj = ep.trajectory()
    assert len(traj.turns) == 2 and traj.turns[-1].observation == "o2"


def test_context_budget_limits_turns_and_ends_the_episode(tok):
    env = ScriptEnv(EnvConfig(max_turns=8, max_tokens_per_turn=100))
    ep = new_episode(tok, env, max_context_tokens=40)
    ep.begin(checked_reset(env, 3))
    P = len(ep.context())
    req = ep.next_request(SAMPLING)
    assert req.sampling.max_new_tokens == 40 - P
    ep.record_step(checked_step(env, ep.record_turn(text_sample(tok, req, "ab"))))
    while not ep.done:
        req = ep.next_request(SAMPLING)
        assert len(req.prompt_tokens) + req.sampling.max_new_tokens <= 40
        ep.record_step(checked_step(env, ep.record_turn(text_sample(tok, req, "ab"))))
    assert ep.end == EpisodeEnd.CONTEXT_FULL
    assert len(ep.context()) <= 40


def test_env_terminates_and_truncates(tok):
    env = ScriptEnv(terminate_at=2)
    traj = play(tok, env, new_episode(tok, env), ["a", "b", "c"])
    assert traj.end == EpisodeEnd.TERMINATED and len(traj.turns) == 2 and traj.success
    assert traj.episode_return == pytest.approx(1.5)
    env = ScriptEnv(step_value=StepResult("x", 0.0, False, True, {}))
    assert play(tok, env, new_episode(tok, env), ["a"]).end == EpisodeEnd.ENV_TRUNCATED


@pytest.mark.parametrize(
    "value, reason",
    [
        (RuntimeError("boom"), EnvFailureReason.RAISED),
        (StepResult(None, 0.0, False, False, {}), EnvFailureReason.BAD_OBSERVATION),
        (StepResult(b"bytes", 0.0, False, False, {}), EnvFailureReason.BAD_OBSERVATION),
        (StepResult("x", float("nan"), False, False, {}), EnvFailureReason.BAD_REWARD),
        (StepResult("x", True, False, False, {}), EnvFailureReason.BAD_REWARD),
        (StepResult("x", "1", False, False, {}), EnvFailureReason.BAD_REWARD),
        (("x", 0.0, False), EnvFailureReason.BAD_RESULT),
        (StepResult("x", 0.0, "no", False, {}), EnvFailureReason.BAD_RESULT),
        (StepResult("x", 0.0, False, False, None), EnvFailureReason.BAD_RESULT),
    ],
)
def test_env_step_faults_become_failures_with_reasons(tok, value, reason):
    env = ScriptEnv(step_value=value)
    traj = play(tok, env, new_episode(tok, env), ["a", "b"])
    assert traj.end == EpisodeEnd.ENV_FAILURE
    assert traj.failure.reason == reason and traj.failure.phase == "step"
    assert len(traj.turns) == 1 and traj.turns[0].reward is None


def test_reset_faults_and_late_calls(tok):
    env = ScriptEnv(reset_value=ValueError("no map"))
    ep = new_episode(tok, env)
    ep.begin(checked_reset(env, 3))
    assert ep.done and ep.failure.reason == EnvFailureReason.RAISED and ep.failure.phase == "reset"
    env = ScriptEnv(reset_value=42)
    out = checked_reset(env, 3)
    assert out.failure.reason == EnvFailureReason.BAD_OBSERVATION and out.observation is None
    ticks = iter([0.0, 2.5])  # a call that returned after its deadline is a timeout
    out = checked_step(ScriptEnv(), "a", deadline_s=1.0, clock=lambda: next(ticks))
    assert out.failure.reason == EnvFailureReason.TIMEOUT and out.elapsed_s == 2.5


def test_hanging_env_is_isolated_by_the_callers_worker_timeout(tok):
    # The runtime's pattern: env calls on a worker, the deadline on the future.
    release = threading.Event()

    class HangingEnv(ScriptEnv):
        def step(self, action_text):
            release.wait(10)
            return StepResult("late", 0.0, False, False, {})

    env = HangingEnv()
    ep = new_episode(tok, env)
    ep.begin(checked_reset(env, 3))
    action = ep.record_turn(text_sample(tok, ep.next_request(SAMPLING), "a"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(checked_step, env, action, deadline_s=0.2)
        with pytest.raises(concurrent.futures.TimeoutError):
            future.result(timeout=0.2)
        ep.record_step(StepOutcome.timed_out(0.2))
        release.set()  # let the abandoned worker finish so the test leaves no thread behind
    assert ep.end == EpisodeEnd.ENV_FAILURE and ep.failure.reason == EnvFailureReason.TIMEOUT


def test_misuse_is_refused(tok):
    env = ScriptEnv()
    ep = new_episode(tok, env)
    with pytest.raises(RuntimeError, match="next_request"):
        ep.next_request(SAMPLING)
    ep.begin(checked_reset(env, 3))
    req = ep.next_request(SAMPLING)
    aborted = text_sample(tok, req, "a", finish=FinishReason.ABORTED)
    with pytest.raises(ValueError, match="aborted"):
        ep.record_turn(aborted)
    wrong = dataclasses.replace(text_sample(tok, req, "a"), sample_index=req.sample_index + 1)
    with pytest.raises(ValueError, match="expected"):
        ep.record_turn(wrong)
    other_prompt = dataclasses.replace(text_sample(tok, req, "a"), prompt_tokens=np.array([1, 2]))
    with pytest.raises(ValueError, match="context"):
        ep.record_turn(other_prompt)
    ep.record_turn(text_sample(tok, req, "a"))
    with pytest.raises(RuntimeError, match="record_turn"):
        ep.record_turn(text_sample(tok, req, "a"))


def test_renderer_refuses_template_without_stop_closing(tok):
    class NoStop:
        eos_id = tok.eos_id

        def encode(self, text):
            return tok.encode(text)

        def decode(self, ids):
            return tok.decode(ids)

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    with pytest.raises(ValueError, match="not a stop id"):
        TurnRenderer(NoStop())


@pytest.mark.slow
def test_smollm2_tokenizer_episode_matches_full_render():
    # The real SmolLM2 tokenizer (GGUF): "assistant" is two tokens, a default system
    # prompt is injected; the token-in/token-out context still equals the full render.
    from jaxflash.models.formats.weights_gguf import smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    env = ScriptEnv(terminate_at=3)
    traj = play(tok, env, new_episode(tok, env), ["Hi!", "<answer>Up</answer>", "ok"])
    full = traj.prompt_tokens.tolist() + traj.response_tokens.tolist()
    rendered = tok.apply_chat_template(list(traj.messages[:-1]), add_generation_prompt=False)
    assert full == tok.encode(rendered)[:-1]
    second = traj.turns[1].offset
    gen = tok.encode("<|im_start|>assistant\n")
    seg = slice(second - len(gen), second + len(tok.encode("<answer>Up</answer>")) + 2)
    assert traj.response_tokens[seg].tolist()[: len(gen)] == gen
    n = len(tok.encode("<answer>Up</answer>"))
    assert traj.loss_mask[seg].tolist() == [0] * len(gen) + [1] * (n + 1) + [0]
