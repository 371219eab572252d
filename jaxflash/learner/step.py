"""The learner step: one optimiser update from one TrainBatch, jitted once.

``train_step(state, batch) -> (state, metrics)`` is a pure function with explicit
in/out shardings and the state donated. Gradients accumulate over micro-batches
with ``jax.lax.scan``; every micro-batch's loss is normalised by the *whole*
batch's token / sequence counts (``aggregation.batch_normalizers``), so the sum of
micro-batch gradients is the full-batch gradient and nothing depends on how the
batch was split ("Micro-batch invariance", tests/learner/test_learner.py).

Per micro-batch: forward -> h [b, T, D] -> chunked log q(target) and entropy
under the sampling distribution (temperature / top-k / top-p, the same q the
engine sampled from; ``learner.scoring.policy_logprobs``) -> policy loss
(``POLICY_LOSSES``) + optional entropy bonus + optional k3 KL to reference params
+ optional router load-balancing loss (mixture-of-experts models,
``LearnerConfig.router_aux_loss_coef``; its expert loads are the whole batch's, so it
too is micro-batch invariant).

Dual replay cycle (``LearnerConfig.replay_loss``, ``learner.cycles``): the batch's
``cycle_bt`` labels rows fresh or replayed; the fresh rows take ``loss`` and the
replayed rows ``replay_loss`` in the same compiled step (masks, no branch per
batch), and the same forward pass gives the importance ratios pi_theta / mu and
ESS per cycle (``fresh_*`` / ``replay_*``).

Parity metric: ``logprob_gap_max`` = max |log pi_theta - log mu| over masked
tokens, computed in the forward passes of this step, i.e. under the params
*before* the update. For tokens sampled by the current version it measures
engine/learner numerical agreement (should be float rounding);
``logprob_gap_max_current`` restricts it to those tokens and
``logprob_gap_max_off_policy`` to the others (sampled by older versions). On the
current version's tokens the step also reports their mean gap, the k3 estimate of
KL(μ‖π), the correlation of the two probabilities and the sampling-set misses
(``algorithms.consistency``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.algorithms.aggregation import aggregate, batch_normalizers
from jaxflash.algorithms.consistency import consistency_metrics, consistency_sums
from jaxflash.algorithms.kl import kl_k3
from jaxflash.learner import cycles
from jaxflash.learner.batching import ROUTES_FIELD
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.device_batch import DeviceBatch, batch_sharding, device_batch, mesh_context
from jaxflash.learner.optimizer import make_optimizer, make_schedule
from jaxflash.learner.packing import sequence_count
from jaxflash.learner.scoring import policy_logprobs, prefix_sharing_model
from jaxflash.learner.state import TrainState, state_shardings
from jaxflash.models.adapters import lora as lora_lib
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.moe import expert_load, load_balancing_loss
from jaxflash.sharding.rules import Rules
from jaxflash.types import TrainBatch

# Per-micro-batch means of the policy loss metrics, recombined weighted by tokens.
_MEAN_METRICS = (
    "ratio_mean",
    "clip_frac",
    "clip_frac_low",
    "clip_frac_high",
    "masked_frac",
    "is_truncated_frac",  # tis, seq_tis (only when the loss reports them)
    "is_weight_mean",  # rollout corrections (algorithms.rollout_correction)
)


def _batch_expert_load(params: Any, batch: DeviceBatch, mc: ModelConfig, lc: LearnerConfig):
    """float32 [E] top-k assignments over the whole batch's loss-masked tokens (a
    forward pass per micro-batch, no gradient)."""

    def one(mb):
        router_lbte = policy_logprobs(params, mb, mc, lc, router=True)[-1].logits_lbte
        return expert_load(router_lbte, mb["loss_mask_bt"] > 0, mc.n_experts_per_token)

    return jnp.sum(jax.lax.map(one, batch), axis=0)


def make_loss_fn(model_config: ModelConfig, learner_config: LearnerConfig) -> Callable:
    """Loss of one micro-batch, normalised by whole-batch counts.

    Returns:
      ``loss_fn(params, ref_params, mb, num_tokens, num_sequences, version,
      expert_load_e=None, base=None) -> (loss, aux)``: ``mb`` holds TrainBatch fields
      [b, T]; ``num_tokens`` / ``num_sequences`` are float32 scalars of the *whole*
      batch; ``version`` is the int32 learner step (the policy version of ``params``);
      ``expert_load_e`` the whole batch's float32 [E] expert loads (router aux loss;
      None: this micro-batch is the whole batch); under LoRA ``params`` are the
      adapters and ``base`` the frozen base (also the KL reference; ``ref_params`` is
      then None). ``loss`` is this micro-batch's share of the batch loss (shares sum to
      the batch loss); ``aux`` holds sums / maxima that ``train_step`` combines into
      metrics.

    Raises:
      ValueError: ``router_aux_loss_coef`` > 0 for a model without experts.
    """
    mc, lc = model_config, learner_config
    use_router = lc.router_aux_loss_coef > 0
    if use_router and not mc.is_moe:
        raise ValueError(
            f"LearnerConfig.router_aux_loss_coef={lc.router_aux_loss_coef} needs a model "
            "with experts (ModelConfig.n_experts > 0)"
        )
    if lc.router_replay and not mc.is_moe:
        raise ValueError("LearnerConfig.router_replay needs a model with experts (n_experts > 0)")
    policy_term = cycles.make_policy_term(lc)

    def agg(x_bt, mask_bt, n_tok, n_seq):
        return aggregate(
            x_bt,
            mask_bt,
            lc.aggregation,
            num_tokens=n_tok,
            num_sequences=n_seq,
            max_tokens=lc.aggregation_max_tokens,
        )

    def loss_fn(
        params, ref_params, mb, num_tokens, num_sequences, version, expert_load_e=None, base=None
    ):
        mask_bt = mb["loss_mask_bt"]
        valid_bt = mask_bt > 0
        if base is not None:  # LoRA: the base stays out of the differentiated argument
            ref_params = base  # the KL reference: the base without adapters (no copy)
            params = lora_lib.merge(base, params)
        logp_bt, ent_bt, *full_bt, routing = policy_logprobs(
            params, mb, mc, lc, full_vocab=lc.uses_reference, router=use_router, loss_only=True
        )
        mu_bt = mb["behaviour_logp_bt"]
        cycle_bt = mb.get("cycle_bt")  # read only with a replay loss (a dict may lack it)
        pg_bt, m = policy_term(logp_bt, mu_bt, mb["advantages_bt"], mask_bt, cycle_bt)
        pg_loss = agg(pg_bt, mask_bt, num_tokens, num_sequences)
        loss = pg_loss
        if lc.entropy_coef > 0:
            loss = loss - lc.entropy_coef * agg(ent_bt, mask_bt, num_tokens, num_sequences)
        kl_sum = jnp.zeros((), jnp.float32)
        if lc.uses_reference:
            # KL between the tempered full-vocabulary distributions (finite even for
            # a token outside the reference's top-p nucleus; algorithms.distributions).
            # Scored like the policy (loss chunks only), so equal params give equal logp.
            ref = jax.lax.stop_gradient(ref_params)
            ref_full_bt = policy_logprobs(ref, mb, mc, lc, True, loss_only=True)[2]
            kl_bt = kl_k3(full_bt[0], ref_full_bt, mask_bt)
            loss = loss + lc.kl_coef * agg(kl_bt, mask_bt, num_tokens, num_sequences)
            kl_sum = jnp.sum(jnp.where(valid_bt, kl_bt, 0.0))
        router_aux = {}
        if use_router:  # this micro-batch's share of the whole batch's loss
            aux_loss = load_balancing_loss(
                routing.logits_lbte,
                valid_bt,
                mc.n_experts_per_token,
                load_e=expert_load_e,
                num_rows=mc.n_layers * num_tokens,
            )
            loss = loss + lc.router_aux_loss_coef * aux_loss
            router_aux["router_aux_loss"] = jax.lax.stop_gradient(aux_loss)
        sg = jax.lax.stop_gradient
        gap_bt = jnp.where(valid_bt, jnp.abs(sg(logp_bt) - mu_bt), 0.0)
        current_bt = valid_bt & (mb["token_versions_bt"] == version)
        n = m["num_tokens"]
        aux = {
            "pg_loss": sg(pg_loss),
            "entropy_sum": sg(jnp.sum(jnp.where(valid_bt, ent_bt, 0.0))),
            "kl_sum": sg(kl_sum),
            "logprob_gap_max": jnp.max(gap_bt),
            "logprob_gap_max_current": jnp.max(jnp.where(current_bt, gap_bt, 0.0)),
            "logprob_gap_max_off_policy": jnp.max(jnp.where(current_bt, 0.0, gap_bt)),
            "current_tokens": jnp.sum(current_bt).astype(jnp.float32),
            **consistency_sums(logp_bt, mu_bt, current_bt),
            "ratio_max": jnp.where(n > 0, m["ratio_max"], -jnp.inf),
            "ratio_min": jnp.where(n > 0, m["ratio_min"], jnp.inf),
            "nonfinite_count": m["nonfinite_count"],
            **{f"{k}_sum": m[k] * n for k in _MEAN_METRICS if k in m},
            **router_aux,
        }
        if ROUTES_FIELD in mb:  # engine vs learner routing, (token, layer) decisions
            aux["router_mismatch_sum"] = routing.mismatch_bt.sum()
            aux["router_compared_sum"] = routing.compared_bt.sum()
            aux["router_mismatch_current_sum"] = jnp.where(current_bt, routing.mismatch_bt, 0).sum()
            aux["router_compared_current_sum"] = jnp.where(current_bt, routing.compared_bt, 0).sum()
        if lc.dual_cycle:  # per-cycle loss metrics and ratio stats, from this forward pass
            aux.update(cycles.loss_aux(m))
            aux.update(cycles.importance_sums(logp_bt, mu_bt, mask_bt, cycle_bt))
        return loss, aux

    return loss_fn


def _combine(key: str) -> Callable:
    """How a micro-batch aux entry folds into the batch's: by its name."""
    if key.endswith("_lse"):
        return jnp.logaddexp  # log of a sum over rows of all micro-batches
    return jnp.maximum if "_max" in key else jnp.minimum if "_min" in key else jnp.add


