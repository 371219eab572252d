"""Where a GRPO learner update's time goes: one batch in two layouts, split into parts.

    python benchmarks/learner_profile.py                  # the e2e job's batch, ~4 min
    python benchmarks/learner_profile.py --response 96    # the long-tailed variant's cap

The batch is shaped like ``benchmarks/e2e_vs_tunix.py``'s default job on
SmolLM2-135M (random fp32 weights, one CPU device, no remat): B prompts of
``--prompt_len`` tokens x G samples, response lengths drawn uniformly from
[``--min_response``, ``--response``]. Layouts: "unshared" (one padded row per sample,
T = the longest row rounded up to 8, as tunix trains) and "shared"
(``learner.prefix_sharing``: one packed row per group holding its prompt once, of
the longest prompt + G x ``--response`` tokens). For each: CPU seconds (best of
``--reps``) of the whole train step, of the gradient alone (forward + backward of
every micro-batch, accumulated), of the forward alone (loss-position logprobs), and
of the optimizer alone (global-norm clip + AdamW over the params), with the token
columns each computes. Ratios are measured in one process on one machine: compare
them, not the seconds, across hosts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu() -> float:
    return time.process_time()  # this process's CPU seconds, all threads


def _best(fn, reps: int) -> tuple[float, float]:
    """(best wall s, best CPU s) of ``fn()`` after one warm-up call (the compile)."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), _cpu()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(_cpu() - c0)
    return min(wall), min(cpu)


def _profile(config, lc, host, mesh, reps: int) -> tuple[dict, tuple]:
    """(best (wall, CPU) s of the step, gradient, forward and optimizer, batch shape
    [M, b, T]) of one layout ``lc`` of the host batch ``host``."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxflash.learner.device_batch import batch_sharding, device_batch
    from jaxflash.learner.optimizer import make_optimizer
    from jaxflash.learner.scoring import policy_logprobs
    from jaxflash.learner.state import create_train_state
    from jaxflash.learner.step import make_grad_fn, make_train_step
    from jaxflash.sharding.rules import LEARNER_RULES

    batch = device_batch(host, lc, batch_sharding(mesh, LEARNER_RULES, lc.micro_batch_size))
    state = create_train_state(config, lc, mesh, LEARNER_RULES, seed=0)
    step = make_train_step(config, lc, mesh, LEARNER_RULES)
    live = {"state": state}

    def run_step():
        live["state"], metrics = step(live["state"], host)  # the state is donated
        jax.block_until_ready(metrics)

    grad = jax.jit(make_grad_fn(config, lc))
    fwd = jax.jit(lambda params, mb: policy_logprobs(params, mb, config, lc, loss_only=True)[0])
    optimizer = make_optimizer(lc)

    @jax.jit
    def opt(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run_grad():
        st = live["state"]
        jax.block_until_ready(grad(st.params, st.params, batch, st.step)[1])

    def run_fwd():
        first = jax.tree.map(lambda x: x[0], batch)
        jax.block_until_ready(fwd(live["state"].params, first))

    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), state.params)

    def run_opt():
        st = live["state"]
        jax.block_until_ready(opt(grads, st.opt_state, st.params))

    parts = (("step", run_step), ("grad", run_grad), ("fwd", run_fwd), ("opt", run_opt))
    return {key: _best(fn, reps) for key, fn in parts}, tuple(batch["input_ids_bt"].shape)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=46)
    ap.add_argument("--min_response", type=int, default=5)
    ap.add_argument("--response", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--preset", default="smollm2_135m")
    ap.add_argument("--layouts", default="unshared,shared")
    ap.add_argument("--attention", default="auto", help="model.attention of the learner")
    args = ap.parse_args(argv)

    import dataclasses

    import jax
    import numpy as np

    from jaxflash.learner.batching import pack_batch
    from jaxflash.learner.config import LearnerConfig
    from jaxflash.models.config.presets import get_preset
    from jaxflash.sharding.mesh import make_mesh
    from jaxflash.types import FinishReason, Sample, SamplingParams

    config = dataclasses.replace(get_preset(args.preset), remat=False, attention=args.attention)
    B, G, P, R = args.prompts, args.group, args.prompt_len, args.response
    rng = np.random.default_rng(0)
    samples = []
    for p in range(B):
        prompt = rng.integers(3, config.vocab_size, P).astype(np.int32)
        for g in range(G):
            n = int(rng.integers(args.min_response, R + 1))
            samples.append(
                Sample(
                    prompt_id=p, sample_index=g, prompt_tokens=prompt,
                    response_tokens=rng.integers(3, config.vocab_size, n).astype(np.int32),
                    behaviour_logprobs=rng.uniform(-4, -1, n).astype(np.float32),
                    token_versions=np.zeros(n, np.int32), start_version=0,
                    finish_reason=FinishReason.EOS, reward=float(g % 2),
                )
            )  # fmt: skip
    adv = rng.standard_normal(B * G).astype(np.float32)
    host = pack_batch(samples, adv, length_multiple=8)
    mesh = make_mesh(jax.devices()[:1], {})
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    base = dict(
        lr=1e-6, loss="ppo", loss_kwargs={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        sampling=sampling, logprob_chunk=config.logits_chunk, length_multiple=8,
    )  # fmt: skip
    layouts = {
        "unshared": LearnerConfig(**base, micro_batch_size=B * G),
        "shared": LearnerConfig(
            **base,
            micro_batch_size=B,
            packing=True,
            prefix_sharing=True,
            pack_length=-(-(P + G * R) // 8) * 8,
        ),  # fmt: skip
    }
    print(f"load average at start: {os.getloadavg()}", flush=True)
    print(
        f"batch: {B} prompts x {G} samples, prompt {P} tokens, responses "
        f"{args.min_response}-{R} ({int(host.loss_mask_bt.sum())} loss tokens); "
        f"{args.preset}, fp32, 1 device, no remat, attention {args.attention}"
    )
    rows = {}
    for name in args.layouts.split(","):
        part, shape = _profile(config, layouts[name], host, mesh, args.reps)
        m, b, t = shape
        rows[name] = {"columns": m * b * t, "shape": shape, **part}
        print(f"  {name}: [{m}, {b}, {t}] = {m * b * t} columns; " + ", ".join(
            f"{k} {w:.2f} s / {c:.2f} CPU-s" for k, (w, c) in part.items()
        ), flush=True)  # fmt: skip
    if "unshared" in rows and "shared" in rows:
        u, s = rows["unshared"], rows["shared"]
        print("| part | unshared CPU-s | shared CPU-s | unshared / shared |")
        print("|---|---|---|---|")
        for key in ("step", "grad", "fwd", "opt"):
            ratio = u[key][1] / max(s[key][1], 1e-9)
            print(f"| {key} | {u[key][1]:.2f} | {s[key][1]:.2f} | {ratio:.2f} |")
        print(f"| columns | {u['columns']} | {s['columns']} | {u['columns'] / s['columns']:.2f} |")
    print(f"load average at end: {os.getloadavg()}")
    return rows


if __name__ == "__main__":
    main()
