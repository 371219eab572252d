"""google-tunix side of ``benchmarks/e2e_vs_tunix.py``: one GRPO job, end to end.

Runs inside tunix's own venv (``benchmarks/vs_tunix.py`` creates it, plus
``math-verify``). Reads one JSON workload (argv[1]: a path), prints one JSON line
prefixed ``RESULT``. The only jaxflash module it imports is the reward,
``jaxflash.rewards.math_reward`` (pure Python on Math-Verify), so both systems
score with the same function.

The job: tunix's ``GRPOLearner`` over an ``RLCluster`` whose actor, reference and
rollout share one CPU mesh (tunix's colocated setup: the rollout samples from the
trained model itself, so its ``sync_weights`` is skipped), vanilla rollout
(``tunix.generate.sampler``), SmolLM2-135M-Instruct loaded from the exported
safetensors by tunix's own Llama 3 loader, with the checkpoint's RoPE base patched in
(``use_rope_theta``: tunix 0.1.7 ignores ``ModelConfig.rope_theta``; the workload's
``rope="tunix"`` keeps tunix's 1e6, as every run before this fix). Prompts arrive
already tokenized with SmolLM2's chat template by the driver (the adapter below maps
each prompt key to those ids), so both systems see the same prompt tokens; completions are decoded
with the exported ``tokenizer.json`` (``tokenizers``).

Timers: wall and process CPU time (``os.times``) at every step boundary (each
``next()`` of the training iterator is the start of a step), and around tunix's
own entry points for generation (``RLCluster.generate``), scoring
(``RLLearner._compute_rewards``), the update (``RLCluster.update_actor``) and the
publish (``RLCluster.sync_weights``). Held-out evaluation runs between steps inside
the iterator, right after a step boundary: the evaluation after step k falls in step
k + 1's interval, as jaxflash's does, and the report leaves that step out of the rates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


class _Timers:
    """Wall and CPU seconds per named section, summed over calls."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def wrap(self, obj, name: str, section: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), _cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[section] = self.wall.get(section, 0.0) + time.perf_counter() - t0
                self.cpu[section] = self.cpu.get(section, 0.0) + _cpu() - c0

        setattr(obj, name, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.wall)


def _key(text) -> str:
    """A prompt key; tunix hands prompts on as numpy string arrays of one element."""
    import numpy as np

    return str(np.asarray(text).reshape(-1)[0])


class _Tokenizer:
    """Prompt keys -> the driver's chat-templated ids; decode with tokenizer.json."""

    def __init__(self, ids_by_key: dict[str, list[int]], path: str, eos: int, pad: int):
        from tokenizers import Tokenizer

        self._ids = ids_by_key
        self._tok = Tokenizer.from_file(path)
        self._eos, self._pad = eos, pad

    def encode(self, text, **_):
        return list(self._ids[_key(text)])

    def decode(self, ids, **_):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def bos_id(self):
        return None

    def eos_id(self):
        return self._eos

    def pad_id(self):
        return self._pad


def _model_config(w: dict):
    from tunix.models.llama3 import model as llama3

    s = w["shape"]
    return llama3.ModelConfig(
        num_layers=s["n_layers"],
        vocab_size=s["vocab"],
        embed_dim=s["d_model"],
        hidden_dim=s["d_ff"],
        num_heads=s["n_heads"],
        head_dim=s["head_dim"],
        num_kv_heads=s["n_kv_heads"],
        rope_theta=s["rope_theta"],
        norm_eps=s["norm_eps"],
        weight_tying=True,
        remat_config=llama3.RematConfig.NONE,
    )


def use_rope_theta(theta: float) -> None:
    """Make tunix's Llama 3 attention rotate with ``theta``.

    tunix 0.1.7's ``Attention.block`` calls ``llama3.model.apply_rope`` without its
    ``rope_theta`` argument, so every Llama 3 model there rotates with the function's
    default, 1e6, whatever ``ModelConfig.rope_theta`` says (SmolLM2-135M's is 1e5):
    tunix then runs another model than the checkpoint's. Replaces the module global
    (looked up per call) with one that passes ``theta`` when the caller gives none.
    """
    from tunix.models.llama3 import model as llama3

    real = getattr(llama3.apply_rope, "__wrapped__", llama3.apply_rope)

    @functools.wraps(real)
    def apply_rope(inputs, positions, head_dim, rope_theta=None):
        base = theta if rope_theta is None else rope_theta
        return real(inputs, positions, head_dim, rope_theta=base)

    llama3.apply_rope = apply_rope