def _identity(key: str) -> float:
    """The neutral start of ``_combine(key)``."""
    if key.endswith("_lse"):
        return -jnp.inf
    return -jnp.inf if "_max" in key else jnp.inf if "_min" in key else 0.0


def make_grad_fn(
    model_config: ModelConfig, learner_config: LearnerConfig, *, grad_shardings: Any = None
) -> Callable:
    """Gradient of the whole batch, accumulated over micro-batches (not jitted).

    Gradients accumulate in float32 (also for bfloat16 params), laid out per
    ``grad_shardings`` (the params' shardings) when given, so the accumulator is
    sharded like the params (FSDP) rather than wherever propagation puts it.

    Returns:
      ``grad_fn(params, ref_params, batch, version, base=None) -> (loss, grads,
      metrics)`` (``base``: the frozen LoRA base, see ``make_loss_fn``) for ``batch``
      a dict of TrainBatch fields [M, b, T]. ``loss`` and ``grads``
      are those of the whole batch (independent of M up to float summation
      order); metrics as documented on ``make_train_step``.
    """
    loss_fn = make_loss_fn(model_config, learner_config)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def grad_fn(params, ref_params, batch, version, base=None):
        num_tokens, num_sequences = batch_normalizers(batch["loss_mask_bt"])
        if learner_config.packing:  # sequences are segments, not rows
            num_sequences = sequence_count(batch["loss_mask_bt"], batch["segment_ids_bt"])
        load_e = None  # one micro-batch: its own expert loads are the batch's
        if learner_config.router_aux_loss_coef > 0 and batch["input_ids_bt"].shape[0] > 1:
            full = params if base is None else lora_lib.merge(base, params)
            load_e = _batch_expert_load(full, batch, model_config, learner_config)

        def body(carry, mb):
            loss_acc, grads_acc, aux_acc = carry
            (loss, aux), grads = value_and_grad(
                params, ref_params, mb, num_tokens, num_sequences, version, load_e, base
            )
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            aux_acc = {k: _combine(k)(aux_acc[k], v) for k, v in aux.items()}
            return (loss_acc + loss, grads_acc, aux_acc), None

        first = jax.tree.map(lambda x: x[0], batch)
        aux_shape = jax.eval_shape(
            lambda: loss_fn(
                params, ref_params, first, num_tokens, num_sequences, version, load_e, base
            )[1]
        )
        aux0 = {k: jnp.full(s.shape, _identity(k), s.dtype) for k, s in aux_shape.items()}
        grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if grad_shardings is not None:
            grads0 = jax.lax.with_sharding_constraint(grads0, grad_shardings)
        (loss, grads, aux), _ = jax.lax.scan(
            body, (jnp.zeros((), jnp.float32), grads0, aux0), batch
        )
        denom = jnp.maximum(num_tokens, 1.0)
        any_tok = num_tokens > 0
        metrics = {
            "loss": loss,
            "pg_loss": aux["pg_loss"],
            "entropy": aux["entropy_sum"] / denom,
            "kl": aux["kl_sum"] / denom,
            "logprob_gap_max": jnp.where(any_tok, aux["logprob_gap_max"], 0.0),
            "logprob_gap_max_current": jnp.maximum(aux["logprob_gap_max_current"], 0.0),
            "logprob_gap_max_off_policy": jnp.maximum(aux["logprob_gap_max_off_policy"], 0.0),
            "current_tokens": aux["current_tokens"],
            **consistency_metrics(aux, aux["current_tokens"]),
            "ratio_max": jnp.where(any_tok, aux["ratio_max"], 0.0),
            "ratio_min": jnp.where(any_tok, aux["ratio_min"], 0.0),
            "nonfinite_count": aux["nonfinite_count"],
            "tokens": num_tokens,
            "sequences": num_sequences,
            **{k: aux[f"{k}_sum"] / denom for k in _MEAN_METRICS if f"{k}_sum" in aux},
        }
        if "router_aux_loss" in aux:  # the sum of micro-batch shares: the batch's value
            metrics["router_aux_loss"] = aux["router_aux_loss"]
        if "router_mismatch_sum" in aux:
            for suffix, name in (
                ("", "router_mismatch_frac"),
                ("_current", "router_mismatch_on_policy_frac"),
            ):
                compared = aux[f"router_compared{suffix}_sum"]
                metrics[name] = aux[f"router_mismatch{suffix}_sum"] / jnp.maximum(compared, 1.0)
        if learner_config.dual_cycle:
            metrics.update(cycles.loss_metrics(aux))
            metrics.update(cycles.importance_metrics(aux))
        return loss, grads, metrics

    return grad_fn


