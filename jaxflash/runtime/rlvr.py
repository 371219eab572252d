"""The synchronous RLVR loop (α = 0): generate, score, train, sync — top to bottom.

One learner step per round:

    prompts ─► G samples each (JetStream engine, slot loop) ─► rewards (worker
    processes) ─► groups ─► advantages ─► jitted sharded train_step ─► publish
    weights to the engine (version v+1) ─► metrics / eval / checkpoint

This is the baseline every async speed-up is measured against; the async
program reuses the same pieces with a queue between them.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.algorithms.advantages import get_advantage_estimator
from jaxflash.checkpoint.checkpointer import CheckpointMeta
from jaxflash.data.prompts import PromptSource
from jaxflash.learner.batching import pack_batch
from jaxflash.learner.step import make_train_step
from jaxflash.metrics.writer import MetricsWriter
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.runtime.evaluation import evaluate
from jaxflash.runtime.experiment import ExperimentConfig
from jaxflash.runtime.ledger import failure_reason
from jaxflash.runtime.model_setup import (
    build_meshes,
    check_workdir_model,
    load_model,
    make_datasets,
    make_engine,
    make_reward,
)
from jaxflash.runtime.resume import init_or_restore_learner
from jaxflash.runtime.reward_pool import RewardPool
from jaxflash.runtime.rollout import TruncationPolicy, rollout_round
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.sync.publish import Publisher
from jaxflash.types import PromptOutcome

MAX_EMPTY_ROUNDS = 20  # consecutive rounds with nothing trainable before giving up


def run(exp: ExperimentConfig, *, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) a synchronous RLVR experiment in ``workdir``.

    Args:
      exp: the validated experiment.
      workdir: run directory; a complete checkpoint there is resumed from.

    Returns:
      The last step's metrics.

    Raises:
      RuntimeError: if MAX_EMPTY_ROUNDS rounds in a row produce nothing to train
        on (every prompt failed or was filtered), naming the counters.
    """
    os.makedirs(workdir, exist_ok=True)

    # ------------------------------------------------------------ devices
    learner_mesh, gen_mesh = build_meshes(exp.mesh)
    reward = make_reward(exp.reward)  # resolve a custom reward before the slow model load

    # ------------------------------------------------------------ model + tokenizer
    model_config, imported_params, tokenizer = load_model(exp.model, exp.rollout)
    print(f"model: {model_config}", flush=True)
    check_workdir_model(workdir, model_config)

    # ------------------------------------------------------------ learner (born sharded)
    state, meta, ledger, checkpointer = init_or_restore_learner(
        exp, model_config, imported_params, learner_mesh, workdir
    )
    del imported_params
    train_step = make_train_step(model_config, exp.learner, learner_mesh, LEARNER_RULES)

    # ------------------------------------------------------------ engine + weight sync
    sampling = exp.rollout.sampling
    engine, gen_shardings = make_engine(exp, model_config, gen_mesh, tokenizer)
    version = int(meta.step)  # policy version == learner steps taken
    publisher = Publisher()
    gen_params = publisher.publish(state.params, gen_shardings, version).params

    # ------------------------------------------------------------ data + rewards
    train_rows, eval_prompts_source = make_datasets(exp, tokenizer)
    source = PromptSource(
        train_rows,
        tokenizer,
        max_prompt_tokens=exp.data.max_prompt_tokens,
        start=meta.data_cursor,
        cycle=not callable(train_rows),  # a file is read in epochs; ids keep growing
    )
    eval_prompts = eval_prompts_source
    reward_pool = RewardPool(
        reward, num_workers=exp.reward.num_workers, timeout_s=exp.reward.timeout_s
    )
    buffer = GroupBuffer(exp.rollout.group_size, group_filter=_group_filter(exp))
    advantage_fn = get_advantage_estimator(exp.advantage)
    truncation = TruncationPolicy(
        mode=exp.rollout.truncation, penalty=exp.rollout.truncation_penalty
    )
    B, G = exp.rollout.prompts_per_step, exp.rollout.group_size

    # ------------------------------------------------------------ the loop
    writer = MetricsWriter(workdir)
    metrics: dict[str, Any] = {}
    empty_rounds = 0
    try:
        if version == 0 and exp.data.eval_size:
            metrics = _eval(engine, gen_params, eval_prompts, exp, version, tokenizer, reward_pool)
            writer.write_step(0, {**metrics, **ledger.metrics()})
        while version < exp.total_steps:
            t_round = time.monotonic()
            # 1. Rollout: B prompts x G samples, scored; each prompt enters the ledger.
            items = source.take(B)
            for item in items:
                ledger.take(item.prompt_id)
            rnd = rollout_round(
                engine,
                gen_params,
                items,
                buffer=buffer,
                group_size=G,
                sampling=sampling,
                seed=exp.seed,
                policy_version=version,
                tokenizer=tokenizer,
                reward_pool=reward_pool,
                truncation=truncation,
            )
            # 2. Groups (α = 0: everything was generated by the current version).
            groups, dropped = buffer.take(B, learner_version=version, async_ratio=0)
            for d in dropped:
                failed = d.outcome == PromptOutcome.FAILED
                ledger.close(
                    d.prompt_id, d.outcome, failure_reason(d.detail) if failed else d.reason
                )
                if d.outcome == PromptOutcome.FAILED:
                    print(f"failed: {d.detail or d.reason}", flush=True)
            writer.write_rollouts([{**row, "learner_step": version + 1} for row in rnd.rows])
            if not groups:
                empty_rounds += 1
                if empty_rounds >= MAX_EMPTY_ROUNDS:
                    raise RuntimeError(
                        f"{empty_rounds} rounds in a row had nothing to train on: "
                        f"{ledger.metrics()}"
                    )
                continue
            empty_rounds = 0

            # 3. Advantages per group, then the batch (truncated samples dropped in mask mode).
            rewards_bg = np.stack([g.rewards_g for g in groups]).astype(np.float32)
            keep_bg = np.array(
                [
                    [not (s.truncated and truncation.mode == "mask") for s in g.samples]
                    for g in groups
                ]
            )
            adv_bg = np.asarray(advantage_fn(jnp.asarray(rewards_bg), mask_bg=jnp.asarray(keep_bg)))
            samples, advs = [], []
            for g, adv_g, keep_g in zip(groups, adv_bg, keep_bg, strict=True):
                for s, a, k in zip(g.samples, adv_g, keep_g, strict=True):
                    if k:
                        samples.append(s)
                        advs.append(float(a))
            batch = pack_batch(
                samples,
                np.asarray(advs, np.float32),
                pad_id=tokenizer.pad_id,
                max_len=model_config.max_seq_len,
                num_sequences=B * G,
            )

            # 4. Learner step (jitted once per batch shape; state donated).
            t_train = time.monotonic()
            state, train_metrics = train_step(state, batch)
            train_metrics = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
            train_s = time.monotonic() - t_train
            for g in groups:
                ledger.close(g.prompt_id, PromptOutcome.TRAINED, "trained")
            ledger.check()

            # 5. Weight sync: learner mesh -> engine mesh, device to device, version v+1.
            t_sync = time.monotonic()
            version = int(jax.device_get(state.step))
            gen_params = publisher.publish(state.params, gen_shardings, version).params
            jax.block_until_ready(gen_params)
            sync_s = time.monotonic() - t_sync

            # 6. Metrics, evaluation, checkpoint.
            metrics = {
                **rnd.metrics,
                **train_metrics,
                "train_time_s": train_s,
                "train_tokens_per_s": train_metrics.get("tokens", 0.0) / train_s,
                "weight_sync_s": sync_s,
                "round_time_s": time.monotonic() - t_round,
                "policy_version": version,
                **ledger.metrics(),
                "prompt_outcomes": ledger.outcomes,
            }
            if version % exp.eval.every == 0 or version == exp.total_steps:
                metrics.update(
                    _eval(engine, gen_params, eval_prompts, exp, version, tokenizer, reward_pool)
                )
            _check_finite(metrics, version)
            writer.write_step(version, metrics)
            if version % exp.checkpoint.every == 0 or version == exp.total_steps:
                checkpointer.save(
                    state,
                    CheckpointMeta(
                        step=version,
                        data_cursor=source.cursor,
                        policy_version=version,
                        counters=ledger.metrics(),
                        extra={"ledger": ledger.state_dict()},
                    ),
                )
    finally:
        checkpointer.close()
        reward_pool.close()
        writer.close()
    return metrics


def _group_filter(exp: ExperimentConfig):
    from jaxflash.replay.group_buffer import GroupFilter

    return GroupFilter(zero_variance=True) if exp.rollout.filter_zero_variance else None


def _eval(engine, params, prompts, exp, version, tokenizer, reward_pool) -> dict[str, float]:
    if not prompts:
        return {}
    t0 = time.monotonic()
    out = evaluate(
        engine,
        params,
        prompts,
        samples_per_prompt=exp.eval.samples_per_prompt,
        sampling=exp.rollout.sampling,
        seed=exp.seed,
        policy_version=version,
        tokenizer=tokenizer,
        reward_pool=reward_pool,
    )
    out["eval_time_s"] = time.monotonic() - t0
    return out


def _check_finite(metrics: dict[str, Any], step: int) -> None:
    """Fail loudly on NaN/Inf training metrics (eval NaN with no prompts is allowed)."""
    for key in ("loss", "grad_norm", "entropy"):
        value = metrics.get(key)
        if value is not None and not math.isfinite(value):
            raise FloatingPointError(f"step {step}: metric {key} is {value}: {metrics}")
