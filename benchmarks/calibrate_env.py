"""Base success rate of SmolLM2-135M-Instruct (or Gemma 3 270M) on a text environment's
held-out seeds (mean@n).

    python benchmarks/calibrate_env.py --env frozenlake --seeds 50 --n 4 \
        --options '{"size": 3, "p_frozen": 0.8, "max_turns": 6}'
    python benchmarks/calibrate_env.py --env scienceworld --model gemma3 ...

Plays every held-out seed (the environment's ``split="eval"``) ``n`` times at the
training temperature with the real engine (``envs.calibration.calibrate_success``:
lockstep rounds of ``--batch`` episodes) and prints the success rate as the mean
over seeds of each seed's success share, with its standard error over seeds, plus
the invalid-action rate and turns per episode; for an environment that reports a
score (ScienceWorld's ``info["score"]``, 0-100), also the mean final score (clipped
at 0) with its standard error over seeds. ``--model gemma3`` plays Gemma 3 270M
with ``configs/agentic_scienceworld.GEMMA3_TEMPLATE`` (a base model). Used to pick an environment
setting whose base success lies between about 10 % and 60 % (room for RL to
show, and a learning signal in most groups).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="frozenlake")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    ap.add_argument("--options", default="{}", help="JSON fields of the environment's config")
    ap.add_argument("--seeds", type=int, default=50, help="held-out seeds 0..seeds-1")
    ap.add_argument("--n", type=int, default=4, help="episodes per seed")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max_context", type=int, default=1024, help="prompt + response tokens")
    ap.add_argument("--batch", type=int, default=32, help="episodes played in lockstep")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument(
        "--dump",
        default="",
        help="write every episode (messages, per-turn finish reason, tokens, reward, "
        "invalid flag) as JSON lines to this file",
    )
    ap.add_argument(
        "--show", action="store_true", help="print every episode's transcript as it ends"
    )
    args = ap.parse_args()

    from jaxflash.envs.calibration import calibrate_success
    from jaxflash.envs.chat import TurnRenderer
    from jaxflash.envs.registry import env_config, make_env
    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.generation.slot_loop import run_requests
    from jaxflash.models.formats.weights_gguf import gemma3_gguf_path, load_gguf, smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer
    from jaxflash.types import SamplingParams

    options = {**json.loads(args.options), "split": "eval"}
    limits = env_config(args.env, **options)
    if args.model == "gemma3":
        from configs.agentic_scienceworld import GEMMA3_TEMPLATE, STOP_IDS

        path = gemma3_gguf_path()
        tokenizer = Tokenizer.from_gguf(path).with_chat_template(
            GEMMA3_TEMPLATE, extra_stops=[("model.extra_stop_ids", STOP_IDS)]
        )
    else:
        path = smollm2_gguf_path()
        tokenizer = Tokenizer.from_gguf(path)
    config, params = load_gguf(path)
    renderer = TurnRenderer(tokenizer)
    sampling = SamplingParams(
        temperature=args.temperature, max_new_tokens=limits.max_tokens_per_turn
    )
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=args.slots,
            max_prefill_length=args.max_context - 1,
            max_target_length=args.max_context,
            temperature=args.temperature,
        ),
    )

    def generate(requests):
        return run_requests(
            engine, params, list(requests), policy_version=0, stop_ids=tokenizer.stop_ids
        )

    dump = open(args.dump, "w") if args.dump else None  # noqa: SIM115 (closed below)
    scores: dict[int, list[float]] = {}  # seed -> final scores of its counted episodes

    def on_trajectory(traj) -> None:
        if str(traj.end) != "env_failure" and traj.turns and "score" in traj.turns[-1].info:
            scores.setdefault(traj.env_seed, []).append(max(traj.turns[-1].info["score"], 0))
        record = {
            "seed": traj.env_seed,
            "episode": traj.episode_index,
            "end": str(traj.end),
            "success": traj.success,
            "messages": list(traj.messages),
            "turns": [
                {
                    "finish": str(t.finish_reason),
                    "tokens": t.num_sampled,
                    "reward": t.reward,
                    "invalid": t.invalid_action,
                    "action": t.info.get("action"),
                }
                for t in traj.turns
            ],
        }
        if dump is not None:
            dump.write(json.dumps(record) + "\n")
            dump.flush()
        if args.show:
            print(
                f"=== seed {traj.env_seed} episode {traj.episode_index}: {traj.end}, "
                f"success {traj.success}"
            )
            for m in traj.messages:
                print(f"--- {m['role']}:\n{m['content']}")
            for t in record["turns"]:
                print(f"    turn: {t}")

    t0 = time.monotonic()
    res = calibrate_success(
        lambda: make_env(args.env, **options),
        renderer,
        generate,
        seeds=list(range(args.seeds)),
        n=args.n,
        sampling=sampling,
        max_context_tokens=args.max_context,
        episodes_per_batch=args.batch,
        sampling_seed=args.seed,
        on_trajectory=on_trajectory,
    )
    if dump is not None:
        dump.close()
    elapsed = time.monotonic() - t0
    print(
        f"env {args.env} {options} ({limits}); {args.seeds} held-out seeds x n={args.n}, "
        f"T={args.temperature}"
    )
    if scores:
        per_seed = np.array([np.mean(v) for v in scores.values()])
        stderr = per_seed.std(ddof=1) / np.sqrt(len(per_seed)) if len(per_seed) > 1 else np.nan
        print(f"final score mean@{args.n} = {per_seed.mean():.1f} +- {stderr:.1f} (of 100)")
    print(
        f"model {args.model}; success mean@{args.n} = {res.success_mean:.3f} +- "
        f"{res.success_stderr:.3f} "
        f"(stderr over {len(res.seeds)} seeds); invalid-action rate "
        f"{res.invalid_action_rate:.3f}; turns/episode {res.mean_turns:.2f}; env failures "
        f"{res.env_failures}; {elapsed:.0f} s (load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
