"""Routed mixture-of-experts MLP (Qwen3-MoE) and its load-balancing loss.

Per token x (a row of the normed residual stream), with E experts of SwiGLU width F:

    p = softmax(x W_router)                      (float32, over E)
    S = top-k indices of p,  w_e = p_e for e in S (divided by sum_S p when
                                                  ``norm_topk_prob``: computed
                                                  as softmax over S's logits)
    y = sum_{e in S} w_e · SwiGLU_e(x)

as transformers' ``Qwen3MoeSparseMoeBlock`` computes it (softmax in float32, top-k
of the probabilities, optional renormalisation, no shared expert, no capacity limit,
so no token is dropped). Mixtral (arXiv 2401.04088) and Switch (arXiv 2101.03961)
describe the same router; Qwen3 (arXiv 2505.09388) uses it with k = 8 of 128.

Expert compute is a grouped matmul: the N·k (token, expert) assignments are sorted
by expert and ``jax.lax.ragged_dot`` multiplies each contiguous group by its own
expert's matrix (``experts_ragged``). jax 0.10 lowers ``ragged_dot`` to
``chlo.ragged_dot`` on TPU and to a Pallas/Triton kernel or ``chlo.ragged_dot`` on GPU
(neither measured here); on CPU it expands it to a masked dense product (E times the
FLOPs), which is fine for tests, not for speed. ``experts_dense`` runs every expert on every
token and weights by the sparse combine matrix: the reference the tests compare
with (same math, no sorting).

Dimension letters: N tokens (B·T flattened), D model width, E experts, k experts
per token, F expert width, A = N·k assignments, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("ragged", "dense")


def route(
    x_nd: jax.Array,
    w_router_de: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    replay_nk: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Router logits, top-k weights and experts of each token, optionally replayed.

    The k experts S are the top-k of p = softmax(logits); their weights are p_S, or
    with ``norm_topk_prob`` p_S / sum(p_S) computed as softmax(logits_S) — the same
    value, but read from the k logits alone, so logits of experts outside S change
    no bit of it.

    Router replay (R3, "rollout routing replay", arXiv 2510.11370): with ``replay_nk``,
    a token whose row holds k recorded experts (all >= 0) takes S from it instead of
    its own top-k and weights them by the formula above on the *live* logits, so the
    router keeps its gradient; a row with a -1 (no route recorded) routes live.
    Replaying the live top-k changes no bit.

    Args:
      x_nd: [N, D] normed hidden states, compute dtype.
      w_router_de: [D, E] router matrix, compute dtype.
      top_k: k experts per token (static).
      norm_topk_prob: renormalise the k kept probabilities to sum to 1.
      replay_nk: optional int [N, k] recorded experts (-1: none recorded).

    Returns:
      (logits_ne float32 [N, E], weights_nk float32 [N, k], experts_nk int32 [N, k]
      the experts used, live_nk int32 [N, k] the live top-k); live experts in
      decreasing probability (ties: lower index first).
    """
    logits_ne = jnp.einsum("nd,de->ne", x_nd, w_router_de, preferred_element_type=jnp.float32)
    probs_ne = jax.nn.softmax(logits_ne, axis=-1)
    _, live_nk = jax.lax.top_k(probs_ne, top_k)
    live_nk = live_nk.astype(jnp.int32)
    experts_nk = live_nk
    if replay_nk is not None:
        replay_nk = replay_nk.astype(jnp.int32)
        use_n = jnp.all(replay_nk >= 0, axis=-1, keepdims=True)
        experts_nk = jnp.where(use_n, replay_nk, live_nk)
    if norm_topk_prob:
        weights_nk = jax.nn.softmax(jnp.take_along_axis(logits_ne, experts_nk, axis=-1), axis=-1)
    else:
        weights_nk = jnp.take_along_axis(probs_ne, experts_nk, axis=-1)
    return logits_ne, weights_nk, experts_nk, live_nk


