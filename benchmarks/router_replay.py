"""MoE engine-vs-learner consistency with and without router replay (R3), on CPU.

    python benchmarks/router_replay.py                        # docs/model_families.md's rows
    python benchmarks/router_replay.py --dtype float32 --experts 8 --top-k 2

A random-init Qwen3-MoE-shaped decoder (``tiny_moe`` widened: ``--layers`` layers,
``--experts`` experts, top ``--top-k``, renormalised) samples ``--samples`` responses
with the slot loop's engine (prefill + cached decode, unrolled layers, the sampled
tokens' routes recorded); the learner's own forward (``learner.scoring.policy_logprobs``,
the stacked-layer scan over whole sequences) then scores the same tokens with
``learner.router_replay`` off and on. Printed per mode, over the response tokens (all
sampled by this version): the (token, layer) routing decisions whose expert set
differs between engine and learner (``router_mismatch_frac``), |log π − log μ| max and
mean, and the k3 estimate of KL(μ‖π). The model is random: this measures numerics,
not a trained router (real routers are more decisive, or less; Qwen3-30B-A3B's
weights are out of this machine's reach).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", help="param and compute dtype")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import jax
    import numpy as np

    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.generation.engine.state import EngineConfig
    from jaxflash.generation.slot_loop import run_requests
    from jaxflash.learner.batching import pack_batch
    from jaxflash.learner.config import LearnerConfig
    from jaxflash.learner.scoring import policy_logprobs
    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import init_params
    from jaxflash.types import GenerationRequest, SamplingParams

    mc = get_preset(
        "tiny_moe",
        n_layers=args.layers,
        n_experts=args.experts,
        n_experts_per_token=args.top_k,
        param_dtype=args.dtype,
        compute_dtype=args.dtype,
    )
    params = init_params(mc, seed=args.seed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    engine = LlamaEngine(
        mc,
        EngineConfig(
            max_concurrent_decodes=4, max_prefill_length=32, max_target_length=32 + args.new_tokens
        ),
    )
    rng = np.random.default_rng(args.seed)
    reqs = [
        GenerationRequest(
            prompt_id=i,
            sample_index=0,
            prompt_tokens=rng.integers(3, mc.vocab_size, int(rng.integers(8, 32))).astype(np.int32),
            sampling=sampling,
            seed=args.seed,
        )
        for i in range(args.samples)
    ]
    start = time.perf_counter()
    samples = run_requests(engine, params, reqs, policy_version=0, eos_id=-1)
    gen_s = time.perf_counter() - start
    batch = pack_batch(samples, np.zeros(len(samples)), length_multiple=16)
    fields = {k: v for k, v in vars(batch).items() if v is not None}
    mask = batch.loss_mask_bt > 0
    mu = batch.behaviour_logp_bt[mask]
    print(
        f"MoE {args.layers} layers, {args.experts} experts top-{args.top_k}, {args.dtype}; "
        f"{len(samples)} samples x {args.new_tokens} tokens ({gen_s:.1f} s to generate); "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'R3':>4} {'router_mismatch_frac':>21} {'on-policy':>10} {'gap max':>9} "
          f"{'gap mean':>9} {'k3 KL(mu||pi)':>14}")  # fmt: skip
    for replay in (False, True):
        lc = LearnerConfig(micro_batch_size=len(samples), router_replay=replay, sampling=sampling)

        @jax.jit
        def score(params, mb, lc=lc):
            logp, _, routing = policy_logprobs(params, mb, mc, lc)
            return logp, routing.mismatch_bt, routing.compared_bt

        logp, mismatch_bt, compared_bt = jax.device_get(score(params, fields))
        pi = np.asarray(logp)[mask]
        gap = np.abs(pi - mu)
        log_ratio = pi - mu  # k3 of KL(mu || pi): E_mu[r - 1 - log r], r = pi / mu
        k3 = float(np.mean(np.exp(log_ratio) - 1 - log_ratio))
        frac = float(mismatch_bt.sum() / max(compared_bt.sum(), 1))
        on = float(mismatch_bt[mask].sum() / max(compared_bt[mask].sum(), 1))
        print(
            f"{'on' if replay else 'off':>4} {frac:>21.4f} {on:>10.4f} {gap.max():>9.2e} "
            f"{gap.mean():>9.2e} {k3:>14.2e}"
        )


if __name__ == "__main__":
    main()
