"""TrainState: the learner's whole mutable state as one sharded pytree.

Params are born sharded (big_vision style): ``jax.eval_shape`` of the init gives
the layout, ``jaxflash.sharding`` rules turn the model's logical axes into
NamedShardings on the learner mesh, and ``jax.jit(init, out_shardings=...)``
creates every array directly in its shards — no full copy on one device first.
Optimizer moments take their parameter's sharding; scalar counters are replicated.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.optimizer import make_optimizer
from jaxflash.models.adapters import lora as lora_lib
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.params import check_params
from jaxflash.models.decoder.transformer import abstract_params, init_params, logical_axes
from jaxflash.sharding.rules import Rules, logical_to_shardings


@flax.struct.dataclass
class TrainState:
    """Everything a learner step reads and writes (a pytree; checkpointed whole).

    Attributes:
      step: int32 scalar, optimiser steps taken; the policy version of ``params``.
      params: nested dict of arrays (models CONTRACTS layout), learner-sharded.
      opt_state: optax state of ``make_optimizer(learner_config)``.
      rng: uint32 [2] base PRNG key; per-step keys are ``fold_in(rng, step)``.
      ref_params: frozen reference params for the KL penalty, or None when
        ``kl_coef == 0`` (then no reference copy is held at all) and under LoRA.
      base: under LoRA (``learner_config.lora``), the frozen base as stored
        (bfloat16 / int8 / int4 per ``lora.base_dtype``); ``params`` are then the
        adapters only (``models.adapters.lora``), and the KL reference is this base. None
        otherwise.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    ref_params: Any = None
    base: Any = None


def param_shardings(model_config: ModelConfig, mesh: Mesh, rules: Rules) -> Any:
    """NamedSharding per parameter from the model's logical axes and ``rules``."""
    return logical_to_shardings(
        logical_axes(model_config), mesh, rules, shapes=abstract_params(model_config)
    )


def _lora_shardings(model_config: ModelConfig, lora: Any, mesh: Mesh, rules: Rules):
    """(adapter shardings, stored-base shardings) on the learner mesh."""
    a_shapes, a_axes = lora_lib.adapter_layout(model_config, lora)
    b_shapes, b_axes = lora_lib.base_layout(
        abstract_params(model_config), logical_axes(model_config), lora
    )
    return (
        lora_lib.layout_shardings(a_axes, a_shapes, mesh, rules),
        lora_lib.layout_shardings(b_axes, b_shapes, mesh, rules),
    )


def _trainable_abstract(model_config: ModelConfig, learner_config: LearnerConfig) -> Any:
    if learner_config.lora is None:
        return abstract_params(model_config)
    return lora_lib.adapter_layout(model_config, learner_config.lora)[0]


def _build(
    params: Any, learner_config: LearnerConfig, seed: int, ref_params: Any, base: Any = None
) -> TrainState:
    opt = make_optimizer(learner_config)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt.init(params),
        rng=jax.random.PRNGKey(seed),
        ref_params=ref_params,
        base=base,
    )


