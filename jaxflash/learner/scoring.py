"""Per-token log-probabilities of a policy: the learner's forward pass, scored.

``policy_logprobs`` is one micro-batch's forward pass -> log q(target) and entropy
under the processed sampling distribution (temperature / top-k / top-p, the q the
engine sampled from; ``models.decoder.logprobs``), shared by the train step's loss
(``learner.step``) and ``make_logprob_fn``, the jitted scorer of whole batches
(proximal logprobs, evaluation, parity checks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

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
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.models.decoder.transformer import (
    forward,
    forward_with_router_logits,
    lora_model_layout,
    unembed,
)
from jaxflash.sharding.rules import Rules
from jaxflash.types import TrainBatch


def policy_logprobs(
    params: Any, mb: DeviceBatch, mc: ModelConfig, lc: LearnerConfig, full_vocab=False, router=False
):
    """One micro-batch's forward pass scored under the sampling distribution.

    Args:
      params: the whole model's params (under LoRA: merged with the base).
      mb: TrainBatch fields [b, T] (``segment_ids_bt`` read under ``learner.packing``).
      full_vocab: also return the tempered full-vocabulary log-prob of each target
        (what KL terms use); router: also return the router logits.

    Returns:
      (logp_bt, entropy_bt[, full_logp_bt], router logits float32 [L, b, T, E] or
      None), float32 [b, T] each (``models.decoder.logprobs.target_logprobs``).
    """
    ids_bt, pos_bt = mb["input_ids_bt"], mb["positions_bt"]
    seg = {"segment_ids_bt": mb["segment_ids_bt"]} if lc.packing else {}  # packed rows
    if router:
        h_btd, router_lbte = forward_with_router_logits(params, mc, ids_bt, pos_bt, **seg)
    else:
        (h_btd, _), router_lbte = forward(params, mc, ids_bt, pos_bt, **seg), None
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
    ), router_lbte


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
