"""SwiGLU feed-forward block with a hand-written backward pass.

    y = (silu(x W_gate) * (x W_up)) W_down,   silu(g) = g sigmoid(g)

(Shazeer, arXiv 2002.05202.) The forward pass is the same sequence of operations as
the plain ``jnp.einsum`` form (so engine and learner logprobs are unchanged). The
backward pass exists for speed: differentiating the einsums lets XLA on CPU fuse
the SwiGLU derivative with a transpose into the [F, B*T] layout of the weight
gradients' operands, and those transposing loop fusions ran at a few hundred MB/s —
about 16 % of a SmolLM2-135M learner step. Here the weight gradients contract over
tokens with the (small) input transposed once, ``x^T [D, B*T] @ dgate [B*T, F]``,
so the big [B*T, F] derivatives are consumed in the layout they are produced in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def swiglu(x_btd: jax.Array, w_gate_df: jax.Array, w_up_df: jax.Array, w_down_fd: jax.Array):
    """SwiGLU MLP; returns float32 [B, T, D].

    Args:
      x_btd: [B, T, D] normed input, compute dtype.
      w_gate_df, w_up_df: [D, F] in the compute dtype.
      w_down_fd: [F, D] in the compute dtype.

    Returns:
      float32 [B, T, D] (the down projection accumulates in float32).
    """
    gate_btf = jnp.einsum("btd,df->btf", x_btd, w_gate_df)
    up_btf = jnp.einsum("btd,df->btf", x_btd, w_up_df)
    return jnp.einsum(
        "btf,fd->btd", jax.nn.silu(gate_btf) * up_btf, w_down_fd, preferred_element_type=jnp.float32
    )


def _fwd(x_btd, w_gate_df, w_up_df, w_down_fd):
    gate_btf = jnp.einsum("btd,df->btf", x_btd, w_gate_df)
    up_btf = jnp.einsum("btd,df->btf", x_btd, w_up_df)
    y_btd = jnp.einsum(
        "btf,fd->btd", jax.nn.silu(gate_btf) * up_btf, w_down_fd, preferred_element_type=jnp.float32
    )
    return y_btd, (x_btd, gate_btf, up_btf, w_gate_df, w_up_df, w_down_fd)


def _bwd(res, dy_btd):
    x_btd, gate_btf, up_btf, w_gate_df, w_up_df, w_down_fd = res
    cd = x_btd.dtype
    f32 = jnp.float32
    b, t, d = x_btd.shape
    f = gate_btf.shape[-1]
    g = gate_btf.astype(f32)
    u = up_btf.astype(f32)
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    act_nf = (silu * u).astype(cd).reshape(b * t, f)
    dy_nd = dy_btd.astype(cd).reshape(b * t, d)
    d_act = jnp.einsum("nd,fd->nf", dy_nd, w_down_fd, preferred_element_type=f32)
    d_gate_nf = d_act * u.reshape(b * t, f) * (sig * (1.0 + g * (1.0 - sig))).reshape(b * t, f)
    d_up_nf = d_act * silu.reshape(b * t, f)
    d_gate_nf, d_up_nf = d_gate_nf.astype(cd), d_up_nf.astype(cd)
    # The barrier keeps x^T a plain [D, N] array, so both weight gradients are
    # ordinary [D, N] @ [N, F] products (see the module docstring).
    x_dn = jax.lax.optimization_barrier(x_btd.reshape(b * t, d).T)
    dw_gate = jnp.dot(x_dn, d_gate_nf, preferred_element_type=f32)
    dw_up = jnp.dot(x_dn, d_up_nf, preferred_element_type=f32)
    dw_down = jnp.einsum("nf,nd->fd", act_nf, dy_nd, preferred_element_type=f32)
    dx_nd = jnp.einsum("nf,df->nd", d_gate_nf, w_gate_df, preferred_element_type=f32)
    dx_nd = dx_nd + jnp.einsum("nf,df->nd", d_up_nf, w_up_df, preferred_element_type=f32)
    return (
        dx_nd.reshape(b, t, d).astype(cd),
        dw_gate.astype(w_gate_df.dtype),
        dw_up.astype(w_up_df.dtype),
        dw_down.astype(w_down_fd.dtype),
    )


swiglu.defvjp(_fwd, _bwd)
