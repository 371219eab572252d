"""Agent sessions through the real endpoint and the stock ``openai`` client, with a
scripted "engine" (chosen token ids), driven by the environment driver of every
environment: trajectories hold exactly the sampled ids, tool calls are parsed in the
template's format, sessions do not mix, every failure is counted."""

from __future__ import annotations

import json
import time

import numpy as np
import openai
import pytest

from jaxflash.envs.agent_contract import AgentConfig
from jaxflash.envs.chat import TurnRenderer, renderer_for
from jaxflash.envs.driver import run_episodes
from jaxflash.envs.episode import Episode, EpisodeEnd
from jaxflash.envs.training import trajectory_to_sample
from jaxflash.learner.episode_batching import pack_episode_batch
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.replay.groups import Group
from jaxflash.runtime.agents.endpoint import AgentEndpoint
from jaxflash.runtime.agents.host import AgentHost
from jaxflash.runtime.agents.sessions import FAILURES, SessionTable
from jaxflash.runtime.model_setup import smollm2_gguf_path
from jaxflash.runtime.workloads.episode_metrics import episode_metrics
from jaxflash.types import FinishReason, Sample, SamplingParams
from tests.runtime.agents import scripted_agents

AGENTS = "tests.runtime.agents.scripted_agents"
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def renderer(tok):
    return TurnRenderer(tok)


def _host(agent: str, **fields) -> AgentHost:
    fields = {"max_turns": 4, "max_tokens_per_turn": 32, "step_timeout_s": 20.0, **fields}
    return AgentHost(AgentConfig(agent=f"{AGENTS}:{agent}", tasks=f"{AGENTS}:tasks", **fields))


