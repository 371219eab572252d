"""Attention of the decoder: the dense reference and three O(T)-memory self-attention paths.

``dense_attention`` is today's form (scores [B, K, G, T, S] against a boolean
visibility mask); the engine's cached decode and prefill use it, and it is the
reference every other path is tested against. ``self_attention`` is attention of a
[B, T] batch over itself without a cache (the learner's forward), causal within
*segments*: with ``segment_ids_bt`` several sequences are packed into one row and a
token sees only earlier tokens of its own segment (``learner.batching``'s packing).
Its implementations (``ModelConfig.attention``):

- "dense": ``dense_attention`` with the causal & segment mask ([T, T] scores).
- "blockwise": pure JAX, an online softmax over key blocks of ``BLOCK`` tokens
  (FlashAttention, arXiv 2205.14135 / 2307.08691) in a ``lax.scan``, with a
  hand-written backward that recomputes each block from the saved log-sum-exp:
  O(T * BLOCK) memory in both passes, O(T^2) FLOPs (no block is skipped). CPU.
- "dot_product": ``jax.nn.dot_product_attention`` (``implementation="cudnn"`` on a
  GPU with bfloat16 / float16 inputs, XLA's otherwise). In jax 0.10.2 neither of its
  implementations takes segment ids: packed rows go in as a boolean ``mask``
  [B, 1, T, T] (cuDNN turns it into a dense bias, so packing on GPU costs O(T^2)
  memory again; unpacked rows are plain causal, the O(T) flash kernel).
- "splash": ``jax.experimental.pallas.ops.tpu.splash_attention`` (causal mask,
  ``SegmentIds``, its MQA kernel vmapped over KV heads for GQA), under a
  ``shard_map`` over the batch / KV-head mesh axes of the current mesh (``jax.set_mesh``;
  a Pallas call cannot be partitioned by XLA). Off TPU it runs in interpret mode.
- "auto": splash on TPU, dot_product on GPU, blockwise elsewhere; blockwise on TPU
  and GPU for configs with a sliding window (neither kernel path takes a window
  whose use is traced per layer). The platform is that of the current mesh
  (``jax.sharding.get_abstract_mesh()``, e.g. abstract TPU chips compiled from a CPU
  host) or else ``jax.default_backend()``.

Shapes: B batch, T time, N query heads, K KV heads, G = N / K, H head dim, S keys.
Softmax statistics are float32; matmul inputs are ``config.compute_dtype``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

BLOCK = 256  # keys per step of the blockwise path (memory O(T * BLOCK) per head)
_MASKED = -1e30  # finite: a fully masked row gives a uniform softmax, not NaN
_BATCH_AXES = ("data", "fsdp", "expert")  # mesh axes a batch is split over (sharding.rules)


def current_platform() -> str:
    """ "tpu" / "gpu" / "cpu": the current mesh's devices, else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def resolve(name: str, platform: str, sliding_window: int | None = None) -> str:
    """The implementation "auto" stands for on ``platform`` (others are returned as given)."""
    if name != "auto":
        return name
    if sliding_window is not None:
        return "blockwise"
    return {"tpu": "splash", "gpu": "dot_product"}.get(platform, "blockwise")


def attention_scale(config, head_dim: int) -> float:
    """The query scale: 1/sqrt(head_dim), or 1/sqrt(query_pre_attn_scalar) (Gemma)."""
    scalar = config.query_pre_attn_scalar
    return head_dim**-0.5 if scalar is None else scalar**-0.5


