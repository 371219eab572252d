"""Tests for jaxflash.sharding on the fake 8-device CPU mesh (see conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash.models.caches.kv_cache import KV_CACHE_LOGICAL_AXES, KVCache, init_kv_cache
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.logprobs import logits_from_hidden, target_logprobs
from jaxflash.models.decoder.transformer import (
    abstract_params,
    forward,
    init_params,
    logical_axes,
    unembed,
)
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import (
    GENERATOR_RULES,
    LEARNER_RULES,
    logical_to_shardings,
    logical_to_spec,
)

TINY = get_preset("tiny")


def test_make_mesh_layout_and_errors():
    devices = jax.devices()
    assert len(devices) == 8
    mesh = make_mesh(devices, {"fsdp": 2, "tensor": 4})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 4}
    # tensor varies fastest: the first tensor group is devices 0..3.
    assert list(mesh.devices[0, 0, 0]) == devices[:4]
    # expert sits between fsdp and tensor: with tensor 2, expert groups are 0/2/4/6.
    mesh = make_mesh(devices, {"expert": 4, "tensor": 2})
    assert list(mesh.devices[0, 0, :, 0]) == [devices[i] for i in (0, 2, 4, 6)]
    with pytest.raises(ValueError, match="multiply to 6, but 8 devices"):
        make_mesh(devices, {"data": 3, "tensor": 2})
    with pytest.raises(ValueError, match=r"unknown axis names \['model'\]"):
        make_mesh(devices, {"model": 8})


def test_specs_tiny_learner_and_generator():
    shapes = jax.tree.map(lambda x: x.shape, abstract_params(TINY))
    axes = logical_axes(TINY)
    learner = make_mesh(jax.devices(), {"fsdp": 2, "tensor": 4})
    spec = lambda name, mesh, rules: logical_to_spec(  # noqa: E731
        axes["layers"][name], mesh, rules, shapes["layers"][name]
    )
    assert spec("w_q_ldnh", learner, LEARNER_RULES) == P(None, "fsdp", "tensor", None)
    # 2 kv heads do not split 4 ways: replicated over tensor, embed still on fsdp.
    assert spec("w_k_ldkh", learner, LEARNER_RULES) == P(None, "fsdp", None, None)
    assert spec("w_down_lfd", learner, LEARNER_RULES) == P(None, "tensor", "fsdp")
    assert logical_to_spec(("vocab", "embed"), learner, LEARNER_RULES, (512, 64)) == P(
        "tensor", "fsdp"
    )
    generator = make_mesh(jax.devices(), {"data": 2, "tensor": 4})
    assert spec("w_q_ldnh", generator, GENERATOR_RULES) == P(None, None, "tensor", None)
    assert spec("w_gate_ldf", generator, GENERATOR_RULES) == P(None, None, "tensor")
    # batch -> (data, fsdp): 8 rows split 8 ways, 4 rows cannot and stay replicated.
    mesh = make_mesh(jax.devices(), {"data": 2, "fsdp": 4})
    assert logical_to_spec(("batch", "seq"), mesh, LEARNER_RULES, (8, 5)) == P(
        ("data", "fsdp"), None
    )
    assert logical_to_spec(("batch", "seq"), mesh, LEARNER_RULES, (4, 5)) == P(None, None)


def test_specs_smollm2_three_kv_heads_on_two_way_tensor():
    config = get_preset("smollm2_135m")
    mesh = make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    shardings = logical_to_shardings(
        logical_axes(config), mesh, LEARNER_RULES, shapes=abstract_params(config)
    )
    layers = shardings["layers"]
    assert layers["w_k_ldkh"].spec == P(None, "fsdp", None, None)  # 3 kv heads % 2 != 0
    assert layers["w_q_ldnh"].spec == P(None, "fsdp", None, None)  # 9 heads % 2 != 0
    assert layers["w_up_ldf"].spec == P(None, "fsdp", "tensor")  # 1536 = 2 * 768
    assert shardings["embed_vd"].spec == P("tensor", "fsdp")  # 49152 / 2, 576 / 4


def test_spec_rules_errors_and_axis_reuse():
    mesh = make_mesh(jax.devices(), {"tensor": 8})
    rules = {"a": "tensor", "b": "tensor", "c": "pipeline"}
    # A mesh axis shards at most one dim of an array.
    assert logical_to_spec(("a", "b"), mesh, rules, (8, 8)) == P("tensor", None)
    with pytest.raises(ValueError, match="logical axis 'd' has no rule"):
        logical_to_spec(("d",), mesh, rules)
    with pytest.raises(ValueError, match="rule 'c' -> 'pipeline'"):
        logical_to_spec(("c",), mesh, rules)
    with pytest.raises(ValueError, match="do not match shape"):
        logical_to_spec(("a",), mesh, rules, (8, 8))


def test_sharded_forward_and_logprobs_equal_unsharded():
    params = init_params(TINY, 0)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 512, (4, 6)), jnp.int32)
    pos = jnp.tile(jnp.arange(6), (4, 1))

    def score(params, ids, pos):
        h, _ = forward(params, TINY, ids, pos)
        return target_logprobs(h, unembed(params, TINY), ids, temperature=0.7, chunk=4)

    ref_logp, ref_ent = jax.jit(score)(params, ids, pos)

    mesh = make_mesh(jax.devices(), {"data": 2, "fsdp": 2, "tensor": 2})
    shardings = logical_to_shardings(
        logical_axes(TINY), mesh, LEARNER_RULES, shapes=abstract_params(TINY)
    )
    sharded = jax.device_put(params, shardings)
    assert sharded["layers"]["w_q_ldnh"].sharding.spec == P(None, "fsdp", "tensor", None)
    batch = NamedSharding(mesh, logical_to_spec(("batch", "seq"), mesh, LEARNER_RULES, (4, 6)))
    logp, ent = jax.jit(score)(sharded, jax.device_put(ids, batch), jax.device_put(pos, batch))
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)


def test_sharded_cached_decode_equals_unsharded():
    params = init_params(TINY, 1)
    ids = jnp.array([[3, 5, 7], [11, 13, 0]], jnp.int32)
    pos = jnp.array([[0, 1, 2], [0, 1, -1]], jnp.int32)

    def step(params, ids, pos, cache):
        h, cache = forward(params, TINY, ids, pos, cache)
        return logits_from_hidden(h, unembed(params, TINY)), cache

    ref_logits, ref_cache = jax.jit(step)(params, ids, pos, init_kv_cache(TINY, 2, 8))

    mesh = make_mesh(jax.devices(), {"data": 2, "tensor": 4})
    shardings = logical_to_shardings(
        logical_axes(TINY), mesh, GENERATOR_RULES, shapes=abstract_params(TINY)
    )
    cache = init_kv_cache(TINY, 2, 8)
    cache_shardings = logical_to_shardings(
        KVCache(KV_CACHE_LOGICAL_AXES, KV_CACHE_LOGICAL_AXES), mesh, GENERATOR_RULES, shapes=cache
    )
    assert cache_shardings.k_lbskh.spec == P(None, "data", None, None, None)
    logits, cache = jax.jit(step)(
        jax.device_put(params, shardings), ids, pos, jax.device_put(cache, cache_shardings)
    )
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    np.testing.assert_allclose(cache.k_lbskh, ref_cache.k_lbskh, atol=1e-6)
