"""Weight-only quantization of frozen weights (the QLoRA base, ``models.adapters.lora``).

Symmetric int8 (one scale per output channel) or int4 (one scale per group of
``group_size`` consecutive inputs and output channel), arXiv 2305.14314 section 2
without the NF4 code book: w ≈ q · scale, q = round(w / scale) in [-qmax, qmax],
scale = max|w| / qmax over the group. A ``QArray`` is a pytree node whose ``astype``
dequantises, so code that casts weights to the compute dtype dequantises on the fly.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class QArray:
    """A quantized weight: ``q`` int8/int4 [(L,) *in, *out] and ``scale`` float32
    [(L,) G, *out], G groups along the flattened input axes; w ≈ q · scale.

    ``astype(dtype)`` dequantises (what the decoder's ``w.astype(cd)`` calls).
    """

    q: Any
    scale: Any
    n_out: int = flax.struct.field(pytree_node=False, default=1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    def astype(self, dtype: Any) -> jax.Array:
        return dequantize(self).astype(dtype)


def quantize(w: jax.Array, *, n_out: int, n_lead: int, bits: int, group_size: int) -> QArray:
    """Symmetric quantization of ``w`` [*lead, *in, *out] to ``bits`` (8 or 4).

    int8: one scale per output channel (G = 1). int4: one per ``group_size``
    consecutive inputs (of the flattened input axes) and output channel.
    scale = max|w| / qmax over each group, q = round(w / scale) in [-qmax, qmax].

    Raises:
      ValueError: group_size does not divide the weight's input size (naming both).
    """
    lead, out = w.shape[:n_lead], w.shape[w.ndim - n_out :]
    n_in = math.prod(w.shape[n_lead : w.ndim - n_out])
    group = n_in if bits == 8 else group_size
    if n_in % group:
        raise ValueError(
            f"LearnerConfig.lora.group_size={group} must divide the weight's input size {n_in}"
        )
    qmax = 127.0 if bits == 8 else 7.0
    w_g = w.astype(jnp.float32).reshape(*lead, n_in // group, group, *out)
    scale = jnp.max(jnp.abs(w_g), axis=n_lead + 1) / qmax
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w_g / jnp.expand_dims(scale, n_lead + 1)), -qmax, qmax)
    q = q.reshape(w.shape).astype(jnp.int8 if bits == 8 else jnp.int4)
    return QArray(q=q, scale=scale, n_out=n_out)


def dequantize(x: QArray) -> jax.Array:
    """float32 [(L,) *in, *out] from a ``QArray``."""
    q, scale = x.q, x.scale
    n_lead = scale.ndim - 1 - x.n_out
    lead, out = q.shape[:n_lead], q.shape[q.ndim - x.n_out :]
    n_in = math.prod(q.shape[n_lead : q.ndim - x.n_out])
    groups = scale.shape[n_lead]
    q_g = q.astype(jnp.float32).reshape(*lead, groups, n_in // groups, *out)
    return (q_g * jnp.expand_dims(scale.astype(jnp.float32), n_lead + 1)).reshape(q.shape)
