"""learner.prefix_sharing: the G samples of a prompt share one copy of it in their
packed row (``packing.pack_groups``); logprobs, loss, gradients and counts equal the
unpacked batch's up to float summation order, with fewer learner tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.learner.batching import pack_batch, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.packing import pack_groups, pack_rows, unpack_rows
from jaxflash.learner.scoring import make_logprob_fn, prefix_sharing_model
from jaxflash.learner.state import from_params
from jaxflash.learner.step import make_grad_fn, make_train_step
from jaxflash.models.caches.attention import SHARED_PREFIX_BASE, segments_visible
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import LEARNER_RULES
from jaxflash.types import FinishReason, Sample, SamplingParams

MODEL = get_preset("tiny")
SAMPLING = SamplingParams(temperature=0.7, top_k=0, top_p=1.0)
# (prompt index, response length): prompts 0 and 1 have 3 samples each, prompt 2 one,
# prompt 3 is prompt 0's tokens but one shorter (its own group).
ROWS = [(0, 6), (0, 2), (0, 9), (1, 4), (2, 5), (1, 1), (1, 7), (3, 3)]


def _samples():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, MODEL.vocab_size, n).astype(np.int32) for n in (9, 5, 7)]
    prompts.append(prompts[0][:-1])
    out = []
    for i, (p, r) in enumerate(ROWS):
        out.append(
            Sample(
                prompt_id=p, sample_index=i,
                prompt_tokens=prompts[p],
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
    adv = np.linspace(-1.5, 2.0, len(ROWS)).astype(np.float32)
    return mesh, params, pack_batch(_samples(), adv, length_multiple=8)


def test_a_group_holds_its_prompt_once(world):
    _, _, batch = world
    packed, where = pack_groups(batch, length_multiple=8)
    # 4 groups: prefixes of 8, 4, 6, 7 tokens (the prompt without its last token),
    # each continuation from the prompt's last token through its last target.
    assert packed.loss_mask_bt.sum() == batch.loss_mask_bt.sum()
    used = int((packed.segment_ids_bt > 0).sum())
    assert used == (8 + 6 + 2 + 9) + (4 + 4 + 1 + 7) + (6 + 5) + (7 + 3)
    unshared = sum((9, 5, 7, 8)[p] + r - 1 for p, r in ROWS)  # pack_rows' tokens
    assert int((pack_rows(batch)[0].segment_ids_bt > 0).sum()) == unshared == 86 > used == 62
    seg = packed.segment_ids_bt
    assert all(s >= SHARED_PREFIX_BASE for s in seg[seg > 0].ravel())
    assert len({(r, int(s) >> 16) for r in range(seg.shape[0]) for s in seg[r] if s}) == 4
    for i, (p, r) in enumerate(ROWS):
        row, o, n, c = where.row[i], where.offset[i], where.length[i], where.start[i]
        assert c == (9, 5, 7, 8)[p] - 1 and n == r
        # the continuation keeps its positions; its prefix sits just before the group
        np.testing.assert_array_equal(packed.positions_bt[row, o : o + n], np.arange(c, c + n))
        np.testing.assert_array_equal(
            packed.input_ids_bt[row, o : o + n], batch.input_ids_bt[i, c : c + n]
        )
        s = seg[row, o]
        assert s & (SHARED_PREFIX_BASE - 1) > 0 and len(set(seg[row, o : o + n])) == 1
        prefix = np.flatnonzero(seg[row] == (s >> 16) << 16)
        np.testing.assert_array_equal(packed.input_ids_bt[row, prefix], batch.input_ids_bt[i, :c])
        np.testing.assert_array_equal(packed.positions_bt[row, prefix], np.arange(c))
    for name in ("loss_mask_bt", "target_ids_bt", "advantages_bt", "behaviour_logp_bt"):
        back = unpack_rows(getattr(packed, name), where, batch.loss_mask_bt.shape)
        m = batch.loss_mask_bt > 0
        np.testing.assert_array_equal(back[m], getattr(batch, name)[m])
    with pytest.raises(ValueError, match="already packed"):
        pack_groups(packed)


def test_rows_with_other_recorded_routes_do_not_share(world):
    _, _, batch = world
    b, t = batch.input_ids_bt.shape
    routes = np.zeros((b, t, 2, 1), np.int32)
    routes[1, 0, 0, 0] = 1  # row 1's prompt was routed otherwise than rows 0 and 2
    packed, where = pack_groups(dataclasses.replace(batch, routed_experts_btlk=routes))
    seg = packed.segment_ids_bt
    groups = {(where.row[i], seg[where.row[i], where.offset[i]] >> 16) for i in range(3)}
    assert len(groups) == 2


def test_visibility_rule():
    g1p, g1a, g1b, g2p = (1 << 16), (1 << 16) | 1, (1 << 16) | 2, (2 << 16)
    seg = jnp.array([g1p, g1a, g1b, g2p, 1, 0])
    vis = np.asarray(segments_visible(seg[:, None], seg[None, :]))
    assert vis[1, 0] and vis[2, 0] and vis[1, 1]  # a branch sees its prefix and itself
    assert not vis[1, 2] and not vis[2, 1]  # not its sibling
    assert not vis[1, 3] and not vis[3, 0]  # nor another group's prefix
    assert not vis[4, 5] and not vis[5, 4] and vis[4, 4]  # plain ids: equality only


@pytest.mark.parametrize("impl", ["blockwise", "dense"])
def test_shared_logprobs_equal_the_unpacked_ones(world, impl):
    mesh, params, batch = world
    model = dataclasses.replace(MODEL, attention=impl)
    packed, where = pack_groups(batch, length_multiple=8)
    got = {}
    for name, b in (("unpacked", batch), ("shared", packed)):
        lc = _config(packing=name == "shared", prefix_sharing=name == "shared")
        fn = make_logprob_fn(model, lc, mesh, LEARNER_RULES)
        got[name] = fn(jax.device_put(params), b)
    m = batch.loss_mask_bt > 0
    for a, b in zip(got["unpacked"], got["shared"], strict=True):
        back = unpack_rows(np.asarray(b), where, m.shape)
        np.testing.assert_allclose(back[m], np.asarray(a)[m], atol=1e-5, rtol=1e-5)


def test_shared_loss_grads_and_counts_equal_the_unpacked_ones(world):
    _, params, batch = world
    packed, _ = pack_groups(batch, length_multiple=8)
    runs = []
    for lc, b, micro in (
        (_config(aggregation="seq-mean-token-sum"), batch, 2),
        (_config(aggregation="seq-mean-token-sum", packing=True, prefix_sharing=True), packed, 1),
    ):
        fields = {
            k: jnp.asarray(v)
            for k, v in vars(split_micro_batches(b, micro)).items()
            if v is not None
        }
        runs.append(jax.jit(make_grad_fn(MODEL, lc))(params, params, fields, jnp.int32(0)))
    (loss0, g0, m0), (loss, g, m) = runs
    assert float(m0["clip_frac"]) > 0
    np.testing.assert_allclose(float(loss), float(loss0), rtol=2e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
        rel = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert rel < 1e-5
    for k in ("tokens", "sequences", "entropy", "clip_frac", "ratio_max"):
        np.testing.assert_allclose(float(m[k]), float(m0[k]), rtol=1e-5, err_msg=k)
    assert float(m["sequences"]) == len(ROWS)  # continuations are counted, not groups


def test_a_prefix_sharing_step_trains_on_its_own_logprobs(world):
    mesh, params, batch = world
    lc = _config(packing=True, prefix_sharing=True, micro_batch_size=2)
    logp, _ = make_logprob_fn(MODEL, _config(), mesh, LEARNER_RULES)(jax.device_put(params), batch)
    batch = dataclasses.replace(
        batch, behaviour_logp_bt=np.where(batch.loss_mask_bt > 0, logp, 0.0).astype(np.float32)
    )
    step = make_train_step(MODEL, lc, mesh, LEARNER_RULES)
    _, metrics = step(from_params(params, MODEL, lc, mesh, LEARNER_RULES), batch)
    metrics = jax.device_get(metrics)
    assert metrics["logprob_gap_max"] < 1e-5 and metrics["sequences"] == len(ROWS)
    assert metrics["tokens"] == sum(r for _, r in ROWS)


def test_prefix_sharing_needs_packing():
    with pytest.raises(ValueError, match="packing=True"):
        LearnerConfig(prefix_sharing=True)


def test_refused_where_the_shared_layout_would_change_what_a_token_sees(world):
    """A sliding window counts packed columns (a later sample sits farther from its
    prompt than its positions say: measured 0.37 nats off on a window of 6), and the
    splash kernel compares segment ids by equality: both refused when the step is
    built, naming the setting; "auto" on a TPU takes blockwise instead of splash."""
    mesh, _, _ = world
    lc = _config(packing=True, prefix_sharing=True)
    sliding = dataclasses.replace(
        MODEL, sliding_window=6, layer_types=("sliding_attention",) * MODEL.n_layers
    )
    with pytest.raises(ValueError, match="prefix_sharing with a sliding-window"):
        make_train_step(sliding, lc, mesh, LEARNER_RULES)
    with pytest.raises(ValueError, match="prefix_sharing with a sliding-window"):
        make_logprob_fn(sliding, lc, mesh, LEARNER_RULES)
    with pytest.raises(ValueError, match="splash"):
        make_train_step(dataclasses.replace(MODEL, attention="splash"), lc, mesh, LEARNER_RULES)
    make_train_step(sliding, _config(packing=True), mesh, LEARNER_RULES)  # rows: fine
    # "auto" would take splash on a TPU: the learner runs blockwise there instead
    auto = dataclasses.replace(MODEL, attention="auto")
    assert prefix_sharing_model(auto, lc, "tpu").attention == "blockwise"
    assert prefix_sharing_model(auto, lc, "cpu") is auto
    assert prefix_sharing_model(auto, _config(packing=True), "tpu") is auto
