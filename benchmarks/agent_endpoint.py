"""The agent endpoint's cost: per-request overhead against the in-process path, and
tokens/s with many concurrent sessions (docs/AGENTS.md). Side by side in one run.

Both paths play the same episodes (``turns`` turns each, ``sessions`` at once) through
the same lockstep driver (``envs.driver.run_episodes``) and the same generate function:

* in-process: a built-in-style ``TextEnv`` answering each turn with a fixed message
  (the path of jaxflash's own environments: no HTTP, no thread handoff);
* endpoint: an agent over the stock ``openai`` client sending the same message through
  the endpoint (``runtime.agents``: HTTP + JSON + the session's thread handoff).

``--engine scripted``: an instant generate (fixed 16-token replies): the difference per
turn is the endpoint's overhead. ``--engine tiny``: the tiny random-init model on the
slot loop (real prefill/decode of the growing context): tokens/s of both paths.

    python benchmarks/agent_endpoint.py --engine scripted --sessions 1 8 32 --turns 4
    python benchmarks/agent_endpoint.py --engine tiny --sessions 8 32 --turns 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MESSAGE = "the tool printed 42"


def fixed_agent(client, task) -> float:
    """The endpoint side: ``turns`` requests, each adding MESSAGE."""
    messages = [{"role": "user", "content": f"task {task.seed}"}]
    for _ in range(int(task.data["turns"])):
        reply = client.chat.completions.create(model=task.model, messages=messages)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": MESSAGE})
    return 0.0


def tasks(seed: int, split: str) -> dict:
    return {"turns": int(os.environ.get("AGENT_BENCH_TURNS", "4"))}


class FixedEnv:
    """The in-process side: MESSAGE after every turn, ``turns`` turns."""

    def __init__(self, config) -> None:
        self.config, self.t = config, 0

    def reset(self, seed: int) -> str:
        self.t = 0
        return f"task {seed}"

    def step(self, action_text: str):
        from jaxflash.envs.base import StepResult  # noqa: PLC0415

        self.t += 1
        return StepResult(MESSAGE, 0.0, self.t >= self.config.max_turns, False, {})

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("scripted", "tiny"), default="scripted")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per turn")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ["AGENT_BENCH_TURNS"] = str(args.turns)

    import numpy as np  # noqa: PLC0415

    from jaxflash.envs.agent_contract import AgentConfig  # noqa: PLC0415
    from jaxflash.envs.base import EnvConfig  # noqa: PLC0415
    from jaxflash.envs.chat import TurnRenderer, renderer_for  # noqa: PLC0415
    from jaxflash.envs.driver import run_episodes  # noqa: PLC0415
    from jaxflash.envs.episode import Episode  # noqa: PLC0415
    from jaxflash.models.formats.weights_gguf import smollm2_gguf_path  # noqa: PLC0415
    from jaxflash.models.text.tokenizer import Tokenizer  # noqa: PLC0415
    from jaxflash.runtime.agents.host import AgentHost  # noqa: PLC0415
    from jaxflash.types import FinishReason, Sample, SamplingParams  # noqa: PLC0415

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    renderer = TurnRenderer(tok)
    context = 64 + args.turns * (args.tokens + 32)
    sampling = SamplingParams(max_new_tokens=args.tokens)
    if args.engine == "scripted":
        reply = np.asarray([*tok.encode("x" * (args.tokens - 1))[: args.tokens - 1], 2], np.int32)

        def generate(requests):
            return [
                Sample(
                    prompt_id=r.prompt_id,
                    sample_index=r.sample_index,
                    prompt_tokens=r.prompt_tokens,
                    response_tokens=reply,
                    behaviour_logprobs=np.zeros(reply.shape, np.float32),
                    token_versions=np.zeros(reply.shape, np.int32),
                    start_version=0,
                    finish_reason=FinishReason.EOS,
                )  # fmt: skip
                for r in requests
            ]
    else:
        from jaxflash.generation.engine.llama_engine import LlamaEngine  # noqa: PLC0415
        from jaxflash.generation.engine.state import EngineConfig  # noqa: PLC0415
        from jaxflash.generation.slot_loop import run_requests  # noqa: PLC0415
        from jaxflash.models.config.presets import get_preset  # noqa: PLC0415
        from jaxflash.models.decoder.transformer import init_params  # noqa: PLC0415

        config = get_preset("tiny", vocab_size=tok.vocab_size, max_seq_len=context)
        params = init_params(config, seed=0)
        engine = LlamaEngine(
            config,
            EngineConfig(
                max_concurrent_decodes=max(args.sessions), max_prefill_length=context - 1,
                max_target_length=context, temperature=1.0,
            ),
        )  # fmt: skip

        def generate(requests):
            out = run_requests(
                engine, params, list(requests), policy_version=0, stop_ids=frozenset()
            )  # fmt: skip  (every turn: full budget)
            return out

    limits = EnvConfig(max_turns=args.turns, max_tokens_per_turn=args.tokens, step_timeout_s=60.0)
    host = AgentHost(
        AgentConfig(
            agent="__main__:fixed_agent", tasks="__main__:tasks",
            max_turns=args.turns + 1, max_tokens_per_turn=args.tokens, step_timeout_s=60.0,
        )
    )  # fmt: skip

    def play(kind: str, k: int) -> tuple[float, int]:
        envs = [FixedEnv(limits) if kind == "in-process" else host.make_env() for _ in range(k)]
        episodes = [
            Episode(
                renderer_for(env, renderer),
                env.config,
                prompt_id=i,
                episode_index=0,
                env_seed=i,
                start_version=0,
                max_context_tokens=context,
            )  # fmt: skip
            for i, env in enumerate(envs)
        ]
        start = time.perf_counter()
        trajs = run_episodes(envs, episodes, generate, sampling)
        elapsed = time.perf_counter() - start
        for env in envs:
            env.close()
        sampled = sum(int(t.loss_mask.sum()) for t in trajs)
        turns = sum(len(t.turns) for t in trajs)
        assert turns == k * args.turns, (kind, turns, [t.end for t in trajs])
        return elapsed, sampled

    play("in-process", 2)  # warm-up: compiles, first HTTP connection
    play("endpoint", 2)
    rows = []
    for k in args.sessions:
        best = {}
        for kind in ("in-process", "endpoint") * args.repeats:  # alternating, best of each
            elapsed, sampled = play(kind, k)
            if kind not in best or elapsed < best[kind][0]:
                best[kind] = (elapsed, sampled)
        (t_in, n_in), (t_ep, n_ep) = best["in-process"], best["endpoint"]
        requests = k * args.turns
        row = {
            "engine": args.engine, "sessions": k, "turns": args.turns,
            "in_process_s": round(t_in, 4), "endpoint_s": round(t_ep, 4),
            "overhead_ms_per_request": round(1e3 * (t_ep - t_in) / requests, 3),
            "in_process_tokens_per_s": round(n_in / t_in, 1),
            "endpoint_tokens_per_s": round(n_ep / t_ep, 1),
            "endpoint_over_in_process": round(t_ep / t_in, 3),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    host.close()
    print("load average:", os.getloadavg())


if __name__ == "__main__":
    main()
