"""Base-model accuracy on the arithmetic task at the training temperature (mean@n).

    python benchmarks/calibrate_arith.py --prompts 200 --n 4 --max_digits 1
    python benchmarks/calibrate_arith.py --model gemma3 --ops +- --max_digits 2 --max_new_tokens 12

``--model gemma3``: Gemma 3 270M (base) with configs/rlvr_gemma3_arith.py's plain
prompt format and newline stops.

Prints accuracy as mean over prompts of the per-prompt mean correctness, with its
standard error over prompts, for held-out (eval split) prompts. The task's
difficulty knobs are chosen so SmolLM2-135M-Instruct lands between ~10 % and 60 %.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--min_operands", type=int, default=2)
    ap.add_argument("--max_operands", type=int, default=2)
    ap.add_argument("--min_digits", type=int, default=1)
    ap.add_argument("--max_digits", type=int, default=1)
    ap.add_argument("--ops", default="+-*")
    ap.add_argument("--max_new_tokens", type=int, default=24)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    args = ap.parse_args()

    from jaxflash.data.arithmetic import ArithmeticTask
    from jaxflash.data.prompts import PromptFailure, PromptSource
    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer
    from jaxflash.rewards.base import combined
    from jaxflash.runtime.fleet.eval_generation import EngineGenerate
    from jaxflash.runtime.rollout.reward_pool import RewardPool
    from jaxflash.runtime.workloads.evaluation import evaluate
    from jaxflash.types import SamplingParams

    if args.model == "gemma3":
        from configs.rlvr_gemma3_arith import NEWLINE_IDS, PLAIN_TEMPLATE
        from jaxflash.models.formats.weights_gguf import gemma3_gguf_path

        path = gemma3_gguf_path()
        tokenizer = Tokenizer.from_gguf(path).with_chat_template(
            PLAIN_TEMPLATE, extra_stops=[("model.extra_stop_ids", NEWLINE_IDS)]
        )
    else:
        path = smollm2_gguf_path()
        tokenizer = Tokenizer.from_gguf(path)
    config, params = load_gguf(path)
    task = ArithmeticTask(
        args.seed,
        split="eval",
        min_operands=args.min_operands,
        max_operands=args.max_operands,
        min_digits=args.min_digits,
        max_digits=args.max_digits,
        ops=args.ops,
    )
    rows = task.rows(0, args.prompts)
    distinct = len({r["prompt"] for r in rows})
    prompts = [
        p
        for p in PromptSource(rows, tokenizer, max_prompt_tokens=64)
        if not isinstance(p, PromptFailure)
    ]
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=args.slots,
            max_prefill_length=64,
            max_target_length=64 + args.max_new_tokens,
            temperature=args.temperature,
        ),
    )
    t0 = time.monotonic()
    with RewardPool(combined({"math": 1.0}), num_workers=2, timeout_s=10.0) as pool:
        out = evaluate(
            EngineGenerate(engine, params, tokenizer.stop_ids),
            prompts,
            samples_per_prompt=args.n,
            sampling=sampling,
            seed=args.seed,
            policy_version=0,
            tokenizer=tokenizer,
            reward_pool=pool,
        )
    elapsed = time.monotonic() - t0
    print(
        f"task: operands {args.min_operands}-{args.max_operands}, digits "
        f"{args.min_digits}-{args.max_digits}, ops {args.ops!r}; {len(prompts)} held-out prompts "
        f"({distinct} distinct), n={args.n}, T={args.temperature}"
    )
    print(
        f"accuracy mean@{args.n} = {out['eval_accuracy']:.3f} +- "
        f"{out['eval_accuracy_stderr']:.3f} (stderr over prompts); failed={out['eval_failed']}; "
        f"{elapsed:.0f} s (load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
