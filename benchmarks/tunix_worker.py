"""google-tunix side of ``benchmarks/vs_tunix.py`` (runs inside tunix's own venv).

Never imports jaxflash: the tunix venv holds tunix and its pinned jax only. Reads
one JSON workload from argv, prints one JSON result line prefixed ``RESULT``.

Generation: ``tunix.generate.sampler.Sampler`` over tunix's ``Llama3`` at the
SmolLM2-135M shape, random fp32 weights, prompts left-padded to exactly the
prompt length (all prompts have it, so no padding), KV cache ``cache_size`` rows,
temperature 1 with top_p=1.0 (tunix's no-sort path), logprobs returned, and an
EOS id that is never sampled (-1) so every row decodes every step.

Learner: tunix's own ``PeftTrainer`` train step (``nnx.value_and_grad`` of the
loss + ``nnx.Optimizer.update``, jitted by ``jit_train_and_eval_step``) with
tunix's GRPO policy loss (``rl.algo_core.grpo_loss_fn``, beta 0 = no KL), AdamW
after global-norm clipping at 1.0 — what tunix's GRPO learner runs per update.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import types

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _model(w: dict):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    cfg = llama3.ModelConfig(
        num_layers=w["n_layers"],
        vocab_size=w["vocab"],
        embed_dim=w["d_model"],
        hidden_dim=w["d_ff"],
        num_heads=w["n_heads"],
        head_dim=w["head_dim"],
        num_kv_heads=w["n_kv_heads"],
        rope_theta=100000,
        norm_eps=1e-5,
        weight_tying=True,
        remat_config=llama3.RematConfig.DECODER if w.get("remat") else llama3.RematConfig.NONE,
    )
    model = llama3.Llama3(cfg, rngs=nnx.Rngs(0))
    # tunix initialises MLP kernels to zero; give every matrix normal(0.02)
    # values like ours (speed does not depend on them, sampling diversity does).
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    leaves = [
        x if x.ndim < 2 else 0.02 * jax.random.normal(k, x.shape, jnp.float32)
        for x, k in zip(leaves, keys, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


class _Tokenizer:
    """Maps the strings 'p0', 'p1', ... to fixed random prompts (no text needed)."""

    def __init__(self, prompts):
        self._prompts = prompts

    def encode(self, text, **_):
        return list(self._prompts[int(text[1:])])

    def decode(self, ids, **_):
        return ""

    def bos_id(self):
        return None

    def eos_id(self):
        return -1

    def pad_id(self):
        return 0


def generation(w: dict) -> dict:
    import numpy as np
    from tunix.generate import sampler as sampler_lib

    model = _model(w)
    rng = np.random.default_rng(w["seed"])
    prompts = rng.integers(1, w["vocab"], size=(w["batch"], w["prompt_len"]))
    cache = w["prompt_len"] + w["new_tokens"]
    sampler = sampler_lib.Sampler(
        model,
        _Tokenizer(prompts),
        sampler_lib.CacheConfig(
            cache_size=cache,
            num_layers=w["n_layers"],
            num_kv_heads=w["n_kv_heads"],
            head_dim=w["head_dim"],
        ),
    )
    texts = [f"p{i}" for i in range(w["batch"])]

    def call(seed):
        out = sampler(
            texts,
            max_generation_steps=w["new_tokens"],
            max_prompt_length=w["prompt_len"],
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            return_logprobs=True,
            eos_tokens=[-1],
        )
        return sum(len(t) for t in out.tokens)

    t0 = time.perf_counter()
    call(0)  # compile
    compile_s = time.perf_counter() - t0
    runs, cpu_runs, tokens = [], [], 0
    for rep in range(w["reps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = call(rep + 1)
        runs.append(tokens / (time.perf_counter() - t0))
        cpu_runs.append(tokens / (time.process_time() - c0))
    return {
        "compile_s": compile_s,
        "runs": runs,
        "cpu_runs": cpu_runs,
        "tokens": tokens,
        "cache_rows": cache,
    }


def learner(w: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tunix.rl import algo_core, common
    from tunix.rl.grpo.grpo_learner import GRPOConfig
    from tunix.sft import peft_trainer

    model = _model(w)
    b, p, c = w["batch"], w["prompt_len"], w["seq_len"] - w["prompt_len"]
    rng = np.random.default_rng(w["seed"])
    prompts = rng.integers(1, w["vocab"], (b, p))
    if w.get("group"):  # GRPO's G samples of a prompt share it (tunix trains every row)
        prompts = np.repeat(prompts[:: w["group"]], w["group"], axis=0)
    example = common.TrainExample(
        prompt_ids=jnp.asarray(prompts, jnp.int32),
        prompt_mask=jnp.ones((b, p), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(1, w["vocab"], (b, c)), jnp.int32),
        completion_mask=jnp.ones((b, c), jnp.int32),
        advantages=jnp.asarray(rng.standard_normal(b), jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=None,
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6, weight_decay=0.0))
    if w.get("variant", "grpo") == "grpo":
        grpo = GRPOConfig(num_generations=2, beta=0.0, epsilon=0.2, loss_agg_mode="token-mean")
        # grpo_loss_fn reads algo_config.temperature, which tunix's RL cluster adds
        # to the config it passes; GRPOConfig itself has no such field in 0.1.7.
        algo = types.SimpleNamespace(**dataclasses.asdict(grpo), temperature=1.0)

        def loss_fn(model, train_example):
            return algo_core.grpo_loss_fn(model, train_example, algo, pad_id=0, eos_id=-1)

    else:  # "lean": tunix's model and log-softmax, a bare PPO-clip loss, no diagnostics

        def loss_fn(model, train_example):
            ex = train_example
            ids = jnp.concatenate([ex.prompt_ids, ex.completion_ids], axis=1)
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
            causal = jnp.tril(jnp.ones((ids.shape[1], ids.shape[1]), bool))[None]
            logits, _ = model(ids, positions, None, causal)
            logp = common.selective_log_softmax(logits[:, p - 1 : -1], ex.completion_ids)
            ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
            adv = ex.advantages[:, None]
            loss_bt = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
            mask = ex.completion_mask
            return (loss_bt * mask).sum() / mask.sum(), {}

    trainer = peft_trainer.PeftTrainer(
        model, opt, peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
    )
    trainer.with_loss_fn(loss_fn, has_aux=True)
    train_step, _ = trainer.jit_train_and_eval_step()

    def call():
        loss, _, grad_norm = train_step({"train_example": example})
        jax.block_until_ready((loss, grad_norm))

    t0 = time.perf_counter()
    call()
    compile_s = time.perf_counter() - t0
    runs, cpu_runs = [], []
    for _ in range(w["reps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        call()
        runs.append(b * w["seq_len"] / (time.perf_counter() - t0))
        cpu_runs.append(b * w["seq_len"] / (time.process_time() - c0))
    return {"compile_s": compile_s, "runs": runs, "cpu_runs": cpu_runs, "tokens": b * w["seq_len"]}


if __name__ == "__main__":
    work = json.loads(sys.argv[1])
    fn = {"generation": generation, "learner": learner}[work["kind"]]
    print("RESULT " + json.dumps(fn(work)), flush=True)
