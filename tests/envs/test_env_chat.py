"""``envs.chat.TurnRenderer`` on every chat-template family the project ships: three
turns played token in / token out (the trajectory is the first prompt, the sampled
ids and the deltas of the new messages, earlier turns never re-rendered), Qwen3 with
thinking on and off, and templates that cannot be extended turn by turn refused at
start-up in one line naming the model."""

from __future__ import annotations

import pytest

from jaxflash.envs.base import (
    EnvConfig,
    EnvFailureReason,
    StepResult,
    checked_reset,
    checked_step,
)
from jaxflash.envs.chat import TurnRenderer
from jaxflash.envs.episode import Episode, EpisodeEnd
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.types import SamplingParams
from tests.chat_fixtures import NAMES, build_checkpoint
from tests.envs_fixtures import chatml_tokenizer, text_sample

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64)
THINKING_OFF = {"enable_thinking": False}
# meta-llama/Llama-2-7b-chat-hf's template (no fixture of its own: over Mistral's vocabulary).
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
FAMILIES = [pytest.param(name, {}, None, id=name) for name in NAMES]
FAMILIES.append(pytest.param("qwen3", THINKING_OFF, None, id="qwen3-thinking-off"))
FAMILIES.append(pytest.param("mistral", {}, LLAMA2, id="llama2"))
# A template that numbers its turns: the delta of a message depends on the turns before it.
NUMBERED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + loop.index|string + '\n' + "
    "m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_models")
    return {name: build_checkpoint(name, root) for name in NAMES}


def tokenizer(checkpoints, name: str, template_kwargs: dict, template=None) -> Tokenizer:
    tok = Tokenizer.from_hf_dir(checkpoints[name])
    return tok.with_chat_template(template or tok.chat_template, template_kwargs=template_kwargs)


class ReplyEnv:
    """Answers turn t with observation "o<t>"; never ends on its own (max_turns does)."""

    def __init__(self, max_turns: int = 3):
        self.config = EnvConfig(max_turns=max_turns, max_tokens_per_turn=64)
        self.actions: list[str] = []

    def reset(self, seed):
        return "start"

    def step(self, action_text):
        self.actions.append(action_text)
        return StepResult(f"o{len(self.actions)}", 1.0, False, False, {})

    def close(self):
        pass


def play(tok, replies, *, system_prompt=None, env=None):
    """Three turns with the given reply texts; returns (trajectory, first prompt, samples)."""
    env = env or ReplyEnv(len(replies))
    renderer = TurnRenderer(tok, system_prompt=system_prompt)
    ep = Episode(
        renderer, env.config, prompt_id=1, episode_index=0, env_seed=0, start_version=0,
        max_context_tokens=4096,
    )  # fmt: skip
    ep.begin(checked_reset(env, 0))
    first, samples = ep.context().tolist(), []
    for reply in replies:
        if ep.done:
            break
        samples.append(text_sample(tok, ep.next_request(SAMPLING), reply, end_id=renderer.eot_id))
        ep.record_step(checked_step(env, ep.record_turn(samples[-1])))
    return ep.trajectory(), first, samples