def logits(w: dict) -> dict:
    """Next-token log-softmax of ``w["ids"]`` (one row) under tunix's model, with its own
    RoPE (``w["rope"] == "tunix"``) or the checkpoint's theta (``"config"``)."""
    import jax
    import numpy as np
    from tunix.models.llama3 import params as llama3_params

    if w["rope"] == "config":
        use_rope_theta(w["shape"]["rope_theta"])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model = llama3_params.create_model_from_safe_tensors(w["hf_dir"], _model_config(w), mesh)
    ids = np.asarray([w["ids"]], np.int32)
    pos = np.arange(ids.shape[1], dtype=np.int32)[None]
    mask = np.tril(np.ones((1, ids.shape[1], ids.shape[1]), bool))
    out, _ = model(ids, pos, None, mask)
    logp = jax.nn.log_softmax(np.asarray(out, np.float32)[0], axis=-1)
    return {"logp": np.asarray(logp).tolist()}


def run(w: dict) -> dict:
    import jax
    import numpy as np
    import optax
    from tunix.models.llama3 import params as llama3_params
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout import base_rollout

    from jaxflash.rewards.math_reward import MathAnswerReward

    if w.get("rope", "config") == "config":  # the checkpoint's model (see use_rope_theta)
        use_rope_theta(w["shape"]["rope_theta"])
    t_start, c_start = time.perf_counter(), _cpu()
    B, G, steps = w["prompts_per_step"], w["group_size"], w["steps"]
    train, held_out = w["train"], w["eval"]
    ids_by_key = {r["key"]: r["ids"] for r in train + held_out}
    tok = _Tokenizer(ids_by_key, w["tokenizer_json"], eos=w["eos_ids"][0], pad=w["pad_id"])
    # Auto axes (jax.make_mesh would make them Explicit, which tunix 0.1.7 does not expect).
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model = llama3_params.create_model_from_safe_tensors(w["hf_dir"], _model_config(w), mesh)
    max_prompt = max(len(r["ids"]) for r in train + held_out)
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=w["max_new_tokens"],
        max_prompt_length=max_prompt,
        kv_cache_size=max_prompt + w["max_new_tokens"] + 8,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eos_tokens=list(w["eos_ids"]),
        # An int: the sampler makes a fresh key of it per call (a key array would be
        # donated by the first call). tunix then draws with the same key every step.
        seed=int(w["seed"]),
    )
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(w["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
    )
    roles = {rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh}
    cluster = rl.RLCluster(
        actor=model,
        reference=None,
        tokenizer=tok,
        cluster_config=rl.ClusterConfig(
            role_to_mesh=roles,
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl.RLTrainingConfig(
                actor_optimizer=opt, eval_every_n_steps=10**9, max_steps=steps
            ),
            rollout_config=rollout_config,
        ),
    )
    grpo = GRPOConfig(
        num_generations=G,
        num_iterations=1,
        beta=0.0,
        epsilon=w["clip_low"],
        loss_agg_mode="token-mean",
    )
    grpo.epsilon_high = w["clip_high"]  # read by tunix's grpo loss when present
    reward = MathAnswerReward()
    answers = {r["key"]: r["answer"] for r in train + held_out}
    scored = {"samples": 0, "correct": 0.0, "tokens": 0}
    examples: list = []
    calls: list = []
    prefixes: list = []  # per training call, every row's first 8 response tokens

    def math_reward(prompts, completions, **_):
        out = [
            reward(str(c), answers[_key(p)]).score
            for p, c in zip(prompts, completions, strict=True)
        ]
        scored["samples"] += len(out)
        scored["correct"] += sum(out)
        return out

    learner = GRPOLearner(rl_cluster=cluster, algo_config=grpo, reward_fns=[math_reward])
    timers = _Timers()
    timers.wrap(cluster, "generate", "generation")
    timers.wrap(learner, "_compute_rewards", "scoring")
    timers.wrap(cluster, "update_actor", "update")
    timers.wrap(cluster, "sync_weights", "publish")
    real_generate = cluster.generate

    def counting_generate(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        scored["tokens"] += sum(len(t) for t in out.tokens)
        calls.append([len(t) for t in out.tokens])  # every row's length, every call
        prefixes.append([[int(i) for i in t[:8]] for t in out.tokens])
        if not examples:  # the first step's first responses, to read next to jaxflash's
            examples.extend(
                [str(t), [int(i) for i in ids]]
                for t, ids in zip(out.text[:4], out.tokens[:4], strict=True)
            )
        return out

    cluster.generate = counting_generate

    curve, boundaries, eval_wall = [], [], 0.0

    def evaluate(step: int) -> None:
        nonlocal eval_wall
        t0 = time.perf_counter()
        keys = [r["key"] for r in held_out for _ in range(w["eval_samples"])]
        # The same key at every evaluation, as jaxflash's (its eval requests are keyed by
        # run seed, prompt and sample only): a curve's points then differ by the weights,
        # not by fresh draws (a row's noise is the same; tunix keys rows by position).
        config = dataclasses.replace(rollout_config, seed=10_000 + 100 * w["seed"])
        out = cluster.rollout.generate(keys, config)
        rewards = [reward(c, answers[k]).score for k, c in zip(keys, out.text, strict=True)]
        per_prompt = np.asarray(rewards).reshape(len(held_out), w["eval_samples"]).mean(1)
        stderr = float(per_prompt.std(ddof=1) / np.sqrt(len(per_prompt)))
        curve.append(
            {"step": step, "trained": step * B * G, "accuracy": float(per_prompt.mean()),
             "stderr": stderr}
        )  # fmt: skip
        eval_wall += time.perf_counter() - t0

    def batches():
        for step in range(steps):
            boundaries.append(
                {"step": step, "wall": time.perf_counter(), "cpu": _cpu(),
                 "sections": timers.snapshot(), "tokens": scored["tokens"]}
            )  # fmt: skip
            # After the boundary: the evaluation after step k lands in step k+1's
            # interval, as jaxflash's does, and the report leaves that step out for
            # both (e2e_report.steady_steps). Before it, step k's interval held it.
            if step % w["eval_every"] == 0 and w["eval_samples"]:
                evaluate(step)
            rows = train[step * B : (step + 1) * B]
            # numpy arrays, not lists: tunix repeats every leaf G times with
            # jax.tree.map(np.repeat), and a list's strings would each become a leaf
            # (4 rows of G copies instead of 4 x G rows).
            yield {
                "prompts": np.asarray([r["key"] for r in rows]),
                "answer": np.asarray([r["answer"] for r in rows]),
            }

    setup_s = time.perf_counter() - t_start
    learner.train(batches())
    boundaries.append(
        {"step": steps, "wall": time.perf_counter(), "cpu": _cpu(),
         "sections": timers.snapshot(), "tokens": scored["tokens"]}
    )  # fmt: skip
    if w["eval_samples"]:
        evaluate(steps)
    per_step = []
    for a, b in zip(boundaries, boundaries[1:], strict=False):
        sec = {k: v - a["sections"].get(k, 0.0) for k, v in b["sections"].items()}
        per_step.append(
            {"step": a["step"] + 1, "wall_s": b["wall"] - a["wall"], "cpu_s": b["cpu"] - a["cpu"],
             "samples": B * G, "tokens": b["tokens"] - a["tokens"], "sections": sec}
        )  # fmt: skip
    return {
        "system": "tunix",
        "setup_s": setup_s,
        "process_wall_s": time.perf_counter() - t_start,
        "process_cpu_s": _cpu() - c_start,
        "eval_wall_s": eval_wall,
        "per_step": per_step,
        "curve": curve,
        "train_accuracy": scored["correct"] / max(scored["samples"], 1),
        "examples": examples,
        "generate_row_lengths": calls,
        "row_prefixes": prefixes,
        "rope": w.get("rope", "config"),
    }


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        work = json.load(f)
    fn = logits if work.get("kind") == "logits" else run
    print("RESULT " + json.dumps(fn(work)), flush=True)
