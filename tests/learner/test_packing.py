"""learner.packing: rows packed with segment ids give the unpacked batch's logprobs,
loss, gradients and counts; micro-batch invariance holds over packed rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.learner.batching import pack_batch, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.packing import pack_rows, padding_fraction, unpack_rows
from jaxflash.learner.scoring import make_logprob_fn
from jaxflash.learner.state import from_params
from jaxflash.learner.step import make_grad_fn, make_train_step
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.types import FinishReason, Sample, SamplingParams

MODEL = get_preset("tiny")
PROMPTS, RESPONSES = [3, 5, 2, 7, 4, 3], [10, 2, 4, 1, 12, 3]
SAMPLING = SamplingParams(temperature=0.7, top_k=0, top_p=1.0)


def _samples():
    rng = np.random.default_rng(0)
    out = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        out.append(
            Sample(
                prompt_id=i, sample_index=0,
                prompt_tokens=rng.integers(3, MODEL.vocab_size, p).astype(np.int32),
                response_tokens=rng.integers(3, MODEL.vocab_size, r).astype(np.int32),
                behaviour_logprobs=rng.uniform(-4, -1, r).astype(np.float32),
                token_versions=np.zeros(r, np.int32), start_version=0,
                finish_reason=FinishReason.EOS, reward=1.0,
            )
        )  # fmt: skip
    return out


def _config(**kw):
    base = dict(lr=1e-2, micro_batch_size=2, sampling=SAMPLING, logprob_chunk=8)
    return LearnerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def world():
    mesh = make_mesh(jax.devices()[:2], {"fsdp": 2})
    params = init_params(MODEL, seed=0)
    adv = np.array([1.0, -0.5, 2.0, -1.0, 0.5, 1.5], np.float32)
    return mesh, params, pack_batch(_samples(), adv, length_multiple=8)


def test_rows_are_packed_with_restarting_positions(world):
    _, _, batch = world
    packed, where = pack_rows(batch)
    assert batch.input_ids_bt.shape == (6, 16) and packed.input_ids_bt.shape[1] == 16
    # Needs 12, 6, 5, 7, 15, 5 tokens (through the last target): 15 | 12 | 7 6 | 5 5.
    assert packed.input_ids_bt.shape[0] == 4
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        row, o, n = where.row[i], where.offset[i], where.length[i]
        assert n == p + r - 1  # the last input token predicts nothing
        np.testing.assert_array_equal(packed.positions_bt[row, o : o + n], np.arange(n))
        assert len(set(packed.segment_ids_bt[row, o : o + n])) == 1
    for name in ("loss_mask_bt", "target_ids_bt", "advantages_bt", "behaviour_logp_bt"):
        back = unpack_rows(getattr(packed, name), where, batch.loss_mask_bt.shape)
        m = batch.loss_mask_bt > 0
        np.testing.assert_array_equal(back[m], getattr(batch, name)[m])
    assert packed.loss_mask_bt.sum() == batch.loss_mask_bt.sum()
    assert padding_fraction(packed) < padding_fraction(batch)
    with pytest.raises(ValueError, match="already packed"):
        pack_rows(packed)


def test_packed_logprobs_equal_the_unpacked_ones(world):
    mesh, params, batch = world
    got = {}
    for packing in (False, True):
        fn = make_logprob_fn(MODEL, _config(packing=packing), mesh, LEARNER_RULES)
        got[packing] = fn(jax.device_put(params), batch)
    m = batch.loss_mask_bt > 0
    for a, b in zip(got[False], got[True], strict=True):
        np.testing.assert_allclose(a[m], b[m], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
def test_packed_loss_grads_and_counts_equal_the_unpacked_ones(world, aggregation):
    """Micro-batch invariance too: 2 packed rows per micro-batch vs all 4 in one."""
    _, params, batch = world
    packed, _ = pack_rows(batch)
    runs = []
    for lc, b, micro in (
        (_config(aggregation=aggregation), batch, 2),
        (_config(aggregation=aggregation, packing=True), packed, 2),
        (_config(aggregation=aggregation, packing=True), packed, 4),
    ):
        fields = {
            k: jnp.asarray(v)
            for k, v in vars(split_micro_batches(b, micro)).items()
            if v is not None
        }
        runs.append(jax.jit(make_grad_fn(MODEL, lc))(params, params, fields, jnp.int32(0)))
    (loss0, g0, m0), *rest = runs
    assert float(m0["clip_frac"]) > 0
    for loss, g, m in rest:
        np.testing.assert_allclose(float(loss), float(loss0), rtol=2e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
            rel = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
            assert rel < 1e-5
        for k in ("tokens", "sequences", "entropy", "clip_frac", "ratio_max"):
            np.testing.assert_allclose(float(m[k]), float(m0[k]), rtol=1e-5, err_msg=k)
    assert float(rest[0][2]["sequences"]) == 6.0  # segments are counted, not rows


def test_a_packing_step_trains_on_its_own_logprobs_with_zero_gap(world):
    mesh, params, batch = world
    lc = _config(packing=True)
    logp, _ = make_logprob_fn(MODEL, lc, mesh, LEARNER_RULES)(jax.device_put(params), batch)
    batch.behaviour_logp_bt = np.where(batch.loss_mask_bt > 0, logp, 0.0).astype(np.float32)
    step = make_train_step(MODEL, lc, mesh, LEARNER_RULES)
    _, metrics = step(from_params(params, MODEL, lc, mesh, LEARNER_RULES), batch)
    metrics = jax.device_get(metrics)
    assert metrics["logprob_gap_max"] < 1e-5 and metrics["sequences"] == 6.0
    assert metrics["tokens"] == sum(RESPONSES)


def test_packing_refuses_what_reads_a_row_as_one_sequence():
    with pytest.raises(ValueError, match="token-level loss"):
        LearnerConfig(packing=True, loss="gspo")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        LearnerConfig(packing=True, aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match="replay_loss"):
        LearnerConfig(packing=True, replay_loss="ppo")
    with pytest.raises(ValueError, match="pack_length"):
        LearnerConfig(pack_length=-1)