def dense_attention(q_btnh, k_bksh, v_bkhs, visible_bts, config):
    """Grouped-query attention against a visibility mask; softmax in float32, with
    ``blockwise_attention``'s cast points.

    Args:
      q_btnh: [B, T, N, H] queries (RoPE applied).
      k_bksh: [B, K, S, H] keys; v_bkhs: [B, K, H, S] values (the layouts XLA's CPU
        batched products read, so a ``LayerKVCache`` is used as stored).
      visible_bts: bool [B, T, S], True where query t may attend to key s.
      config: ``ModelConfig`` (group size, compute dtype, query scale).

    Returns:
      [B, T, N, H] in the compute dtype.
    """
    b, t, n, h = q_btnh.shape
    cd = config.jnp_compute_dtype
    q_btkgh = q_btnh.reshape(b, t, config.n_kv_heads, config.group_size, h).astype(cd)
    scores_bkgts = jnp.einsum(
        "btkgh,bksh->bkgts", q_btkgh, k_bksh.astype(cd), preferred_element_type=jnp.float32
    ) * attention_scale(config, h)
    scores_bkgts = jnp.where(visible_bts[:, None, None], scores_bkgts, _MASKED)
    # The cast points of the learner's online softmax (``blockwise_attention``, one key
    # block): unnormalised probabilities rounded to the compute dtype, products and
    # their sum in float32, normalised after, one rounding at the end. Normalising
    # before the bf16 rounding (softmax, then cast) rounds every token's attention
    # output differently from the learner's and was 2/3 of the bf16 engine-learner
    # gap on SmolLM2-135M (benchmarks/bf16_gap.py, docs/CONSISTENCY.md).
    max_bkgt = jnp.max(scores_bkgts, axis=-1)
    probs_bkgts = jnp.exp(scores_bkgts - max_bkgt[..., None])  # masked: exactly 0
    denom_btkg = jnp.maximum(jnp.sum(probs_bkgts, axis=-1), 1e-30).transpose(0, 3, 1, 2)
    out_btkgh = jnp.einsum(
        "bkgts,bkhs->btkgh", probs_bkgts.astype(cd), v_bkhs.astype(cd),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    return (out_btkgh / denom_btkg[..., None]).astype(cd).reshape(b, t, n, h)


# Segment ids at or above this base are prefix-shared (``learner.packing.pack_groups``):
# ``(group << 16) | branch``, where branch 0 is a group's shared prompt prefix and
# branches 1, 2, ... are its samples' continuations. Ids below it keep plain equality.
SHARED_PREFIX_SHIFT = 16
SHARED_PREFIX_BASE = 1 << SHARED_PREFIX_SHIFT


def segments_visible(seg_q, seg_k):
    """bool, broadcast of ``seg_q`` and ``seg_k`` (int32 segment ids): whether a key of
    segment ``seg_k`` may be seen by a query of segment ``seg_q`` (causality aside).

    The same segment always; and a prefix-shared group's prefix (branch 0 of an id
    >= ``SHARED_PREFIX_BASE``) by every branch of that group, so G samples of one
    prompt attend to one copy of it (``learner.packing.pack_groups``).
    """
    shared = seg_k >= SHARED_PREFIX_BASE
    prefix = (seg_k & (SHARED_PREFIX_BASE - 1)) == 0
    same_group = (seg_q >> SHARED_PREFIX_SHIFT) == (seg_k >> SHARED_PREFIX_SHIFT)
    return (seg_q == seg_k) | (shared & prefix & same_group)


def self_visibility(t: int, segment_ids_bt, sliding, window: int | None):
    """bool [B or 1, T, T]: key j <= query i, same segment (or its group's shared
    prefix, ``segments_visible``), and (on a sliding layer) i - j < window.
    ``sliding``: Python bool or traced bool."""
    dist_tt = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    visible = (dist_tt >= 0)[None]
    if segment_ids_bt is not None:
        visible = visible & segments_visible(segment_ids_bt[:, :, None], segment_ids_bt[:, None, :])
    if window is not None and sliding is not False:
        near = (dist_tt < window)[None]
        visible = visible & (near if sliding is True else near | ~sliding)
    return visible


def cache_visibility(positions_bt, s: int, sliding, window: int | None):
    """bool [B, T, S] of a cached pass: cache entry j <= the query's position and, on a
    sliding layer, position - j < window (HF: key j > p - W). ``sliding``: bool or traced."""
    dist_bts = positions_bt[:, :, None] - jnp.arange(s)[None, None, :]
    visible = dist_bts >= 0
    if window is not None and sliding is not False:
        near = dist_bts < window
        visible = visible & (near if sliding is True else near | ~sliding)
    return visible


def self_attention(
    q_btnh, k_btkh, v_btkh, config, *, segment_ids_bt=None, sliding: bool | jax.Array = False
):
    """Causal attention of a [B, T] batch over itself (no cache), within segments.

    Args:
      q_btnh: [B, T, N, H]; k_btkh, v_btkh: [B, T, K, H] (RoPE applied to q and k).
      config: ``ModelConfig``; ``config.attention`` picks the implementation.
      segment_ids_bt: int32 [B, T] or None (each row one sequence). Tokens attend
        only to earlier tokens with the same id; right padding may take any id (it
        comes after every real token, which therefore never sees it).
      sliding: this layer attends within ``config.sliding_window`` (bool or traced).

    Returns:
      [B, T, N, H] in the compute dtype.
    """
    window = config.sliding_window
    impl = resolve(config.attention, current_platform(), window)
    if impl == "dense":
        visible = self_visibility(q_btnh.shape[1], segment_ids_bt, sliding, window)
        k_bksh, v_bkhs = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 3, 1)
        return dense_attention(q_btnh, k_bksh, v_bkhs, visible, config)
    if impl == "blockwise":
        return blockwise_attention(
            q_btnh, k_btkh, v_btkh, config, segment_ids_bt=segment_ids_bt, sliding=sliding
        )
    if impl == "dot_product":
        return _dot_product(q_btnh, k_btkh, v_btkh, config, segment_ids_bt, sliding)
    return splash_self_attention(q_btnh, k_btkh, v_btkh, config, segment_ids_bt=segment_ids_bt)