def experts_ragged(
    x_nd: jax.Array,
    experts_nk: jax.Array,
    weights_nk: jax.Array,
    w_gate_edf: jax.Array,
    w_up_edf: jax.Array,
    w_down_efd: jax.Array,
) -> jax.Array:
    """Weighted sum of each token's k experts by grouped matmul on expert-sorted rows.

    Args:
      x_nd: [N, D] compute dtype.
      experts_nk: int32 [N, k] expert of each assignment.
      weights_nk: float32 [N, k] its routing weight.
      w_gate_edf, w_up_edf: [E, D, F]; w_down_efd: [E, F, D]; compute dtype.

    Returns:
      float32 [N, D].
    """
    n, k = experts_nk.shape
    n_experts = w_gate_edf.shape[0]
    flat_a = experts_nk.reshape(-1)
    # Stable: rows of one expert keep token order, so the layout is a function of
    # the routing alone.
    order_a = jnp.argsort(flat_a, stable=True)
    x_ad = jnp.take(x_nd, order_a // k, axis=0)
    sizes_e = jnp.bincount(flat_a, length=n_experts).astype(jnp.int32)
    gate_af = jax.lax.ragged_dot(x_ad, w_gate_edf, sizes_e)
    up_af = jax.lax.ragged_dot(x_ad, w_up_edf, sizes_e)
    act_af = (jax.nn.silu(gate_af) * up_af).astype(x_nd.dtype)
    out_ad = jax.lax.ragged_dot(act_af, w_down_efd, sizes_e, preferred_element_type=jnp.float32)
    # Back to (token, slot) order by the inverse permutation, then the k-term sum.
    inverse_a = jnp.zeros_like(order_a).at[order_a].set(jnp.arange(n * k, dtype=order_a.dtype))
    out_nkd = jnp.take(out_ad, inverse_a, axis=0).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out_nkd, weights_nk)


def experts_dense(
    x_nd: jax.Array,
    experts_nk: jax.Array,
    weights_nk: jax.Array,
    w_gate_edf: jax.Array,
    w_up_edf: jax.Array,
    w_down_efd: jax.Array,
) -> jax.Array:
    """Reference form of ``experts_ragged``: every expert on every token (E times the
    FLOPs), combined with the [N, E] matrix holding w_e on the selected experts."""
    n_experts = w_gate_edf.shape[0]
    combine_ne = jnp.sum(jax.nn.one_hot(experts_nk, n_experts) * weights_nk[..., None], axis=1)
    gate_nef = jnp.einsum("nd,edf->nef", x_nd, w_gate_edf)
    up_nef = jnp.einsum("nd,edf->nef", x_nd, w_up_edf)
    act_nef = (jax.nn.silu(gate_nef) * up_nef).astype(x_nd.dtype)
    out_ned = jnp.einsum("nef,efd->ned", act_nef, w_down_efd, preferred_element_type=jnp.float32)
    return jnp.einsum("ned,ne->nd", out_ned, combine_ne)