@pytest.mark.parametrize(("name", "kwargs", "template"), FAMILIES)
@pytest.mark.parametrize("system_prompt", [None, "Be brief."], ids=["bare", "system"])
def test_three_turns_are_prompt_plus_sampled_plus_message_deltas(
    checkpoints, name, kwargs, template, system_prompt
):
    """Every family: the context is exactly first prompt + s1 + d1 + s2 + d2 + s3, where
    d_t is what the template renders after the t-th reply of the *real* transcript
    (closing glue less the sampled end-of-turn token, the observation, the generation
    prompt), and the loss mask is 1 on the sampled ids only."""
    tok = tokenizer(checkpoints, name, kwargs, template)
    if name == "gemma" and system_prompt:  # Gemma 2's template raises on a system message
        with pytest.raises(ValueError, match="System role not supported"):
            TurnRenderer(tok, system_prompt=system_prompt)
        return
    replies = ["Hi!", "<answer>Up</answer>", "fine"]
    traj, first, samples = play(tok, replies, system_prompt=system_prompt)
    assert traj.end is EpisodeEnd.MAX_TURNS and len(traj.turns) == 3
    eot_text = tok.decode([samples[0].response_tokens[-1]])
    head = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages, want = [*head, {"role": "user", "content": "start"}], list(first)
    assert first == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    for t, (reply, sample) in enumerate(zip(replies, samples, strict=True), start=1):
        want += sample.response_tokens.tolist()
        if t == 3:
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"o{t}"}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        # Llama 2 writes " </s>": the sampled </s> stands for the space before it too.
        delta = text[text.rfind(reply) + len(reply) :].lstrip()
        assert delta.startswith(eot_text), (name, delta)
        want += tok.encode(delta[len(eot_text) :])
    got = traj.prompt_tokens.tolist() + traj.response_tokens.tolist()
    assert got == want
    sampled = [t for s in samples for t in s.response_tokens.tolist()]
    mask = traj.loss_mask.tolist()
    assert [t for t, m in zip(traj.response_tokens.tolist(), mask, strict=True) if m] == sampled
    assert [a for a in (m["content"] for m in traj.messages if m["role"] == "assistant")] == replies


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking_on", "thinking_off"])
def test_qwen3_keeps_each_turns_reasoning_as_sampled(checkpoints, thinking):
    """Qwen3's template drops an assistant turn's <think> block once a user message
    follows; the context keeps every turn's reasoning exactly as sampled, and each
    delta (hand-written here) carries the generation prompt of the mode."""
    tok = tokenizer(checkpoints, "qwen3", {} if thinking else THINKING_OFF)
    gen = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    replies = [f"<think>\nr{t}\n</think>\n\nA{t}" if thinking else f"A{t}" for t in (1, 2, 3)]
    env = ReplyEnv(3)
    traj, first, samples = play(tok, replies, env=env)
    assert len(traj.turns) == 3 and traj.end is EpisodeEnd.MAX_TURNS
    assert env.actions == replies  # the environment parses the whole turn, reasoning too
    prompt = "<|im_start|>user\nstart<|im_end|>\n" + gen
    deltas = [f"\n<|im_start|>user\no{t}<|im_end|>\n" + gen for t in (1, 2)]
    assert first == tok.encode(prompt)
    s = [x.response_tokens.tolist() for x in samples]
    want = tok.encode(prompt) + s[0] + tok.encode(deltas[0]) + s[1] + tok.encode(deltas[1]) + s[2]
    assert traj.prompt_tokens.tolist() + traj.response_tokens.tolist() == want
    text = prompt + "<|im_end|>".join([replies[0], deltas[0] + replies[1], deltas[1] + replies[2]])
    assert tok.decode(want) == text + "<|im_end|>"
    assert int(traj.loss_mask.sum()) == sum(map(len, s))


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking_on", "thinking_off"])
def test_qwen3_tool_message_delta(checkpoints, thinking):
    """A tool result (the tool-use environment's role) after a Qwen3 turn, hand-written."""
    renderer = TurnRenderer(tokenizer(checkpoints, "qwen3", {} if thinking else THINKING_OFF))
    gen = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    want = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    assert renderer.message_delta_text("5", role="tool") == want + gen


def test_a_template_whose_delta_depends_on_earlier_turns_is_refused():
    tok = chatml_tokenizer().with_chat_template(NUMBERED)
    with pytest.raises(ValueError, match="after two exchanges than after one") as err:
        TurnRenderer(tok)
    assert "\n" not in str(err.value)


def test_agentic_startup_refuses_such_a_template_in_one_line_naming_the_model(checkpoints):
    from configs import agentic_smoke  # noqa: PLC0415
    from jaxflash.runtime.config.experiment import ConfigError  # noqa: PLC0415
    from jaxflash.runtime.workloads.agentic import EpisodeRollout  # noqa: PLC0415
    from tests.runtime.workloads.test_agentic_run import _exp  # noqa: PLC0415

    exp = _exp(agentic_smoke)  # a random-init "tiny" model
    tok = Tokenizer.from_hf_dir(checkpoints["qwen3"]).with_chat_template(NUMBERED)
    with pytest.raises(ConfigError, match="after two exchanges") as err:
        EpisodeRollout(
            exp.env,
            tok,
            rollout=exp.rollout,
            eval=exp.eval,
            advantage=exp.advantage,
            seed=exp.seed,
            model=exp.model,
        )
    assert str(err.value).startswith("model random-init preset tiny: ")
    assert "\n" not in str(err.value)


def test_a_message_the_template_rejects_fails_the_episode_not_the_run():
    """A template that raises on the environment's message role: the episode ends as an
    environment failure (bad_observation, counted by the runtime), no exception escapes."""
    chatml = chatml_tokenizer()
    template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tool role') }}{% endif %}{% endfor %}" + chatml.chat_template
    )
    tok = chatml.with_chat_template(template)

    class ToolEnv(ReplyEnv):
        def step(self, action_text):
            return StepResult("out", 0.0, False, False, {"role": "tool"})

    traj, _, samples = play(tok, ["Hi!", "again"], env=ToolEnv(3))
    assert traj.end is EpisodeEnd.ENV_FAILURE and len(traj.turns) == len(samples) == 1
    assert traj.failure.reason is EnvFailureReason.BAD_OBSERVATION
    assert traj.failure.phase == "step" and "no tool role" in traj.failure.detail