# ----------------------------------------------------------------------------- blockwise


def blockwise_attention(
    q_btnh, k_btkh, v_btkh, config, *, segment_ids_bt=None, sliding=False, block: int = BLOCK
):
    """``self_attention`` by an online softmax over key blocks (see the module docstring)."""
    b, t, n, h = q_btnh.shape
    k, g, cd = config.n_kv_heads, config.group_size, config.jnp_compute_dtype
    c = min(block, t)
    nb = -(-t // c)
    pad = nb * c - t  # padded keys sit after every query: the causal mask hides them
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt
    seg_bt = seg_bt.astype(jnp.int32)
    q_bkgth = q_btnh.reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4).astype(cd)
    k_nbkch = _key_blocks(k_btkh.astype(cd), pad, nb, c)
    v_nbkch = _key_blocks(v_btkh.astype(cd), pad, nb, c)
    seg_nbc = jnp.pad(seg_bt, ((0, 0), (0, pad)), constant_values=-1)
    seg_nbc = seg_nbc.reshape(b, nb, c).transpose(1, 0, 2)
    window = config.sliding_window if sliding is not False else None
    flag = jnp.asarray(True) if sliding is False or sliding is True else sliding
    out_bkgth = _flash(
        (attention_scale(config, h), c, window), q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag
    )
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(cd)


