"""Optax AdamW with warmup + constant/cosine schedule and global-norm clipping."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxflash.learner.config import LearnerConfig


def make_schedule(config: LearnerConfig) -> optax.Schedule:
    """Learning rate as a function of the optimiser step count.

    Linear warmup from 0 to ``lr`` over ``warmup_steps`` (step 0 gets lr/warmup
    when warmup > 0, so the first update is not a no-op), then either constant
    or a cosine decay to ``lr * min_lr_ratio`` at ``total_steps``.

    Args:
      config: the learner config.

    Returns:
      optax schedule: int step -> float learning rate.
    """
    lr = config.lr
    warmup = config.warmup_steps
    if config.schedule == "constant":
        after = optax.constant_schedule(lr)
    else:
        after = optax.cosine_decay_schedule(
            init_value=lr,
            decay_steps=config.total_steps - warmup,
            alpha=config.min_lr_ratio,
        )
    if warmup == 0:
        return after
    # Start at lr/warmup rather than 0: an update with lr 0 wastes a rollout.
    ramp = optax.linear_schedule(lr / warmup, lr, warmup - 1) if warmup > 1 else None
    if ramp is None:
        return optax.join_schedules([optax.constant_schedule(lr), after], [1])
    return optax.join_schedules([ramp, after], [warmup])


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: matrices, not norms or biases.

    Layer-stacked norms (``attn_norm_ld``) are 2-D, so the test is by name:
    leaves whose key contains "norm" or starts with "b_" are not decayed.

    Args:
      params: pytree of arrays keyed by strings (nested dict or nnx.State).

    Returns:
      pytree of bools with the same structure.
    """

    def keep(path: tuple, _leaf: Any) -> bool:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return not any("norm" in n or n.startswith("b_") for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


_OPTIMIZERS: dict[str, optax.GradientTransformation] = {}


def make_optimizer(config: LearnerConfig) -> optax.GradientTransformation:
    """AdamW (arXiv 1711.05101) with global-norm clipping first.

    Built once per learner config: the state's init, the state shardings and the
    train step all get the same object (a GradientTransformation is a pair of pure
    functions, so sharing it is safe), keyed by the config's full repr (a frozen
    dataclass with dict fields, so not hashable itself).

    Args:
      config: learner config (lr, schedule, b1, b2, eps, weight_decay, grad_clip_norm).

    Returns:
      optax.GradientTransformation; its state is a pytree of arrays shaped like params.
    """
    key = repr(config)
    if key not in _OPTIMIZERS:
        _OPTIMIZERS[key] = _build_optimizer(config)
    return _OPTIMIZERS[key]


def _build_optimizer(config: LearnerConfig) -> optax.GradientTransformation:
    parts = []
    if config.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(config.grad_clip_norm))
    parts.append(
        optax.adamw(
            learning_rate=make_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