class ScriptedEngine:
    """``generate``: each turn's response is the next text of its script (turn index),
    encoded char by char (valid ids a BPE never produces for the text) or canonically,
    then <|im_end|>; logprobs -0.25 per token, version 7. With ``cut_at_budget``, as an
    engine does, a response longer than the request's ``max_new_tokens`` is cut there
    (LENGTH, no <|im_end|>)."""

    def __init__(self, tok, texts, *, char_by_char=False, cut_at_budget=False):
        self.tok, self.texts, self.char_by_char = tok, texts, char_by_char
        self.cut_at_budget = cut_at_budget
        self.requests = []

    def ids(self, text):
        if self.char_by_char:
            return [i for ch in text for i in self.tok.encode(ch)]
        return self.tok.encode(text)

    def __call__(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            turn = r.sample_index % 4
            text = self.texts[turn].replace("{pid}", str(r.prompt_id))
            ids = np.asarray([*self.ids(text), 2], np.int32)  # 2: <|im_end|>
            finish = FinishReason.EOS
            if self.cut_at_budget and ids.size > r.sampling.max_new_tokens:
                ids, finish = ids[: r.sampling.max_new_tokens], FinishReason.LENGTH
            out.append(
                Sample(
                    prompt_id=r.prompt_id,
                    sample_index=r.sample_index,
                    prompt_tokens=r.prompt_tokens,
                    response_tokens=ids,
                    behaviour_logprobs=np.full(ids.shape, -0.25, np.float32),
                    token_versions=np.full(ids.shape, 7, np.int32),
                    start_version=7,
                    finish_reason=finish,
                )  # fmt: skip
            )
        return out


def _play(host, renderer, engine, seeds):
    envs = [host.make_env() for _ in seeds]
    episodes = [
        Episode(
            renderer_for(env, renderer),
            env.config,
            prompt_id=s,
            episode_index=0,
            env_seed=s,
            start_version=7,
            max_context_tokens=1024,
        )  # fmt: skip
        for env, s in zip(envs, seeds, strict=True)
    ]
    trajs = run_episodes(envs, episodes, engine, SamplingParams(max_new_tokens=32))
    for env in envs:
        env.close()
    return trajs


def test_multi_turn_sessions_train_on_exactly_the_sampled_ids(tok, renderer):
    """Two concurrent sessions (seeds 3, 5) of a tool-calling agent: the tool call is
    parsed from the template's <tool_call> format; each trajectory's loss-masked tokens
    are exactly the ids sampled, with their logprobs and versions; turn 2's prompt is
    turn 1's prompt + sampled ids + the rendered delta; replies carry the ids; the
    rewards (= seed) did not mix."""
    scripted_agents.SEEN.clear()
    host = _host("two_turns")
    engine = ScriptedEngine(tok, [CALL, "done {pid}"])
    try:
        trajs = _play(host, renderer, engine, [3, 5])
    finally:
        host.close()
    for traj in trajs:
        assert traj.end == EpisodeEnd.TERMINATED, traj.failure
        sampled = [e for e in engine.requests if e.prompt_id == traj.prompt_id]
        want = [*tok.encode(CALL), 2, *tok.encode(f"done {traj.prompt_id}"), 2]
        mask = traj.loss_mask == 1.0
        assert traj.response_tokens[mask].tolist() == want
        assert np.all(traj.behaviour_logprobs[mask] == np.float32(-0.25))
        assert np.all(traj.token_versions[mask] == 7) and np.all(traj.token_versions[~mask] == -1)
        first = np.asarray(sampled[0].prompt_tokens)
        second = np.asarray(sampled[1].prompt_tokens)
        assert second[: len(first)].tolist() == first.tolist()
        turn1 = [*tok.encode(CALL), 2]
        assert second[len(first) : len(first) + len(turn1)].tolist() == turn1
        delta = tok.decode(second[len(first) + len(turn1) :].tolist())
        assert delta == "\n<|im_start|>tool\nout 0<|im_end|>\n<|im_start|>assistant\n"
        assert f"task {traj.prompt_id} of train" in tok.decode(first.tolist())
        assert "<tools>" in tok.decode(first.tolist())  # ChatML has no tools: Hermes preamble
        assert traj.turn_rewards.tolist() == [0.0, float(traj.prompt_id)]
    replies = dict(scripted_agents.SEEN)
    assert len(replies) == 2
    for seen in replies.values():
        call = seen[0]["message"]["tool_calls"][0]
        assert seen[0]["finish_reason"] == "tool_calls" and seen[0]["message"]["content"] is None
        assert call["function"]["name"] == "python"
        assert json.loads(call["function"]["arguments"]) == {"code": "print(1)"}
        assert seen[0]["token_ids"] == [*tok.encode(CALL), 2]
        assert len(seen[0]["logprobs"]["content"]) == len(tok.encode(CALL))
        assert seen[1]["message"]["content"].startswith("done ")
    counts = host.counts()
    assert counts["agent_sessions_returned"] == 2 and counts["agent_tool_calls"] == 2
    assert counts["agent_echo_mismatch"] == counts["agent_retokenized_differently"] == 0
    # the agent's own metrics (AgentResult.metrics) reach the trained sample and the step
    samples = tuple(trajectory_to_sample(t) for t in trajs)
    assert [s.reward_info["agent_metric_turns"] for s in samples] == [2.0, 2.0]
    group = Group(prompt_id=3, start_version=7, samples=samples)
    assert episode_metrics([group], [])["agent_metric_turns"] == 2.0


def test_a_round_trip_that_retokenises_differently_is_caught_and_the_sampled_ids_kept(
    tok, renderer
):
    """The engine samples "hello there" char by char (ids the tokenizer never makes
    from that text); the agent echoes the text unchanged: re-rendering it would give
    other ids. Counted, and the context and the trained tokens are the sampled ids."""
    host = _host("two_turns_async")
    engine = ScriptedEngine(tok, ["hello there", "bye"], char_by_char=True)
    try:
        (traj,) = _play(host, renderer, engine, [1])
    finally:
        host.close()
    sampled = [*[i for ch in "hello there" for i in tok.encode(ch)], 2]
    assert sampled[:-1] != tok.encode("hello there")  # the round trip differs
    assert traj.end == EpisodeEnd.TERMINATED
    assert traj.response_tokens[: len(sampled)].tolist() == sampled
    second = engine.requests[1].prompt_tokens.tolist()
    first = engine.requests[0].prompt_tokens.tolist()
    assert second[len(first) : len(first) + len(sampled)] == sampled
    counts = host.counts()
    assert counts["agent_retokenized_differently"] == 1 and counts["agent_echo_mismatch"] == 0
    assert traj.turn_rewards.tolist() == [0.0, 0.5]


def test_a_turn_cut_at_max_tokens_is_closed_by_an_unsampled_token_that_is_never_trained(
    tok, renderer
):
    """The agent asks for max_tokens=3: the engine samples 3 ids of its text and stops
    (LENGTH, no <|im_end|>). The next prompt closes that turn with the template's
    <|im_end|>, which the engine never sampled: it is an observation token like the
    rest of the delta -- loss mask 0, behaviour logprob 0, version -1 -- in the
    trajectory and in the learner's packed batch, and not counted as sampled."""
    scripted_agents.SEEN.clear()
    host = _host("cut_short")
    engine = ScriptedEngine(tok, ["the answer is forty two", "ok"], cut_at_budget=True)
    try:
        (traj,) = _play(host, renderer, engine, [2])
    finally:
        host.close()
    assert traj.end == EpisodeEnd.TERMINATED, traj.failure
    cut = tok.encode("the answer is forty two")[:3]
    (seen,) = scripted_agents.SEEN.values()
    assert seen[0]["finish_reason"] == "length" and seen[0]["token_ids"] == cut
    assert traj.turns[0].finish_reason == FinishReason.LENGTH
    # After the 3 sampled ids: the closing <|im_end|>, then the user message's glue.
    end = traj.turns[1].offset  # turn 2's first sampled id
    assert traj.response_tokens[:4].tolist() == [*cut, tok.eos_id]
    delta = tok.decode(traj.response_tokens[3:end].tolist())
    assert delta == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert traj.loss_mask[:end].tolist() == [1.0] * 3 + [0.0] * (end - 3)
    assert traj.behaviour_logprobs[3] == 0.0 and traj.token_versions[3] == -1
    assert np.all(traj.behaviour_logprobs[:3] == np.float32(-0.25))
    context = [*traj.prompt_tokens.tolist(), *traj.response_tokens[:end].tolist()]
    assert engine.requests[1].prompt_tokens.tolist() == context  # turn 2 saw it as context
    # The learner's batch: position P - 1 + 3 predicts the closing token; no loss there.
    sample = trajectory_to_sample(traj)
    batch = pack_episode_batch([sample], [1.0])
    t = len(sample.prompt_tokens) - 1 + 3
    assert batch.target_ids_bt[0, t] == tok.eos_id
    assert batch.loss_mask_bt[0, t] == 0 and batch.behaviour_logp_bt[0, t] == 0
    assert batch.advantages_bt[0, t] == 0
    sampled = 3 + len(tok.encode("ok")) + 1  # turn 1's ids, turn 2's and its <|im_end|>
    assert batch.loss_mask_bt[0].sum() == sample.response_mask.sum() == sampled


def test_an_edited_echo_is_counted_and_the_recorded_ids_kept(tok, renderer):
    host = _host("edits_echo")
    engine = ScriptedEngine(tok, ["sampled text", "ok"])
    try:
        (traj,) = _play(host, renderer, engine, [0])
    finally:
        host.close()
    assert traj.end == EpisodeEnd.TERMINATED
    context = tok.decode(engine.requests[1].prompt_tokens.tolist())
    assert "sampled text" in context and "never sampled" not in context
    assert host.counts()["agent_echo_mismatch"] == 1


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        ("raises", "raised"),
        ("hangs", "timeout"),
        ("malformed", "malformed"),
        ("rewrites_history", "history_rewritten"),
        ("bad_return", "bad_return"),
    ],
)
def test_a_failing_agent_fails_its_episode_and_is_counted(tok, renderer, agent, reason):
    host = _host(agent, step_timeout_s=2.0)
    engine = ScriptedEngine(tok, ["a", "b", "c", "d"])
    try:
        (traj,) = _play(host, renderer, engine, [0])
    finally:
        host.close()
    assert traj.end == EpisodeEnd.ENV_FAILURE
    counts = host.counts()
    assert counts[f"agent_sessions_failed_{reason}"] == 1 == counts["agent_sessions_failed"]
    assert counts["agent_sessions_started"] == 1 and counts["agent_sessions_running"] == 0
    if agent == "malformed":
        # the session fails on the endpoint's side as it answers 400; the agent's thread
        # records the body it got a moment later
        deadline = time.monotonic() + 10.0
        while "malformed" not in scripted_agents.SEEN and time.monotonic() < deadline:
            time.sleep(0.01)
        (body,) = scripted_agents.SEEN["malformed"]
        assert body["param"] == "messages[0]" and body["type"] == "invalid_request_error"
        assert set(body) == {"message", "type", "param", "code"}


