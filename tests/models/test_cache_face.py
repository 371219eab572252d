"""The KV-cache face (models/caches/cache_face.py): every cache kind answers the same two calls,
the decoder never asks which kind it has, and a new kind plugs in without touching it."""

from __future__ import annotations

import ast
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from jaxflash.models.caches.cache_face import FreshPrefill, Site
from jaxflash.models.caches.kv_cache import (
    DenseLayer,
    DenseSlice,
    LayerKVCache,
    init_kv_cache,
    init_layer_kv_cache,
)
from jaxflash.models.caches.paged_kv_cache import init_paged_kv_cache
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder import block, transformer

CONFIG = get_preset("tiny")
B, T, S = 2, 5, 16
DECODER = (
    "decoder/transformer.py",
    "decoder/block.py",
    "caches/cache_face.py",
    "caches/attention.py",
    "caches/kv_cache.py",
    "caches/paged_kv_cache.py",
)
CACHE_TYPES = {"KVCache", "LayerKVCache", "PagedKVCache", "PageTable", "DenseSlice",
               "DenseLayer", "PagedLayer", "NoCache", "FreshPrefill"}  # fmt: skip


def _qkv(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    n, k, h = CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.head_dim
    return (jax.random.normal(ks[0], (B, T, n, h)), jax.random.normal(ks[1], (B, T, k, h)),
            jax.random.normal(ks[2], (B, T, k, h)))  # fmt: skip


def test_decoder_code_never_asks_which_cache_it_has():
    models = pathlib.Path(transformer.__file__).parents[1]
    for name in DECODER:
        for node in ast.walk(ast.parse((models / name).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not named & CACHE_TYPES, f"{name}:{node.lineno} asks for {named}"
    assert len(inspect.signature(block.decoder_layer).parameters) <= 6


@pytest.mark.parametrize("fresh", [False, True])
def test_both_dense_layouts_store_the_same_entries_and_attend_alike(fresh):
    """A KVCache slice and a LayerKVCache layer are one cache in two layouts; a fresh
    prefill stores exactly what the cached pass stores."""
    q, k, v = _qkv()
    site = Site(jnp.tile(jnp.arange(T), (B, 1)))
    kv = init_kv_cache(CONFIG, B, S)
    dense = DenseSlice(kv.k_lbskh[0], kv.v_lbskh[0])
    layer = init_layer_kv_cache(CONFIG, B, S).layers()[0]
    if fresh:
        dense, layer = FreshPrefill(dense), FreshPrefill(layer)
    out_d, dense = dense.attend(CONFIG, q, k, v, site)
    out_l, layer = layer.attend(CONFIG, q, k, v, site)
    assert isinstance(dense, DenseSlice) and isinstance(layer, DenseLayer)  # fresh once
    np.testing.assert_array_equal(dense.k_bskh.transpose(0, 2, 1, 3), layer.k_bksh)
    np.testing.assert_array_equal(dense.v_bskh.transpose(0, 2, 3, 1), layer.v_bkhs)
    np.testing.assert_allclose(out_d, out_l, rtol=1e-6, atol=1e-6)


def test_a_paged_cache_refuses_a_fresh_prefill():
    paged = init_paged_kv_cache(CONFIG, B, S, num_pages=8, page_size=4)
    with pytest.raises(ValueError, match="fresh_cache=True needs a KVCache or LayerKVCache"):
        paged.layers(fresh=True)


def test_the_cache_must_match_the_params_layout():
    params = transformer.init_params(CONFIG, 0)
    ids = jnp.zeros((B, T), jnp.int32)
    pos = jnp.tile(jnp.arange(T), (B, 1))
    with pytest.raises(ValueError, match="stacked params need a KVCache, got LayerKVCache"):
        transformer.forward(params, CONFIG, ids, pos, init_layer_kv_cache(CONFIG, B, S))
    with pytest.raises(ValueError, match="kv_cache batch 3 != input batch 2"):
        transformer.forward(params, CONFIG, ids, pos, init_kv_cache(CONFIG, 3, S))


@struct.dataclass
class _Counted:
    """A new layer-cache kind: wraps another and counts the tokens it stored."""

    inner: DenseLayer
    stored: jax.Array

    def attend(self, config, q_btnh, k_btkh, v_btkh, site):
        out, inner = self.inner.attend(config, q_btnh, k_btkh, v_btkh, site)
        return out, _Counted(inner, self.stored + jnp.sum(site.positions_bt >= 0))


@struct.dataclass
class _CountedCache:
    base: LayerKVCache
    stored: tuple

    stacked = False

    @property
    def batch(self):
        return self.base.batch

    def layers(self, *, fresh=False):
        return tuple(_Counted(c, n) for c, n in zip(self.base.layers(), self.stored, strict=True))

    def with_layers(self, layers):
        return _CountedCache(self.base.with_layers([c.inner for c in layers]),
                             tuple(c.stored for c in layers))  # fmt: skip


def test_a_new_cache_kind_plugs_in_without_touching_the_decoder():
    params = transformer.unstack_layers(transformer.init_params(CONFIG, 0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, CONFIG.vocab_size)
    pos = jnp.array([list(range(T)), [0, 1, 2, -1, -1]])  # row 1 padded
    base = init_layer_kv_cache(CONFIG, B, S)
    run = jax.jit(lambda c: transformer.forward(params, CONFIG, ids, pos, c))
    want_h, want_cache = run(base)
    h, got = run(_CountedCache(base, (jnp.zeros((), jnp.int32),) * CONFIG.n_layers))
    np.testing.assert_array_equal(h, want_h)
    jax.tree.map(np.testing.assert_array_equal, got.base, want_cache)
    assert [int(n) for n in got.stored] == [T + 3] * CONFIG.n_layers