def _key_blocks(x_btkh, pad, nb, c):
    """[B, T, K, H] -> [nb, B, K, c, H] key blocks (zero-padded to nb * c)."""
    b, _, k, h = x_btkh.shape
    x = jnp.pad(x_btkh, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x.reshape(b, nb, c, k, h).transpose(1, 0, 3, 2, 4)


def _block_visible(statics, i_block, seg_bt, seg_bc, flag):
    """bool [B, 1, 1, T, c]: which keys of block ``i_block`` each query sees."""
    _, c, window = statics
    t = seg_bt.shape[1]
    dist_tc = jnp.arange(t)[:, None] - (i_block * c + jnp.arange(c))[None, :]
    visible = (dist_tc >= 0)[None] & segments_visible(seg_bt[:, :, None], seg_bc[:, None, :])
    if window is not None:
        visible = visible & ((dist_tc < window)[None] | ~flag)
    return visible[:, None, None]


def _block_scores(statics, q_bkgth, k_bkch, visible):
    s = jnp.einsum("bkgth,bkch->bkgtc", q_bkgth, k_bkch, preferred_element_type=jnp.float32)
    return jnp.where(visible, s * statics[0], _MASKED)


def _flash_forward(statics, q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag):
    """(out float32 [B, K, G, T, H], log-sum-exp float32 [B, K, G, T])."""
    b, k, g, t, h = q_bkgth.shape

    def step(carry, xs):
        m, denom, acc = carry
        i, k_bkch, v_bkch, seg_bc = xs
        visible = _block_visible(statics, i, seg_bt, seg_bc, flag)
        s = _block_scores(statics, q_bkgth, k_bkch, visible)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)  # rescales what earlier blocks summed
        denom = denom * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
            "bkgtc,bkch->bkgth", p.astype(q_bkgth.dtype), v_bkch,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return (m_new, denom, acc * alpha[..., None] + pv), None

    init = (
        jnp.full((b, k, g, t), _MASKED, jnp.float32),
        jnp.zeros((b, k, g, t), jnp.float32),
        jnp.zeros((b, k, g, t, h), jnp.float32),
    )
    idx = jnp.arange(k_nbkch.shape[0])
    (m, denom, acc), _ = jax.lax.scan(step, init, (idx, k_nbkch, v_nbkch, seg_nbc))
    denom = jnp.maximum(denom, 1e-30)  # every query sees itself: >= 1 after the last block
    return acc / denom[..., None], m + jnp.log(denom)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(statics, q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag):
    return _flash_forward(statics, q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag)[0]


def _flash_fwd(statics, q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag):
    out, lse = _flash_forward(statics, q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag)
    return out, (q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag, out, lse)


