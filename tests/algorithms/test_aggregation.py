"""Loss aggregation modes, global normalisers and micro-batch invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.algorithms.aggregation import AGGREGATION_MODES, aggregate, batch_normalizers

NAN = float("nan")
# Sequence 0: valid losses [1, 2, 3] (sum 6, mean 2); sequence 1: [4] (sum 4, mean 4);
# sequence 2: empty (never counts). NaN/Inf behind the mask must not leak.
LOSS = [[1.0, 2.0, 3.0, NAN], [4.0, float("inf"), NAN, 0.0], [NAN, NAN, NAN, NAN]]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
EXPECTED = {
    "token-mean": 2.5,  # (1+2+3+4)/4
    "seq-mean-token-sum": 5.0,  # (6+4)/2
    "seq-mean-token-mean": 3.0,  # (2+4)/2
    "seq-mean-token-sum-norm": 1.25,  # (6+4)/(2*4), max_tokens=4
}


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_modes_by_hand(mode):
    out = aggregate(jnp.array(LOSS), jnp.array(MASK), mode, max_tokens=4)
    np.testing.assert_allclose(out, EXPECTED[mode], rtol=1e-6)


def test_batch_normalizers_skip_empty_rows():
    num_tokens, num_sequences = batch_normalizers(jnp.array(MASK))
    assert float(num_tokens) == 4.0 and float(num_sequences) == 2.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_is_finite_and_zero_behind_mask(mode):
    grad = jax.grad(lambda loss: aggregate(loss, jnp.array(MASK), mode, max_tokens=4))(
        jnp.array(LOSS)
    )
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(np.asarray(grad)[np.array(MASK) == 0], 0.0)


def test_micro_batch_invariance_pitfall_vector():
    """rl_pitfalls: token losses [1, 1] and [0]*8, token-mean -> 0.2 either way."""
    full_loss = jnp.array([[1.0, 1.0] + [0.0] * 6, [0.0] * 8])
    full_mask = jnp.array([[1.0, 1.0] + [0.0] * 6, [1.0] * 8])
    full = aggregate(full_loss, full_mask, "token-mean")
    np.testing.assert_allclose(full, 0.2, rtol=1e-6)
    num_tokens, num_sequences = batch_normalizers(full_mask)
    micro = [
        (jnp.array([[1.0, 1.0]]), jnp.array([[1.0, 1.0]])),
        (jnp.array([[0.0] * 8]), jnp.array([[1.0] * 8])),
    ]

    def summed(losses):
        return sum(
            aggregate(loss, m, "token-mean", num_tokens=num_tokens, num_sequences=num_sequences)
            for loss, (_, m) in zip(losses, micro, strict=True)
        )

    np.testing.assert_allclose(summed([loss for loss, _ in micro]), 0.2, rtol=1e-6)
    # The wrong way (local means weighted by sample share) gives 0.5.
    wrong = 0.5 * aggregate(*micro[0], "token-mean") + 0.5 * aggregate(*micro[1], "token-mean")
    np.testing.assert_allclose(wrong, 0.5, rtol=1e-6)
    # Gradients: every valid token gets 1/10 in both layouts.
    g_full = jax.grad(lambda loss: aggregate(loss, full_mask, "token-mean"))(full_loss)
    np.testing.assert_allclose(g_full[0, :2], [0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(g_full[1], [0.1] * 8, rtol=1e-6)
    g_micro = jax.grad(summed)([loss for loss, _ in micro])
    np.testing.assert_allclose(g_micro[0], [[0.1, 0.1]], rtol=1e-6)
    np.testing.assert_allclose(g_micro[1], [[0.1] * 8], rtol=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_any_split_sums_to_full_batch(mode):
    rng = np.random.default_rng(0)
    loss = jnp.array(rng.normal(size=(6, 5)), jnp.float32)
    mask = jnp.array(rng.random((6, 5)) < 0.6, jnp.float32).at[2].set(0.0)
    num_tokens, num_sequences = batch_normalizers(mask)
    kw = dict(num_tokens=num_tokens, num_sequences=num_sequences, max_tokens=5)
    full = aggregate(loss, mask, mode, max_tokens=5)
    parts = aggregate(loss[:1], mask[:1], mode, **kw) + aggregate(loss[1:4], mask[1:4], mode, **kw)
    parts = parts + aggregate(loss[4:], mask[4:], mode, **kw)
    np.testing.assert_allclose(parts, full, rtol=1e-5, atol=1e-6)


def test_all_masked_gives_zero_not_nan():
    for mode in AGGREGATION_MODES:
        out = aggregate(jnp.full((2, 3), NAN), jnp.zeros((2, 3)), mode, max_tokens=3)
        assert float(out) == 0.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate(jnp.zeros((1, 2)), jnp.ones((1, 2)), "mean")
    with pytest.raises(ValueError, match="mask_bt"):
        aggregate(jnp.zeros((1, 2)), jnp.ones((1, 3)), "token-mean")
    with pytest.raises(ValueError, match="loss_bt"):
        aggregate(jnp.zeros(2), jnp.ones(2), "token-mean")
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(jnp.zeros((1, 2)), jnp.ones((1, 2)), "seq-mean-token-sum-norm")


def test_batch_sharded_over_fake_mesh_matches_single_device():
    """Global sums under a batch-sharded layout (8 fake CPU devices) equal the plain result."""
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs the 8 fake CPU devices from conftest")
    mesh = jax.sharding.Mesh(devices, ("batch",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch", None))
    rng = np.random.default_rng(2)
    loss = jnp.array(rng.normal(size=(8, 4)), jnp.float32)
    mask = jnp.array(rng.random((8, 4)) < 0.5, jnp.float32)
    fn = jax.jit(lambda x, m: aggregate(x, m, "seq-mean-token-mean"))
    sharded = fn(jax.device_put(loss, spec), jax.device_put(mask, spec))
    np.testing.assert_allclose(sharded, aggregate(loss, mask, "seq-mean-token-mean"), rtol=1e-6)