def moe_mlp(
    x_btd: jax.Array,
    w_router_de: jax.Array,
    w_gate_edf: jax.Array,
    w_up_edf: jax.Array,
    w_down_efd: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    impl: str = "ragged",
    replay_btk: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MoE block of one layer (Qwen3-MoE's sparse MLP).

    Args:
      x_btd: [B, T, D] normed input, compute dtype.
      w_router_de: [D, E]; w_gate_edf, w_up_edf: [E, D, F]; w_down_efd: [E, F, D];
        compute dtype.
      top_k, norm_topk_prob: routing (``ModelConfig.n_experts_per_token``,
        ``norm_topk_prob``), static.
      impl: "ragged" (grouped matmul, what the model runs) or "dense" (reference).
      replay_btk: optional int [B, T, k] recorded experts to replay (``route``).

    Returns:
      (y_btd float32 [B, T, D], router logits float32 [B, T, E], the live top-k
      experts int32 [B, T, k] — what the router chose, replayed or not).

    Raises:
      ValueError: an unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"moe_mlp: impl must be one of {IMPLS}, got {impl!r}")
    b, t, d = x_btd.shape
    x_nd = x_btd.reshape(b * t, d)
    replay_nk = None if replay_btk is None else replay_btk.reshape(b * t, top_k)
    logits_ne, weights_nk, experts_nk, live_nk = route(
        x_nd, w_router_de, top_k=top_k, norm_topk_prob=norm_topk_prob, replay_nk=replay_nk
    )
    experts = experts_ragged if impl == "ragged" else experts_dense
    y_nd = experts(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd)
    return y_nd.reshape(b, t, d), logits_ne.reshape(b, t, -1), live_nk.reshape(b, t, top_k)


def route_mismatch(live_btlk: jax.Array, recorded_btlk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(token, layer) routing decisions whose expert sets differ, and those compared.

    A decision is compared where a route was recorded (no -1 in its k entries); it
    differs when the two k-sets differ (order inside the set, which only changes
    the order of the k-term sum, is not counted).

    Args:
      live_btlk: int [..., k] experts one side chose.
      recorded_btlk: int [..., k] the other side's (-1: not recorded).

    Returns:
      (differing float32 [...], compared float32 [...]), 0/1 each.
    """
    compared = jnp.all(recorded_btlk >= 0, axis=-1)
    same = jnp.all(
        jnp.sort(live_btlk.astype(jnp.int32), axis=-1)
        == jnp.sort(recorded_btlk.astype(jnp.int32), axis=-1),
        axis=-1,
    )
    return (compared & ~same).astype(jnp.float32), compared.astype(jnp.float32)


# ------------------------------------------------------- load-balancing loss


def expert_load(router_logits_lbte: jax.Array, mask_bt: jax.Array, top_k: int) -> jax.Array:
    """Top-k assignments per expert, summed over layers and masked tokens.

    Args:
      router_logits_lbte: float32 [L, B, T, E] (``forward_with_router_logits``).
      mask_bt: [B, T] token weights (1 counted, 0 not).
      top_k: k, as the model routes.

    Returns:
      float32 [E], no gradient (a count of discrete choices).
    """
    n_experts = router_logits_lbte.shape[-1]
    probs = jax.nn.softmax(router_logits_lbte.astype(jnp.float32), axis=-1)
    _, experts_lbtk = jax.lax.top_k(probs, top_k)
    hits_lbte = jnp.sum(jax.nn.one_hot(experts_lbtk, n_experts), axis=-2)
    w_bt = mask_bt.astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.einsum("lbte,bt->e", hits_lbte, w_bt))


def load_balancing_loss(
    router_logits_lbte: jax.Array,
    mask_bt: jax.Array,
    top_k: int,
    *,
    load_e: jax.Array | None = None,
    num_rows: jax.Array | None = None,
) -> jax.Array:
    """Switch-style auxiliary load-balancing loss, as transformers computes it.

        loss = E · sum_e f_e · P_e,   f_e = load_e / R,   P_e = (sum_{l,t} m_t p_lte) / R

    with p = softmax(router logits), load_e the top-k assignments to expert e
    (``expert_load``), R = L · sum_t m_t the counted rows, pooled over layers
    (transformers' ``load_balancing_loss_func`` with an attention mask; Switch
    Transformer, arXiv 2101.03961, eqs. 4-6, generalised to top-k). Only P carries a
    gradient. With ``load_e`` and ``num_rows`` of a whole batch and the logits of one
    micro-batch, the micro-batches' values sum to the whole batch's loss, and so do
    their gradients (how the learner stays micro-batch invariant).

    Args:
      router_logits_lbte: float32 [L, B, T, E].
      mask_bt: [B, T] token weights.
      top_k: k.
      load_e: float32 [E] assignments of the whole batch; None: of this input.
      num_rows: float32 scalar R of the whole batch; None: of this input.

    Returns:
      float32 scalar (0 when no row is counted).
    """
    n_layers, n_experts = router_logits_lbte.shape[0], router_logits_lbte.shape[-1]
    w_bt = mask_bt.astype(jnp.float32)
    if load_e is None:
        load_e = expert_load(router_logits_lbte, mask_bt, top_k)
    if num_rows is None:
        num_rows = n_layers * jnp.sum(w_bt)
    probs = jax.nn.softmax(router_logits_lbte.astype(jnp.float32), axis=-1)
    prob_sum_e = jnp.einsum("lbte,bt->e", probs, w_bt)
    rows = jnp.maximum(num_rows, 1.0)
    return n_experts * jnp.sum((load_e / rows) * (prob_sum_e / rows))
