"""Where the bf16 default-mode engine–learner gap comes from: one cause toggled at a time.

    python benchmarks/bf16_gap.py                 # SmolLM2-135M and Gemma 3 270M (real weights)
    python benchmarks/bf16_gap.py --model smollm2 --prompts 4 --new 16

The engine (4 slots, temperature 1, no top-k / top-p) samples ``--prompts`` responses
in bf16 compute over fp32 master weights; then the same tokens are scored several ways
and each row prints mean / max |log π − log μ| over the response tokens against the
engine's recorded μ (``behaviour_logprobs``):

- ``learner``: the learner's forward (``transformer.forward``, stacked params in the
  ``lax.scan``, cache-free ``self_attention``: blockwise on CPU) and ``target_logprobs``
  — what the train step scores.
- ``learner, dense attention``: the same with ``attention="dense"`` (the engine's
  ``dense_attention`` formula over [T, T] scores).
- ``learner, K/V not rounded``: the learner's attention reads float32 k/v instead of
  the compute dtype the engine's KV cache stores (what it would cost if the learner did
  not round K/V like the cache).
- ``engine-shaped prefill``: the engine's own forward (unstacked params, a dense
  ``LayerKVCache``, ``dense_attention`` over the cache) run once over the whole sequence,
  [1, T] matmuls instead of the decode's [B, 1]: the gap to the engine that is left is
  the matmul / reduction shapes alone.
- ``fp32 learner``: the same tokens scored in float32 (the bf16 rounding as such).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from consistency import requests  # noqa: E402

from jaxflash.generation.engine.llama_engine import LlamaEngine  # noqa: E402
from jaxflash.generation.engine.state import EngineConfig  # noqa: E402
from jaxflash.generation.slot_loop import run_requests  # noqa: E402
from jaxflash.models.caches import attention, cache_face  # noqa: E402
from jaxflash.models.caches.kv_cache import init_layer_kv_cache  # noqa: E402
from jaxflash.models.decoder.logprobs import target_logprobs  # noqa: E402
from jaxflash.models.decoder.transformer import forward, unembed, unstack_layers  # noqa: E402


def load(model: str):
    from jaxflash.models.formats import weights_gguf

    path = weights_gguf.smollm2_gguf_path() if model == "smollm2" else None
    config, params = weights_gguf.load_gguf(path or weights_gguf.gemma3_gguf_path())
    return config.replace(max_seq_len=max(config.max_seq_len, 128)), params


def engine_samples(config, params, prompts: int, new: int):
    ec = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_target_length=64)
    engine = LlamaEngine(config, ec)
    reqs = requests(config.valid_vocab_size or config.vocab_size, prompts, new, sampling={})
    return run_requests(engine, engine.place_params(params), reqs, policy_version=0, eos_id=-1)


def score(config, params, samples, *, engine_shaped: bool = False) -> list[np.ndarray]:
    """log π of every sample's response tokens, one sequence at a time."""
    p_unstacked = unstack_layers(params) if engine_shaped else None

    @jax.jit
    def logp(params, ids_bt):
        pos_bt = jnp.arange(ids_bt.shape[1])[None]
        if engine_shaped:
            cache = init_layer_kv_cache(config, 1, ids_bt.shape[1])
            h, _ = forward(p_unstacked, config, ids_bt, pos_bt, cache)
        else:
            h, _ = forward(params, config, ids_bt, pos_bt)
        targets = jnp.concatenate([ids_bt[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)
        return target_logprobs(
            h, unembed(params, config), targets, chunk=16,
            valid_vocab_size=config.valid_vocab_size,
        )[0]  # fmt: skip

    out = []
    for s in samples:
        ids = np.concatenate([s.prompt_tokens, s.response_tokens])[None].astype(np.int32)
        p = len(s.prompt_tokens)
        out.append(
            np.asarray(logp(params, jnp.asarray(ids)))[0, p - 1 : p - 1 + len(s.response_tokens)]
        )
    return out


def gap(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, float]:
    d = np.abs(np.concatenate(a) - np.concatenate(b))
    return float(d.mean()), float(d.max())


def old_dense_attention(q_btnh, k_bksh, v_bkhs, visible_bts, config):
    """``dense_attention`` before this benchmark's fix: softmax normalised in float32,
    then rounded to the compute dtype, products rounded to it."""
    b, t, n, h = q_btnh.shape
    cd = config.jnp_compute_dtype
    q_btkgh = q_btnh.reshape(b, t, config.n_kv_heads, config.group_size, h).astype(cd)
    scores_bkgts = jnp.einsum(
        "btkgh,bksh->bkgts", q_btkgh, k_bksh.astype(cd), preferred_element_type=jnp.float32
    ) * attention.attention_scale(config, h)
    scores_bkgts = jnp.where(visible_bts[:, None, None], scores_bkgts, -1e30)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(cd)
    out_btkgh = jnp.einsum("bkgts,bkhs->btkgh", probs_bkgts, v_bkhs.astype(cd))
    return out_btkgh.reshape(b, t, n, h)


@contextlib.contextmanager
def patched(module, name, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def f32_blockwise(q, k, v, config, **kw):
    """The learner's attention with its softmax·V in float32 (k/v values still bf16)."""
    f32 = config.replace(compute_dtype="float32")
    return ORIGINAL_BLOCKWISE(q, k, v, f32, **kw).astype(config.jnp_compute_dtype)


ORIGINAL_BLOCKWISE = attention.blockwise_attention


def run(model: str, prompts: int, new: int) -> list[tuple[str, float, float]]:
    config32, params = load(model)
    config = config32.replace(compute_dtype="bfloat16")
    dense = config.replace(attention="dense")
    t0 = time.perf_counter()
    rows = []

    def row(name, logp, mu):
        rows.append((name, *gap(logp, mu)))
        print(f"{model} | {name} | {rows[-1][1]:.3g} | {rows[-1][2]:.3g}", flush=True)

    def mus(samples):
        return [np.asarray(s.behaviour_logprobs) for s in samples]

    # Before: the engine's dense attention normalised, then rounded.
    with patched(cache_face, "dense_attention", old_dense_attention):
        with patched(attention, "dense_attention", old_dense_attention):
            old = engine_samples(config, params, prompts, new)
            row("before: learner (default)", score(config, params, old), mus(old))
            row("before: learner, dense attention", score(dense, params, old), mus(old))
            shaped = score(config, params, old, engine_shaped=True)
            row("before: engine-shaped prefill ([1, T])", shaped, mus(old))
            row("before: engine-shaped prefill vs learner dense", shaped, score(dense, params, old))
            row("before: fp32 learner", score(config32, params, old), mus(old))
    # After: one formula (blockwise's cast points) on both sides.
    samples = engine_samples(config, params, prompts, new)
    learner = score(config, params, samples)
    row("after: learner (default)", learner, mus(samples))
    shaped = score(config, params, samples, engine_shaped=True)
    row("after: engine-shaped prefill ([1, T])", shaped, mus(samples))
    row("after: engine-shaped prefill vs learner", shaped, learner)
    with patched(attention, "blockwise_attention", f32_blockwise):
        row("after: learner, softmax.V in fp32", score(config, params, samples), mus(samples))
    row("after: fp32 learner", score(config32, params, samples), mus(samples))
    if FP32:
        with patched(cache_face, "dense_attention", old_dense_attention):
            old32 = engine_samples(config32, params, prompts, new)
        row("fp32 before: learner", score(config32, params, old32), mus(old32))
        new32 = engine_samples(config32, params, prompts, new)
        row("fp32 after: learner", score(config32, params, new32), mus(new32))
    print(f"{model}: {sum(len(s.response_tokens) for s in samples)} tokens per engine run, "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return rows


FP32 = False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2,gemma3")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--fp32", action="store_true", help="also fp32 engine rows")
    args = parser.parse_args(argv)
    global FP32
    FP32 = args.fp32
    print("model | scored by | gap mean | gap max")
    for model in args.model.split(","):
        run(model, args.prompts, args.new)
    print("load average:", os.getloadavg())


if __name__ == "__main__":
    main()