class TrainStep:
    """Callable ``train_step(state, batch) -> (state, metrics)`` (see ``make_train_step``)."""

    def __init__(self, jitted: Callable, mc: ModelConfig, lc: LearnerConfig, sharding, mesh):
        self._jitted = jitted
        self._mc, self._lc = mc, lc
        self._sharding = sharding
        self._mesh = mesh
        self.trace_count = 0  # incremented at trace time: a test asserts it stays 1

    def __call__(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
        on_devices = device_batch(batch, self._lc, self._sharding)
        with mesh_context(self._mesh, self._mc):
            return self._jitted(state, on_devices)


def make_train_step(
    model_config: ModelConfig, learner_config: LearnerConfig, mesh: Mesh, rules: Rules
) -> TrainStep:
    """Build the jitted learner step.

    Args:
      model_config, learner_config: static configuration (closed over).
      mesh: learner mesh; rules: logical-axis rules (``LEARNER_RULES``).

    Returns:
      ``train_step(state, batch) -> (state, metrics)``. ``batch`` is a host
      TrainBatch [B, T] (split into micro-batches of ``micro_batch_size``, padding
      with empty rows) or already [M, b, T]. ``state`` is donated: do not use it
      after the call. Compiles once per distinct (M, T).
      metrics (float32 scalars, replicated): loss, pg_loss, grad_norm (before
      clipping), lr (used for this update), entropy and kl (token means), clip_frac
      (+ _low/_high), ratio_mean/max/min, masked_frac, nonfinite_count,
      logprob_gap_max (+ _current, _off_policy, current_tokens), tokens, sequences,
      and on current-version tokens ``algorithms.consistency.consistency_metrics``;
      with ``router_aux_loss_coef`` > 0 also router_aux_loss (the unweighted
      load-balancing loss of the batch); for a MoE batch with the engine's routes
      also router_mismatch_frac (share of (token, layer) routing decisions whose
      top-k expert set differs between the engine's record and the learner's live
      router, over every token with a recorded route, prompt included) and
      router_mismatch_on_policy_frac (over loss tokens sampled by this version);
      under ``router_replay`` it counts what replay overrode;
      with ``replay_loss`` also, per cycle c in fresh / replay, c_ratio_mean / _max /
      _min, c_ess_token, c_ess_seq, c_ratio_tokens, c_sequences (importance ratios
      pi_theta / mu, ``learner.cycles.importance_metrics``) and c_pg_<name> (each
      cycle's own loss metrics). Compiles once whatever the mix of fresh and
      replayed rows.

    Raises:
      ValueError: (at call time) a batch whose shapes are inconsistent.
    """
    # A refused prefix-sharing layout fails here, at start-up, not at the first step.
    prefix_sharing_model(model_config, learner_config, mesh.devices.flat[0].platform)
    optimizer = make_optimizer(learner_config)
    schedule = make_schedule(learner_config)
    s_shard = state_shardings(model_config, learner_config, mesh, rules)
    grad_fn = make_grad_fn(model_config, learner_config, grad_shardings=s_shard.params)
    b_shard = batch_sharding(mesh, rules, learner_config.micro_batch_size)
    replicated = NamedSharding(mesh, PartitionSpec())
    step_obj: TrainStep

    def train_step(state: TrainState, batch: DeviceBatch) -> tuple[TrainState, dict]:
        step_obj.trace_count += 1  # Python side effect: runs only while tracing
        loss, grads, metrics = grad_fn(
            state.params, state.ref_params, batch, state.step, state.base
        )
        grad_norm = optax.tree.norm(grads)  # of the float32 accumulator
        # Back to the params' dtype so optimizer state dtypes (and so the traced
        # signature) stay fixed across steps for bfloat16 params.
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            **metrics,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    jitted = jax.jit(
        train_step,
        in_shardings=(s_shard, b_shard),
        out_shardings=(s_shard, replicated),
        donate_argnums=(0,),
    )
    step_obj = TrainStep(jitted, model_config, learner_config, b_shard, mesh)
    return step_obj
