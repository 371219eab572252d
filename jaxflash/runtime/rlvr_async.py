"""The asynchronous RLVR loop (ROLL Flash, arXiv 2510.11345) — top to bottom.

The learner and N generation servers run at the same time on disjoint slices:

    GenerationServer x N (own thread, own mesh) ─► on_finished ─► reward worker
        ▲   update_weights(v+1) while decoding        │ (per sample, no barrier)
        │                                             ▼
    sync.publish (D2D) ◄── train_step ◄── next_batch ◄── GroupBuffer (groups of G)

One learner step: wait for B fresh groups (``RolloutScheduler.next_batch``,
staleness <= α), advantages, jitted ``train_step``, publish the new params to
every generation slice device to device and hand them to the servers while
they keep generating, then metrics / eval / checkpoint. With α = 0 the
scheduler admits the next prompts only after the new weights are published, so
the run reproduces the synchronous loop (``runtime.rlvr``) prompt for prompt.

Resume: the ledger, the scheduler's counters and the data cursor are in the
checkpoint; prompts in flight at the checkpoint are regenerated from scratch at
the restored version (``prompts_regenerated_on_resume``), never trained twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
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
from jaxflash.replay.group_buffer import GroupBuffer, GroupFilter
from jaxflash.replay.staleness import start_version_of
from jaxflash.replay.versions import PolicyClock
from jaxflash.runtime.experiment import ExperimentConfig
from jaxflash.runtime.model_setup import (
    check_workdir_model,
    load_model,
    make_datasets,
    make_engine,
    make_reward,
    prompt_by_id,
)
from jaxflash.runtime.resume import init_or_restore_learner
from jaxflash.runtime.reward_pool import RewardPool
from jaxflash.runtime.rlvr import MAX_EMPTY_ROUNDS, _check_finite, _eval
from jaxflash.runtime.rollout import TruncationPolicy
from jaxflash.runtime.scheduler import RolloutScheduler
from jaxflash.runtime.slices import build_slices
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.sync.publish import Publisher


def group_filter_of(exp: ExperimentConfig) -> GroupFilter | None:
    """The dynamic-sampling filter the rollout config asks for (None = keep every group)."""
    r = exp.rollout
    knobs = dict(min_mean=r.filter_min_mean, max_mean=r.filter_max_mean, min_std=r.filter_min_std)
    if not r.filter_zero_variance and all(v is None for v in knobs.values()):
        return None
    return GroupFilter(zero_variance=r.filter_zero_variance, **knobs)


def run(
    exp: ExperimentConfig, *, workdir: str, server_factory: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """Runs (or resumes) an asynchronous RLVR experiment in ``workdir``.

    Args:
      exp: the validated experiment; ``exp.mesh.colocated`` must be False.
      workdir: run directory; a complete checkpoint there is resumed from.
      server_factory: builds a server like ``runtime.gen_server.GenerationServer``
        (tests inject fakes); default GenerationServer.

    Returns:
      The last step's metrics.

    Raises:
      RuntimeError: MAX_EMPTY_ROUNDS batches in a row with nothing to train on.
      TimeoutError: no batch could be assembled in time (servers dead / hung).
    """
    os.makedirs(workdir, exist_ok=True)

    # ------------------------------------------------------------ devices
    learner_mesh, gen_meshes = build_slices(exp.mesh)
    reward = make_reward(exp.reward)  # resolve a custom reward before the slow model load

    # ------------------------------------------------------------ model + learner
    model_config, imported_params, tokenizer = load_model(exp.model, exp.rollout)
    print(f"model: {model_config}", flush=True)
    check_workdir_model(workdir, model_config)
    state, meta, ledger, checkpointer = init_or_restore_learner(
        exp, model_config, imported_params, learner_mesh, workdir
    )
    counters: dict[str, int] = dict(meta.extra.get("async_counters", {}))
    del imported_params
    train_step = make_train_step(model_config, exp.learner, learner_mesh, LEARNER_RULES)

    # ------------------------------------------------------------ engines + first weights
    engines = [make_engine(exp, model_config, mesh, tokenizer) for mesh in gen_meshes]
    version = int(meta.step)  # policy version == learner steps taken
    publishers = [Publisher() for _ in engines]
    gen_params = [
        pub.publish(state.params, shardings, version).params
        for pub, (_, shardings) in zip(publishers, engines, strict=True)
    ]

    # ------------------------------------------------------------ data, rewards, scheduler
    train_rows, eval_prompts = make_datasets(exp, tokenizer)
    source = PromptSource(
        train_rows,
        tokenizer,
        max_prompt_tokens=exp.data.max_prompt_tokens,
        start=meta.data_cursor,
        cycle=not callable(train_rows),
    )
    resume = tuple(prompt_by_id(train_rows, source, pid) for pid in sorted(ledger.open_ids))
    reward_pool = RewardPool(
        reward, num_workers=exp.reward.num_workers, timeout_s=exp.reward.timeout_s
    )
    group_filter = group_filter_of(exp)
    r = exp.rollout
    B, G = r.prompts_per_step, r.group_size
    truncation = TruncationPolicy(mode=r.truncation, penalty=r.truncation_penalty)
    scheduler = RolloutScheduler(
        [],
        source,
        ledger,
        GroupBuffer(G, group_filter=group_filter),
        reward_pool,
        tokenizer=tokenizer,
        batch_prompts=B,
        group_size=G,
        async_ratio=r.async_ratio,
        sampling=r.sampling,
        seed=exp.seed,
        clock=PolicyClock(version),
        stale_policy=r.stale_policy,
        sample_deadline_s=r.sample_deadline_s,
        max_retries=r.max_retries,
        truncation=truncation,
        resume_prompts=resume,
        counters=counters,
        # Dynamic sampling: a filtered group's prompt is replaced at once (within the cap).
        refill_dropped=group_filter is not None,
    )
    if server_factory is None:
        from jaxflash.runtime.gen_server import GenerationServer

        server_factory = GenerationServer
    scheduler.servers = [
        server_factory(
            f"gen{i}",
            engine,
            params,
            policy_version=version,
            eos_id=tokenizer.eos_id,
            partial_rollout=r.partial_rollout,
            on_finished=scheduler.on_finished,
        )
        for i, ((engine, _), params) in enumerate(zip(engines, gen_params, strict=True))
    ]
    advantage_fn = get_advantage_estimator(exp.advantage)
    batch_timeout_s = r.sample_deadline_s * (r.max_retries + 2) + 4 * exp.reward.timeout_s

    # ------------------------------------------------------------ the learner loop
    writer = MetricsWriter(workdir)
    metrics: dict[str, Any] = {}
    empty_rounds = 0
    engine0 = engines[0][0]
    try:
        if version == 0 and exp.data.eval_size:
            metrics = _eval(engine0, gen_params[0], eval_prompts, exp, 0, tokenizer, reward_pool)
            writer.write_step(0, {**metrics, **ledger.metrics()})
        for server in scheduler.servers:
            server.start()
        scheduler.start()
        gen_before = _gen_times(scheduler.servers)
        while version < exp.total_steps:
            t_step = time.monotonic()
            # 1. Wait for B fresh groups (staleness <= alpha), oldest first.
            batch = scheduler.next_batch(version, timeout_s=batch_timeout_s)
            for row in batch.rows:
                row.update(learner_step=version + 1, staleness=version - row["start_version"])
            writer.write_rollouts(batch.rows)
            if not batch.groups:
                scheduler.release()
                empty_rounds += 1
                if empty_rounds >= MAX_EMPTY_ROUNDS:
                    raise RuntimeError(
                        f"{empty_rounds} batches in a row had nothing to train on: "
                        f"{scheduler.stats()}"
                    )
                continue
            empty_rounds = 0

            # 2. Advantages per group, then the packed batch.
            samples, advs = _samples_and_advantages(batch.groups, advantage_fn, truncation)
            packed = pack_batch(
                samples,
                np.asarray(advs, np.float32),
                pad_id=tokenizer.pad_id,
                max_len=model_config.max_seq_len,
                num_sequences=B * G,
            )
            stale_s = np.array([version - start_version_of(s) for s in samples], np.int64)

            # 3. Learner step (jitted once per batch shape; state donated).
            t_train = time.monotonic()
            state, train_metrics = train_step(state, packed)
            train_metrics = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
            train_s = time.monotonic() - t_train
            scheduler.mark_trained(batch.groups)
            # Books as of now, before publish frees capacity: the checkpoint's in-flight
            # prompts are exactly those admitted under the weights being replaced.
            snapshot, sched_stats = scheduler.snapshot(), scheduler.stats()

            # Version lag: which weights each server was generating with during this step.
            gen_now = _gen_times(scheduler.servers)
            server_metrics = _server_metrics(scheduler.servers, gen_before, gen_now, version)
            gen_before = gen_now

            # 4. Weight sync: D2D to every generation slice; servers keep decoding.
            t_sync = time.monotonic()
            version = int(jax.device_get(state.step))
            gen_params = [
                pub.publish(state.params, shardings, version).params
                for pub, (_, shardings) in zip(publishers, engines, strict=True)
            ]
            jax.block_until_ready(gen_params)
            copy_s = time.monotonic() - t_sync
            handover_s = scheduler.publish(gen_params, version)

            # 5. Metrics, evaluation, checkpoint.
            step_s = time.monotonic() - t_step
            metrics = {
                **_sample_metrics(batch),
                **train_metrics,
                **_staleness_metrics(stale_s),
                **server_metrics,
                "train_time_s": train_s,
                "train_tokens_per_s": train_metrics.get("tokens", 0.0) / train_s,
                "weight_sync_s": copy_s + handover_s,
                "weight_copy_s": copy_s,
                "learner_wait_s": batch.wait_s,
                "learner_idle_frac": batch.wait_s / step_s,
                "step_time_s": step_s,
                "policy_version": version,
                **sched_stats,
                "prompt_outcomes": ledger.outcomes,
            }
            if version % exp.eval.every == 0 or version == exp.total_steps:
                metrics.update(
                    _eval(
                        engine0, gen_params[0], eval_prompts, exp, version, tokenizer, reward_pool
                    )
                )
            _check_finite(metrics, version)
            writer.write_step(version, metrics)
            if version % exp.checkpoint.every == 0 or version == exp.total_steps:
                ledger_state, counts, cursor = snapshot
                checkpointer.save(
                    state,
                    CheckpointMeta(
                        step=version,
                        data_cursor=cursor,
                        policy_version=version,
                        counters={k: int(v) for k, v in counts.items()},
                        extra={"ledger": ledger_state, "async_counters": counts},
                    ),
                )
    finally:
        scheduler.close()  # surplus requests aborted (counted) once the last batch is full
        for server in scheduler.servers:
            try:
                server.stop()
            except Exception as err:  # a server stuck in a step: it is a daemon thread
                print(f"generation server did not stop: {err!r}", flush=True)
        checkpointer.close()
        reward_pool.close()
        writer.close()
    return metrics


def _samples_and_advantages(groups, advantage_fn, truncation: TruncationPolicy):
    """Flattened samples + per-sample advantages (mask mode drops truncated ones)."""
    rewards_bg = np.stack([g.rewards_g for g in groups]).astype(np.float32)
    keep_bg = np.array(
        [[not (s.truncated and truncation.mode == "mask") for s in g.samples] for g in groups]
    )
    adv_bg = np.asarray(advantage_fn(jnp.asarray(rewards_bg), mask_bg=jnp.asarray(keep_bg)))
    samples, advs = [], []
    for g, adv_g, keep_g in zip(groups, adv_bg, keep_bg, strict=True):
        for s, a, k in zip(g.samples, adv_g, keep_g, strict=True):
            if k:
                samples.append(s)
                advs.append(float(a))
    return samples, advs


def _staleness_metrics(stale_s: np.ndarray) -> dict[str, Any]:
    """Per trained sample: learner version - start version (0 <= s <= alpha)."""
    values, counts = np.unique(stale_s, return_counts=True)
    return {
        "staleness_mean": float(stale_s.mean()),
        "staleness_max": int(stale_s.max()),
        "staleness_hist": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
    }


def _sample_metrics(batch) -> dict[str, float]:
    samples = [s for g in batch.groups for s in g.samples]
    rewards = np.array([s.reward for s in samples], np.float64)
    lens = np.array([len(s.response_tokens) for s in samples], np.float64)
    return {
        "num_samples": len(samples),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(
            np.mean([row["correct"] for row in batch.rows if row["outcome"] == "trained"])
        ),
        "response_len_mean": float(lens.mean()),
        "response_len_max": float(lens.max()),
        "truncated_frac": float(np.mean([s.truncated for s in samples])),
    }


def _stats(server) -> dict[str, Any]:
    try:
        return server.stats()
    except Exception:  # a dead server: the scheduler has counted and rerouted it
        return {}


def _gen_times(servers) -> list[tuple[float, float]]:
    out = []
    for s in servers:
        st = _stats(s)
        out.append((float(st.get("busy_s", 0.0)), float(st.get("idle_s", 0.0))))
    return out


def _server_metrics(servers, before, now, version: int) -> dict[str, float]:
    """Occupancy, idle fraction over the step, and version lag of every server."""
    out: dict[str, float] = {}
    busy = idle = 0.0
    for i, (s, (b0, i0), (b1, i1)) in enumerate(zip(servers, before, now, strict=True)):
        st = _stats(s)
        out[f"gen{i}_occupancy"] = float(st.get("occupancy", 0.0))
        out[f"gen{i}_version_lag"] = int(version - s.version)
        busy, idle = busy + (b1 - b0), idle + (i1 - i0)
    occ = [out[f"gen{i}_occupancy"] for i in range(len(servers))]
    out["gen_slot_occupancy"] = float(np.mean(occ)) if occ else 0.0
    out["gen_idle_frac"] = idle / (busy + idle) if busy + idle > 0 else 0.0
    out["gen_version_lag_max"] = max(out[f"gen{i}_version_lag"] for i in range(len(servers)))
    return out