def test_the_endpoint_needs_the_key_and_refuses_a_non_loopback_address():
    table = SessionTable()
    with pytest.raises(ValueError, match="not a loopback"):
        AgentEndpoint(table, api_key="k", model_name="m", host="0.0.0.0")
    endpoint = AgentEndpoint(table, api_key="right", model_name="m").start()
    try:
        url = f"http://127.0.0.1:{endpoint.port}/v1"
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert info.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=url, api_key="right", max_retries=0)
        assert [m.id for m in good.models.list()] == ["m"]
        with pytest.raises(openai.NotFoundError) as info:
            good.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "x"}],
                extra_headers={"X-Jaxflash-Session": "nope"},
            )
        assert info.value.body["code"] == "session_not_found"
        # a port already taken is a clear error naming the setting, not a traceback
        taken = AgentEndpoint(table, api_key="k", model_name="m", port=endpoint.port)
        with pytest.raises(ValueError, match="env.options.port"):
            taken.start()
    finally:
        endpoint.close()
    # a wildcard host (allow_remote) hands agents an address they can connect to
    wildcard = AgentEndpoint(table, api_key="k", model_name="m", host="0.0.0.0", allow_remote=True)
    assert "0.0.0.0" not in wildcard.base_url("s1")
    assert set(FAILURES) >= {"raised", "timeout", "malformed"}
