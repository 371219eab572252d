"""SmolLM2-135M-Instruct's base pass@1 on HumanEval (programs graded in the sandbox).

    python benchmarks/calibrate_humaneval.py --prompts 164 --n 1 --temperature 0.2

pass@1 is estimated as mean@n: the mean over problems of the per-problem share of
samples that pass every test (``reward.fn=code``, the ``correct`` component), with
its standard error over problems; also the mean fraction of tests passed. Problems
are the first ``--prompts`` in task-id order, rendered with the training prompt
(``data.code_tasks.HUMANEVAL_TEMPLATE``) and the model's chat template. The
sampler needs T > 0; pass@1 is customarily reported at T = 0.2 (or greedy).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=164)
    ap.add_argument("--n", type=int, default=1, help="samples per problem")
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--max_new_tokens", type=int, default=384)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import numpy as np

    from jaxflash.data.code_tasks import humaneval_rows
    from jaxflash.data.prompts import PromptFailure, PromptSource
    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer
    from jaxflash.rewards.code_reward import CodeReward
    from jaxflash.runtime.fleet.eval_generation import EngineGenerate
    from jaxflash.runtime.rollout.reward_pool import RewardPool
    from jaxflash.runtime.workloads.evaluation import evaluate
    from jaxflash.types import SamplingParams

    path = smollm2_gguf_path()
    config, params = load_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    rows = humaneval_rows()[: args.prompts]
    prefill = 1024
    prompts = [
        p
        for p in PromptSource(rows, tokenizer, max_prompt_tokens=prefill)
        if not isinstance(p, PromptFailure)
    ]
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=args.slots,
            max_prefill_length=prefill,
            max_target_length=prefill + args.max_new_tokens,
            temperature=args.temperature,
        ),
    )
    reward = CodeReward()
    print(reward.sandbox().check().line)
    seen: list = []

    class Recording(RewardPool):  # keeps every result for the tests-passed mean
        def submit(self, item):
            future = super().submit(item)
            seen.append(future)
            return future

    t0 = time.monotonic()
    with Recording(reward, num_workers=2, timeout_s=10.0) as pool:
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
    results = [f.result().result for f in seen]
    outcomes = collections.Counter(
        k.removeprefix("outcome/")
        for r in results
        for k in r.components
        if k.startswith("outcome/")
    )
    found = np.mean([r.components.get("program_found", 0.0) for r in results])
    print(
        f"HumanEval: {len(prompts)} problems (first {args.prompts} by task id), n={args.n}, "
        f"T={args.temperature}, max_new_tokens={args.max_new_tokens}"
    )
    print(
        f"pass@1 (mean@{args.n}) = {out['eval_accuracy']:.3f} +- "
        f"{out['eval_accuracy_stderr']:.3f} (stderr over problems); mean tests passed "
        f"{np.mean([r.score for r in results]):.3f}; fenced block found {found:.2f}; "
        f"outcomes {dict(outcomes)}; failed={out['eval_failed']}; {elapsed:.0f} s "
        f"(load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