def _flash_bwd(statics, res, dout_bkgth):
    """Per key block j, with P = exp(S - lse) and D = rowsum(dO * O):
    dV_j = P^T dO, dS = P * (dO V_j^T - D), dQ += dS K_j * scale, dK_j = dS^T Q * scale."""
    q_bkgth, k_nbkch, v_nbkch, seg_bt, seg_nbc, flag, out, lse = res
    scale, cd, f32 = statics[0], q_bkgth.dtype, jnp.float32
    dout = dout_bkgth.astype(f32)
    d_bkgt = jnp.sum(dout * out, axis=-1)
    dout_cd = dout.astype(cd)

    def step(dq, xs):
        i, k_bkch, v_bkch, seg_bc = xs
        visible = _block_visible(statics, i, seg_bt, seg_bc, flag)
        s = _block_scores(statics, q_bkgth, k_bkch, visible)
        p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)
        dv = jnp.einsum("bkgtc,bkgth->bkch", p.astype(cd), dout_cd, preferred_element_type=f32)
        dp = jnp.einsum("bkgth,bkch->bkgtc", dout_cd, v_bkch, preferred_element_type=f32)
        ds = (p * (dp - d_bkgt[..., None])).astype(cd)
        dq = dq + jnp.einsum("bkgtc,bkch->bkgth", ds, k_bkch, preferred_element_type=f32)
        dk = jnp.einsum("bkgtc,bkgth->bkch", ds, q_bkgth, preferred_element_type=f32)
        return dq, (dk * scale, dv)

    idx = jnp.arange(k_nbkch.shape[0])
    dq, (dk, dv) = jax.lax.scan(
        step, jnp.zeros(q_bkgth.shape, f32), (idx, k_nbkch, v_nbkch, seg_nbc)
    )
    return (
        (dq * scale).astype(cd),
        dk.astype(k_nbkch.dtype),
        dv.astype(v_nbkch.dtype),
        None,
        None,
        None,
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------- dot_product


def _dot_product(q_btnh, k_btkh, v_btkh, config, segment_ids_bt, sliding):
    """``jax.nn.dot_product_attention`` (cuDNN on GPU for 16-bit inputs, else XLA)."""
    cd = config.jnp_compute_dtype
    mask = None
    if segment_ids_bt is not None:  # no segment ids in jax 0.10.2's API: a dense mask
        mask = segments_visible(segment_ids_bt[:, :, None], segment_ids_bt[:, None, :])[:, None]
    window = None
    if sliding is not False:  # ModelConfig refuses sliding configs; auto avoids them
        raise ValueError("attention 'dot_product' does not take sliding-window layers")
    use_cudnn = current_platform() == "gpu" and cd in (jnp.bfloat16, jnp.float16)
    return jax.nn.dot_product_attention(
        q_btnh.astype(cd),
        k_btkh.astype(cd),
        v_btkh.astype(cd),
        mask=mask,
        scale=attention_scale(config, q_btnh.shape[-1]),
        is_causal=True,
        local_window_size=window,
        implementation="cudnn" if use_cudnn else None,
    )


# -------------------------------------------------------------------------------- splash


def _splash_block(t: int) -> int:
    for size in (512, 256, 128):
        if t % size == 0:
            return size
    raise AssertionError(t)  # t is padded to a multiple of 128


def _splash_kernel(g: int, t: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa  # noqa: PLC0415

    blk = _splash_block(t)
    sizes = sa.BlockSizes(
        block_q=blk, block_kv=blk, block_kv_compute=blk,
        block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
        block_q_dq=blk, block_kv_dq=blk,
    )  # fmt: skip
    mask = sa.MultiHeadMask([sa.CausalMask((t, t)) for _ in range(g)])
    return sa, sa.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_self_attention(q_btnh, k_btkh, v_btkh, config, *, segment_ids_bt=None):
    """``self_attention`` by the TPU splash kernel (see the module docstring)."""
    b, t, n, h = q_btnh.shape
    k, g, cd = config.n_kv_heads, config.group_size, config.jnp_compute_dtype
    tp = -(-t // 128) * 128  # the kernel's blocks are multiples of 128
    pad = tp - t
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt
    seg_bt = jnp.pad(seg_bt.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    # The kernel does not scale: q is scaled in float32 before the cast.
    q = (q_btnh.astype(jnp.float32) * attention_scale(config, h)).astype(cd)
    q_bkgth = jnp.pad(q.reshape(b, t, k, g, h), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    q_bkgth = q_bkgth.transpose(0, 2, 3, 1, 4)
    k_bkth = jnp.pad(k_btkh.astype(cd), ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    v_bkth = jnp.pad(v_btkh.astype(cd), ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    mesh = jax.sharding.get_abstract_mesh()
    interpret = current_platform() != "tpu"

    def local(q_bkgth, k_bkth, v_bkth, seg_bt):
        sa, kernel = _splash_kernel(g, tp, interpret)

        def one(q_gth, k_th, v_th, seg_t):
            return kernel(q_gth, k_th, v_th, segment_ids=sa.SegmentIds(q=seg_t, kv=seg_t))

        per_head = jax.vmap(one, in_axes=(0, 0, 0, None))  # over KV heads
        return jax.vmap(per_head)(q_bkgth, k_bkth, v_bkth, seg_bt)  # over rows

    if mesh.empty:
        out_bkgth = local(q_bkgth, k_bkth, v_bkth, seg_bt)
    else:
        batch_axes = tuple(a for a in _BATCH_AXES if mesh.shape.get(a, 1) > 1)
        if b % math.prod(mesh.shape[a] for a in batch_axes):
            batch_axes = ()  # rows not divisible: every device computes all rows
        heads = (
            "tensor" if mesh.shape.get("tensor", 1) > 1 and k % mesh.shape["tensor"] == 0 else None
        )
        bspec = batch_axes or None
        spec5, spec4 = PartitionSpec(bspec, heads), PartitionSpec(bspec, heads)
        out_bkgth = jax.shard_map(
            local,
            in_specs=(spec5, spec4, spec4, PartitionSpec(bspec)),
            out_specs=spec5,
            check_vma=False,
        )(q_bkgth, k_bkth, v_bkth, seg_bt)
    return out_bkgth.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, n, h).astype(cd)
