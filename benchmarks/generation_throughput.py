"""Rollout throughput of the slot loop with and without prefix sharing, side by side.

    python benchmarks/generation_throughput.py --prompts 8 --group 4 --reps 2

Loads SmolLM2-135M-Instruct (GGUF), builds P arithmetic prompts x G samples (prompt
replication, as in GRPO), and runs them through ``run_requests`` with
``share_prefix`` off and on, alternating (off, on, off, on, ...) after one warm-up
of each so compilation is excluded and machine noise hits both alike. Prints per
run: generated tokens/s (over ``step`` time), prompt prefills, slot occupancy;
then the median speed-up ratio, and checks that both modes gave bit-identical
tokens and logprobs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="P distinct prompts")
    ap.add_argument("--group", type=int, default=4, help="G samples per prompt")
    ap.add_argument("--max_new_tokens", type=int, default=24)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2, help="timed runs per mode")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import numpy as np

    from jaxflash.data.arithmetic import ArithmeticTask
    from jaxflash.data.prompts import PromptFailure, PromptSource
    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.generation.slot_loop import run_requests
    from jaxflash.generation.slot_types import SlotStats
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer
    from jaxflash.types import GenerationRequest, SamplingParams

    path = smollm2_gguf_path()
    config, host_params = load_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    rows = ArithmeticTask(args.seed, split="eval").rows(0, args.prompts)
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
    params = engine.place_params(host_params)
    requests = [
        GenerationRequest(
            prompt_id=p.prompt_id,
            sample_index=g,
            prompt_tokens=p.prompt_tokens,
            sampling=sampling,
            seed=args.seed,
        )
        for p in prompts
        for g in range(args.group)
    ]
    lengths = sorted({len(p.prompt_tokens) for p in prompts})
    print(
        f"SmolLM2-135M, {len(prompts)} prompts x G={args.group} = {len(requests)} requests, "
        f"prompt lengths {lengths[0]}-{lengths[-1]} tokens (bucket "
        f"{engine.prefiller.prefill_bucket(lengths[-1])}), max_new_tokens {args.max_new_tokens}, "
        f"{args.slots} slots, T={args.temperature}"
    )

    def run(share: bool) -> tuple[SlotStats, float, list]:
        stats = SlotStats()
        t0 = time.perf_counter()
        samples = run_requests(
            engine,
            params,
            requests,
            policy_version=0,
            stop_ids=tokenizer.stop_ids,
            stats=stats,
            share_prefix=share,
        )
        return stats, time.perf_counter() - t0, samples

    for share in (False, True):  # warm-up: compile every shape both modes use
        run(share)
    rates: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list] = {}
    for rep in range(args.reps):
        for share in (False, True):
            stats, wall, samples = run(share)
            outputs[share] = samples
            rates[share].append(stats.tokens_per_s)
            print(
                f"rep {rep} share_prefix={share!s:5}: {stats.generated_tokens} tokens, "
                f"{stats.tokens_per_s:6.1f} tok/s ({wall:.1f} s wall), prefills "
                f"{stats.prefills} (+{stats.shared_prefills} shared), decode steps "
                f"{stats.steps}, occupancy {stats.occupancy:.2f}"
            )
    same = all(
        a.response_tokens.tobytes() == b.response_tokens.tobytes()
        and a.behaviour_logprobs.tobytes() == b.behaviour_logprobs.tobytes()
        for a, b in zip(outputs[False], outputs[True], strict=True)
    )
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(
        f"median tok/s: off {off:.1f}, on {on:.1f}; speed-up x{on / off:.2f} "
        f"(side by side on a shared, noisy machine); bit-identical outputs: {same}; "
        f"load average (1, 5, 15 min) {os.getloadavg()}"
    )
    np.testing.assert_equal(same, True)


if __name__ == "__main__":
    main()
