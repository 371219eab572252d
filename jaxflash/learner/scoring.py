"""Per-token log-probabilities of a policy: the learner's forward pass, scored.

``policy_logprobs`` is one micro-batch's forward pass -> log q(target) and entropy
under the processed sampling distribution (temperature / top-k / top-p, the q the
engine sampled from; ``models.decoder.logprobs``), shared by the train step's loss
(``learner.step``) and ``make_logprob_fn``, the jitted scorer of whole batches
(proximal logprobs, evaluation, parity checks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxflash.learner.batching import ROUTES_FIELD
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.device_batch import (
    DeviceBatch,
    batch_sharding,
    mesh_context,
    one_per_row,
    to_device_batch,
)
from jaxflash.learner.packing import pack_rows, unpack_rows
from jaxflash.learner.state import param_shardings
from jaxflash.models.adapters import lora as lora_lib
from jaxflash.models.caches import attention
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.decoder.moe import route_mismatch
from jaxflash.models.decoder.transformer import (
    forward,
    forward_routed,
    lora_model_layout,
    unembed,
)
from jaxflash.sharding.rules import Rules
from jaxflash.types import TrainBatch


class Routing(NamedTuple):
    """A MoE forward's routing, as the loss and the step metrics read it.

    Attributes:
      logits_lbte: float32 [L, b, T, E] router logits (the load-balancing loss).
      mismatch_bt: float32 [b, T] layers whose live top-k expert set differs from the
        engine's recorded one (``moe.route_mismatch``); 0 without recorded routes.
      compared_bt: float32 [b, T] layers with a recorded route to compare.
    """

    logits_lbte: jax.Array
    mismatch_bt: jax.Array
    compared_bt: jax.Array


def prefix_sharing_model(mc: ModelConfig, lc: LearnerConfig, platform: str) -> ModelConfig:
    """The model config the learner runs under ``lc.prefix_sharing``
    (``packing.pack_groups``): ``mc`` itself, or with ``attention="blockwise"`` where
    "auto" resolves to the splash kernel on ``platform`` (a TPU), whose segment ids
    compare by equality only and so cannot show a group's shared prompt to its samples.

    Raises:
      ValueError: a model with a sliding window (the window is measured in columns,
        and a later sample sits farther from its shared prompt in columns than in
        positions, so it would lose prompt keys it sees unpacked), or
        ``model.attention="splash"`` set explicitly.
    """
    if not lc.prefix_sharing:
        return mc
    if mc.sliding_window is not None:
        raise ValueError(
            "LearnerConfig.prefix_sharing with a sliding-window model (sliding_window="
            f"{mc.sliding_window}): the window counts packed columns, and a group's later "
            "samples sit farther from their shared prompt than their positions say; set "
            "learner.prefix_sharing=False"
        )
    if attention.resolve(mc.attention, platform, mc.sliding_window) != "splash":
        return mc
    if mc.attention == "splash":
        raise ValueError(
            "LearnerConfig.prefix_sharing needs model.attention 'auto', 'blockwise', "
            "'dense' or 'dot_product': the splash kernel cannot show a group's shared "
            "prompt to its samples (model.attention='splash')"
        )
    return dataclasses.replace(mc, attention="blockwise")


def policy_logprobs(
    params: Any,
    mb: DeviceBatch,
    mc: ModelConfig,
    lc: LearnerConfig,
    full_vocab=False,
    router=False,
    loss_only=False,
):
    """One micro-batch's forward pass scored under the sampling distribution.

    A MoE model's forward replays the batch's recorded routes under
    ``lc.router_replay`` (``models.decoder.transformer.forward_routed``).

    Args:
      params: the whole model's params (under LoRA: merged with the base).
      mb: TrainBatch fields [b, T] (``segment_ids_bt`` read under ``learner.packing``;
        ``routed_experts_btlk`` [b, T, L, k] where the engine recorded routes).
      full_vocab: also return the tempered full-vocabulary log-prob of each target
        (what KL terms use); router: also return the routing (a MoE model).
      loss_only: score only the logit chunks that hold a ``loss_mask_bt`` position
        (``target_logprobs``' ``loss_mask_bt``): outputs elsewhere read 0. The loss
        uses it; scorers that return every position do not.

    Returns:
      (logp_bt, entropy_bt[, full_logp_bt], ``Routing`` or None), float32 [b, T] each
      (``models.decoder.logprobs.target_logprobs``). The routing comes with
      ``router`` or recorded routes, else None.

    Raises:
      ValueError: ``lc.router_replay`` for a dense model or a batch without routes.
    """
    ids_bt, pos_bt = mb["input_ids_bt"], mb["positions_bt"]
    seg = {"segment_ids_bt": mb["segment_ids_bt"]} if lc.packing else {}  # packed rows
    mc = prefix_sharing_model(mc, lc, attention.current_platform())  # "auto": not splash
    recorded = mb.get(ROUTES_FIELD)
    if lc.router_replay and (not mc.is_moe or recorded is None):
        raise ValueError(
            "LearnerConfig.router_replay needs a model with experts and batches with "
            f"routes ({ROUTES_FIELD}, from the engine's samples); got n_experts="
            f"{mc.n_experts}, routes {'present' if recorded is not None else 'absent'}"
        )
    routing = None
    if mc.is_moe and (router or recorded is not None):
        replay = recorded if lc.router_replay else None
        h_btd, _, logits_lbte, live_btlk = forward_routed(
            params, mc, ids_bt, pos_bt, replay_btlk=replay, **seg
        )
        if recorded is None:
            zeros = jnp.zeros(ids_bt.shape, jnp.float32)
            routing = Routing(logits_lbte, zeros, zeros)
        else:
            mismatch_btl, compared_btl = route_mismatch(live_btlk, recorded)
            routing = Routing(logits_lbte, mismatch_btl.sum(-1), compared_btl.sum(-1))
    else:
        h_btd, _ = forward(params, mc, ids_bt, pos_bt, **seg)
    return *target_logprobs(
        h_btd,
        unembed(params, mc),
        mb["target_ids_bt"],
        temperature=lc.sampling.temperature,
        top_k=lc.sampling.top_k,
        top_p=lc.sampling.top_p,
        chunk=lc.logprob_chunk,
        valid_vocab_size=mc.valid_vocab_size,  # padded ids: outside q, as in the engine
        full_vocab=full_vocab,  # + tempered full-vocabulary logp, what KL terms use
        exact=mc.exact_numerics,  # the engine's row blocks (models.caches.exact)
        loss_mask_bt=mb["loss_mask_bt"] if loss_only else None,  # skip prompt-only chunks
    ), routing


def make_logprob_fn(
    model_config: ModelConfig, learner_config: LearnerConfig, mesh: Mesh, rules: Rules
) -> Callable[[Any, TrainBatch], tuple[np.ndarray, np.ndarray]]:
    """Jitted per-token log q(target) and entropy of a batch under given params.

    For proximal logprobs or evaluation. Scores the processed sampling
    distribution of ``learner_config.sampling`` (same as the train step).

    Returns:
      ``logprob_fn(params, batch) -> (logp_bt, entropy_bt)``: ``params`` on the
      learner shardings (under LoRA the whole model, ``lora.merge(state.base,
      state.params)``); ``batch`` a host TrainBatch [B, T]; outputs numpy float32
      [B, T] (masked positions hold whatever the model gives; apply the mask).
    """
    mc, lc = model_config, learner_config
    prefix_sharing_model(mc, lc, mesh.devices.flat[0].platform)  # refused at build
    b_shard = batch_sharding(mesh, rules, lc.micro_batch_size)
    if lc.lora is None:
        p_shard = param_shardings(mc, mesh, rules)
    else:
        p_shard = lora_lib.layout_shardings(*reversed(lora_model_layout(mc, lc.lora)), mesh, rules)

    def fn(params, batch):
        return jax.lax.map(lambda mb: policy_logprobs(params, mb, mc, lc)[:2], batch)

    jitted = jax.jit(fn, in_shardings=(p_shard, b_shard))

    def logprob_fn(params: Any, batch: TrainBatch) -> tuple[np.ndarray, np.ndarray]:
        B, T = np.shape(batch.input_ids_bt)
        placement = None
        if lc.packing and one_per_row(batch):  # scored packed, returned unpacked
            batch, placement = pack_rows(batch, row_length=lc.pack_length)
        rows, length = np.shape(batch.input_ids_bt)
        device_batch = to_device_batch(batch, lc.micro_batch_size, b_shard, dual_cycle=True)
        with mesh_context(mesh, mc):
            logp_mbt, ent_mbt = jax.device_get(jitted(params, device_batch))
        out = [np.asarray(x).reshape(-1, length)[:rows] for x in (logp_mbt, ent_mbt)]
        if placement is not None:
            out = [unpack_rows(x, placement, (B, T)) for x in out]
        return out[0], out[1]

    return logprob_fn