def state_shardings(
    model_config: ModelConfig, learner_config: LearnerConfig, mesh: Mesh, rules: Rules
) -> TrainState:
    """TrainState of NamedShardings: params per rules, moments like their params.

    Args:
      model_config, learner_config: what the state holds.
      mesh: learner mesh (``jaxflash.sharding.mesh.make_mesh``).
      rules: logical-axis rules (``LEARNER_RULES``).

    Returns:
      TrainState whose leaves are NamedSharding on ``mesh``.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    lora = learner_config.lora
    if lora is None:
        p_shard, base_shard = param_shardings(model_config, mesh, rules), None
    else:
        p_shard, base_shard = _lora_shardings(model_config, lora, mesh, rules)
    opt = make_optimizer(learner_config)
    abstract = _trainable_abstract(model_config, learner_config)
    opt_abstract = jax.eval_shape(opt.init, abstract)
    # Moments (mu, nu) mirror params and take their shardings; counters are
    # replicated scalars.
    opt_shard = optax.tree_map_params(
        opt,
        lambda _leaf, sh: sh,
        opt_abstract,
        p_shard,
        transform_non_params=lambda _leaf: replicated,
    )
    return TrainState(
        step=replicated,
        params=p_shard,
        opt_state=opt_shard,
        rng=replicated,
        ref_params=p_shard if learner_config.uses_reference and lora is None else None,
        base=base_shard,
    )


def abstract_train_state(
    model_config: ModelConfig, learner_config: LearnerConfig, mesh: Mesh, rules: Rules
) -> TrainState:
    """TrainState of ``jax.ShapeDtypeStruct`` carrying target shardings.

    What checkpoint restore needs to place a saved state onto ``mesh`` (which
    may differ from the mesh it was saved from).
    """
    shardings = state_shardings(model_config, learner_config, mesh, rules)
    lora = learner_config.lora
    base = None
    if lora is not None:
        base = lora_lib.base_layout(
            abstract_params(model_config), logical_axes(model_config), lora
        )[0]
    shapes = jax.eval_shape(
        lambda: _build(
            _trainable_abstract(model_config, learner_config),
            learner_config,
            0,
            abstract_params(model_config)
            if learner_config.uses_reference and lora is None
            else None,
            base,
        )
    )
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def create_train_state(
    model_config: ModelConfig,
    learner_config: LearnerConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    seed: int = 0,
) -> TrainState:
    """A freshly initialised TrainState, born sharded on ``mesh``.

    Args:
      model_config: model shape; params from ``init_params(model_config, seed)``.
      learner_config: optimizer and whether a KL reference is held (then the
        reference is a copy of the initial params).
      mesh: learner mesh.
      rules: logical-axis rules (``LEARNER_RULES``).
      seed: params init seed and base PRNG key.

    Returns:
      TrainState with step 0; every leaf is placed per ``state_shardings``.
    """
    shardings = state_shardings(model_config, learner_config, mesh, rules)

    def init() -> TrainState:
        params = init_params(model_config, seed)
        if learner_config.lora is not None:
            return _lora_build(params, model_config, learner_config, seed)
        ref = params if learner_config.uses_reference else None
        return _build(params, learner_config, seed, ref)

    return jax.jit(init, out_shardings=shardings)()


def _lora_build(
    params: Any, model_config: ModelConfig, learner_config: LearnerConfig, seed: int
) -> TrainState:
    """The LoRA state: base stored per ``lora.base_dtype``, fresh adapters (traceable)."""
    lora = learner_config.lora
    base = lora_lib.quantize_base(params, lora)
    # Adapter init draws from its own stream: the run's base key stays fold_in(seed, step).
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 0x10A)
    adapters = lora_lib.init_adapters(model_config, lora, key)
    return _build(adapters, learner_config, seed, None, base)


def from_params(
    params: Any,
    model_config: ModelConfig,
    learner_config: LearnerConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    seed: int = 0,
    ref_params: Any = None,
) -> TrainState:
    """A TrainState around imported weights (GGUF / HF), placed on the learner mesh.

    Args:
      params: nested dict of numpy or jax arrays in the models CONTRACTS layout,
        dtypes matching ``model_config.param_dtype``.
      model_config, learner_config, mesh, rules, seed: as in ``create_train_state``.
      ref_params: reference weights for the KL penalty; defaults to ``params``
        when ``learner_config.kl_coef > 0``, ignored (not held) otherwise.

    Returns:
      TrainState with step 0, params put onto their shardings with
      ``jax.device_put``, a fresh optimizer state created sharded.

    Raises:
      ValueError: params (or ref_params) whose paths, shapes or dtypes differ from
        the model's layout (names the path).
    """
    expected = abstract_params(model_config)
    check_params(expected, params)
    shardings = state_shardings(model_config, learner_config, mesh, rules)
    if learner_config.lora is not None:
        # The imported weights pass through the mesh once, sharded like the model,
        # and are stored (cast or quantized) by the same jitted init.
        placed = jax.device_put(params, param_shardings(model_config, mesh, rules))
        return jax.jit(
            lambda p: _lora_build(p, model_config, learner_config, seed), out_shardings=shardings
        )(placed)
    placed = jax.device_put(params, shardings.params)
    ref = None
    if learner_config.uses_reference:
        ref_src = params if ref_params is None else ref_params
        check_params(expected, ref_src, what="ref_params")
        # A separate buffer: the train step donates state, and params and
        # ref_params must not alias one buffer.
        ref = jax.device_put(jax.device_get(ref_src), shardings.ref_params)

    def init(p: Any, r: Any) -> TrainState:
        return _build(p, learner_config, seed, r)

    return jax.jit(init, out_shardings=shardings)(placed, ref)
