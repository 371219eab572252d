"""The attention paths (``models.caches.attention``) against a float64 reference: causal, GQA,
packed segments, ragged lengths, gradients; splash in interpret mode; the model's
forward over packed rows equals its forward over each sequence alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.models.caches import attention
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import forward, init_params

# B=3 rows of T=40: row 0 one sequence; row 1 three packed segments; row 2 a ragged
# row (a 23-token sequence, then padding with its own id).
T, N, K, H = 40, 4, 2, 8
SEGMENTS = np.array(
    [[1] * T, [1] * 9 + [2] * 20 + [3] * 11, [1] * 23 + [0] * 17], np.int32
)  # fmt: skip


def _qkv(seed=0, t=T, b=3, n=N, k=K, h=H):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((b, t, n, h)),
        rng.standard_normal((b, t, k, h)),
        rng.standard_normal((b, t, k, h)),
    )


def _reference(q, k, v, seg, xp=np):
    """float64 causal attention within segments, GQA by repeating KV heads."""
    g = q.shape[2] // k.shape[2]
    k, v = xp.repeat(k, g, axis=2), xp.repeat(v, g, axis=2)
    s = xp.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5
    t = q.shape[1]
    visible = xp.tril(xp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    s = xp.where(visible[:, None], s, -1e300)
    p = xp.exp(s - s.max(-1, keepdims=True))
    return xp.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


def _config(impl, **kw):
    return get_preset(
        "tiny", **{"n_heads": N, "n_kv_heads": K, "head_dim": H, **kw}, attention=impl
    )


def _run(impl, q, k, v, seg, **kw):
    cfg = _config(impl)
    fn = jax.jit(lambda q, k, v: attention.self_attention(q, k, v, cfg, segment_ids_bt=seg, **kw))
    return fn(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))


@pytest.mark.parametrize("impl", ["dense", "blockwise", "dot_product"])
def test_paths_match_the_float64_reference(impl):
    q, k, v = _qkv()
    want = _reference(q, k, v, SEGMENTS)
    got = np.asarray(_run(impl, q, k, v, jnp.asarray(SEGMENTS)))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # Without segment ids each row is one causal sequence.
    got = np.asarray(_run(impl, q, k, v, None))
    np.testing.assert_allclose(got, _reference(q, k, v, np.ones_like(SEGMENTS)), atol=2e-5)


@pytest.mark.parametrize("block", [7, 16, 64])
def test_blockwise_with_blocks_that_do_not_divide_t(block):
    q, k, v = _qkv(1)
    cfg = _config("blockwise")
    f32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    got = attention.blockwise_attention(*f32, cfg, segment_ids_bt=SEGMENTS, block=block)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, SEGMENTS), atol=2e-5)


def test_blockwise_gradients_match_the_float64_reference():
    q, k, v = _qkv(2)
    w = np.random.default_rng(3).standard_normal(q.shape)
    cfg = _config("blockwise")

    def loss(q, k, v):
        out = attention.blockwise_attention(q, k, v, cfg, segment_ids_bt=SEGMENTS, block=16)
        return jnp.sum(out * w)

    got = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    with jax.enable_x64():
        ref = jax.grad(
            lambda q, k, v: jnp.sum(_reference(q, k, v, jnp.asarray(SEGMENTS), jnp) * w),
            argnums=(0, 1, 2),
        )(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
        ref = [np.asarray(r) for r in ref]
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-4, rtol=1e-4)


def test_blockwise_sliding_window_matches_dense():
    q, k, v = _qkv(4)
    cfg = dataclasses.replace(
        _config("blockwise"), sliding_window=5, layer_types=("sliding_attention",) * 2
    )
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    for sliding in (True, jnp.asarray(True), jnp.asarray(False)):
        got = attention.blockwise_attention(*f32, cfg, segment_ids_bt=SEGMENTS, sliding=sliding)
        want = attention.self_attention(
            *f32, dataclasses.replace(cfg, attention="dense"), segment_ids_bt=SEGMENTS,
            sliding=sliding,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_splash_in_interpret_mode_matches_the_reference():
    """The TPU kernel, interpreted on CPU: T=100 is padded to its 128-token blocks."""
    q, k, v = _qkv(5, t=100, b=1, n=4, k=1, h=8)
    seg = np.array([[1] * 30 + [2] * 70], np.int32)
    cfg = _config("splash", n_heads=4, n_kv_heads=1)
    w = np.random.default_rng(6).standard_normal(q.shape)

    def loss(q, k, v):
        out = attention.self_attention(q, k, v, cfg, segment_ids_bt=jnp.asarray(seg))
        return jnp.sum(out * w), out

    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*f32)
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, seg), atol=2e-5)
    with jax.enable_x64():
        ref = jax.grad(
            lambda q, k, v: jnp.sum(_reference(q, k, v, jnp.asarray(seg), jnp) * w),
            argnums=(0, 1, 2),
        )(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
        ref = [np.asarray(r) for r in ref]
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-4, rtol=1e-4)


def test_auto_picks_by_platform_and_names_are_checked():
    assert attention.resolve("auto", "tpu") == "splash"
    assert attention.resolve("auto", "gpu") == "dot_product"
    assert attention.resolve("auto", "cpu") == "blockwise"
    assert attention.resolve("auto", "tpu", sliding_window=4) == "blockwise"
    assert attention.resolve("dense", "tpu") == "dense"
    with pytest.raises(ValueError, match="attention must be one of"):
        get_preset("tiny", attention="flash")
    with pytest.raises(ValueError, match="sliding-window"):
        get_preset("tiny", attention="splash", sliding_window=4,
                   layer_types=("sliding_attention", "full_attention"))  # fmt: skip


@pytest.mark.parametrize("impl", ["dense", "blockwise"])
def test_a_packed_row_gives_each_sequence_its_own_forward(impl):
    """Two sequences in one row (positions restart, segment ids 1 and 2) give the
    hidden states each gives alone; the unpacked forward is the same in every path."""
    cfg = get_preset("tiny", attention=impl)
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, cfg.vocab_size, 13), rng.integers(0, cfg.vocab_size, 19)
    ids = jnp.asarray(np.concatenate([a, b, [0] * 8])[None], jnp.int32)
    pos = jnp.asarray(np.r_[np.arange(13), np.arange(19), np.arange(8)][None], jnp.int32)
    seg = jnp.asarray(np.r_[[1] * 13, [2] * 19, [3] * 8][None], jnp.int32)
    packed, _ = forward(params, cfg, ids, pos, segment_ids_bt=seg)
    alone_a, _ = forward(params, cfg, jnp.asarray(a[None]), jnp.arange(13)[None])
    alone_b, _ = forward(params, cfg, jnp.asarray(b[None]), jnp.arange(19)[None])
    np.testing.assert_allclose(np.asarray(packed[0, :13]), np.asarray(alone_a[0]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(packed[0, 13:32]), np.asarray(alone_b[0]), atol=2e-5)
    dense, _ = forward(params, dataclasses.replace(cfg, attention="dense"), ids, pos)
    mine, _ = forward(params, cfg, ids, pos)
    np.testing.assert_allclose(np.asarray(mine), np.asarray(dense), atol=2e-5)


def test_dense_rounds_where_blockwise_does_in_bf16():
    """bf16: the engine's dense attention rounds at the learner's blockwise cast points
    (unnormalised probabilities rounded to bf16, float32 products and sum, normalised
    after), so the two agree on (nearly) every output element: only float32 reduction
    orders may differ (measured here: 100 % bitwise equal). Normalising before the
    rounding (softmax, then cast: the engine's formula before) matched 58 % — a
    different rounding of every token's attention, 2/3 of the bf16 engine-learner gap
    on SmolLM2-135M (benchmarks/bf16_gap.py)."""
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(seed=3))
    outs = {}
    for impl in ("dense", "blockwise"):
        cfg = _config(impl, compute_dtype="bfloat16")
        fn = jax.jit(lambda q, k, v, cfg=cfg: attention.self_attention(q, k, v, cfg))
        outs[impl] = np.asarray(fn(q, k, v).astype(jnp.float32))
    assert outs["dense"].dtype == np.float32 and np.isfinite(outs["dense"]).all()
    assert np.mean(outs["dense"] == outs["blockwise"]) > 0.99
    np.testing.assert_allclose(outs["dense"], outs["blockwise"], rtol=2**-7)
