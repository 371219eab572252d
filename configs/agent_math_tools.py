"""Bring your own agent: GRPO on SmolLM2-135M-Instruct through the OpenAI-compatible
endpoint, with a tool-calling math agent written against the stock ``openai`` client.

The agent (``examples/agents/math_tools.py``) is an ordinary ``openai.OpenAI`` loop: it
sends the question and a ``python`` tool, runs each tool call in jaxflash's bubblewrap
sandbox (docs/SANDBOX.md), sends the result back as a ``tool`` message, and returns
reward 1.0 for the right integer. jaxflash runs ``group_size`` sessions per task at once
(each its own episode; environment-level async, staleness bound, redundancy, restarts
as for the built-in environments), records the exact ids the engine sampled per turn
and trains on them (docs/AGENTS.md).

Asynchronous on disjoint slices (learner 1 CPU device + 2 generation slices, alpha 1):

    python launch/tpu_pod.py --config configs/agent_math_tools.py --workdir runs/agent_math \
        --config.mesh.colocated=False --config.rollout.async_ratio=1

Synchronous colocated baseline: drop the two overrides. The tiny random model:
``configs/agent_smoke.py``.
"""

import json

import ml_collections

from configs import default

AGENT_OPTIONS = {
    "agent": "examples.agents.math_tools:solve",
    "tasks": "examples.agents.math_tools:tasks",
    "max_turns": 4,  # requests per session (the agent stops after 3 tool rounds)
    "max_tokens_per_turn": 128,
    "step_timeout_s": 120.0,  # the agent's time between a reply and its next request
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    colocated = c.mesh.get_ref("colocated")
    c.mesh.num_cpu_devices = 3 - colocated.to_int()
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 1 + colocated.to_int(), "tensor": 1})
    c.mesh.num_generation_slices = 2 - colocated.to_int()

    c.env.name = "agent"
    c.env.options = json.dumps(AGENT_OPTIONS)
    # default max_context_tokens (1024) holds system + Hermes tool preamble + question
    # (~230 tokens) + 4 x (128 + tool result); group_size 4 sessions per task (default).
    c.env.eval_seeds = 8

    c.rollout.prompts_per_step = 4  # tasks per learner step
    c.rollout.temperature = 0.7
    c.rollout.num_slots = 16
    c.rollout.truncation = "none"
    c.rollout.sample_deadline_s = 900.0

    c.learner.lr = 2e-6
    c.learner.micro_batch_size = 4
    c.learner.loss_kwargs = ml_collections.ConfigDict({"clip_eps_low": 0.2, "clip_eps_high": 0.28})

    c.eval.every = 10
    c.eval.temperature = 0.7
    return c
