"""Router replay (R3) for MoE: the engine records every fed token's experts per layer,
they travel with the sample (train batch, the generation programs' wire, the replay
buffer's checkpoint, partial rollout across a publish), and the learner replays them
under ``LearnerConfig.router_replay`` with gate weights from its live router.

One tiny MoE (tiny_moe: 2 layers, 8 experts, top-2, renormalised, fp32) and one engine
for the module; the learner's scorer and gradient programs compile once each per
replay mode.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.slot_loop import SlotBatcher, run_requests
from jaxflash.learner.batching import pack_batch, split_micro_batches
from jaxflash.learner.config import LearnerConfig
from jaxflash.learner.packing import pack_rows
from jaxflash.learner.scoring import policy_logprobs
from jaxflash.learner.step import make_grad_fn
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder import transformer
from jaxflash.models.decoder.logprobs import target_logprobs
from jaxflash.replay.replay_entry import (
    ReplayEntry,
    decode_arrays,
    encode_arrays,
    pack_entries,
    unpack_entries,
)
from jaxflash.runtime.fleet.rpc_wire import decode, encode, sample_from_message, sample_message
from jaxflash.types import GenerationRequest, SamplingParams
from tests.models.test_moe import MOE, _spread_params

L, K = MOE.n_layers, MOE.n_experts_per_token
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=10)
PROMPTS = [(0, 5), (1, 9), (2, 12)]  # (prompt_id, prompt length)


def _request(pid, n, max_new=10):
    tokens = (np.arange(n, dtype=np.int32) * 37 + 11 * pid + 3) % MOE.vocab_size
    sampling = dataclasses.replace(SAMPLING, max_new_tokens=max_new)
    return GenerationRequest(prompt_id=pid, sample_index=0, prompt_tokens=tokens, sampling=sampling)


@pytest.fixture(scope="module")
def params_a():
    return jax.device_get(_spread_params(MOE, seed=4))


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=16, max_target_length=32)
    return LlamaEngine(MOE, cfg)


@pytest.fixture(scope="module")
def samples(engine, params_a):
    reqs = [_request(pid, n) for pid, n in PROMPTS]
    return run_requests(engine, params_a, reqs, policy_version=0, eos_id=-1, decode_block=4)


@pytest.fixture(scope="module")
def batch(samples):
    return pack_batch(samples, np.ones(len(samples)), length_multiple=8)


@jax.jit
def _live_routes(params, ids_bt):
    pos = jnp.broadcast_to(jnp.arange(ids_bt.shape[1], dtype=jnp.int32), ids_bt.shape)
    return transformer.forward_routed(params, MOE, ids_bt, pos)[3]


@jax.jit
def _score(params, b, replay):
    """Learner-side per-token log q(target) and the live routes, replaying ``replay``."""
    h, _, _, live = transformer.forward_routed(
        params, MOE, b["input_ids_bt"], b["positions_bt"], replay_btlk=replay
    )
    logp = target_logprobs(h, transformer.unembed(params, MOE), b["target_ids_bt"], chunk=8)[0]
    return logp, live


def _fields(batch):
    return {k: jnp.asarray(v) for k, v in vars(batch).items() if v is not None}


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _flip_router(params, routes_xlk):
    """Params whose router, in some layer l, sends tokens to an expert e that none of
    the recorded routes ``routes_xlk`` [n, L, k] of layer l uses (column e raised by 3x
    the most used expert's column): flips without replay, and changes no bit of the
    replayed experts' logits. None when every expert is used in every layer."""
    for layer in range(L - 1, -1, -1):
        used = np.bincount(routes_xlk[:, layer].ravel(), minlength=MOE.n_experts)
        if np.any(used == 0):
            e, f = int(np.argmin(used)), int(np.argmax(used))
            w = np.array(params["layers"]["w_router_lde"])
            w[layer, :, e] += 3.0 * w[layer, :, f]
            layers = {**params["layers"], "w_router_lde": w}
            return {**params, "layers": layers}, layer
    return None


@pytest.fixture(scope="module")
def short(samples, params_a):
    """(one-row batch, flipped params, layer): the longest prefix of a sample (at least
    two response tokens) whose recorded routes leave an expert of some layer unused,
    and ``_flip_router`` of it (a deterministic choice for these seeds)."""
    for s in samples:
        p = len(s.prompt_tokens)
        for r in range(len(s.response_tokens), 1, -1):
            flipped = _flip_router(params_a, s.routed_experts[: p + r - 1])
            if flipped is not None:
                cut = dataclasses.replace(
                    s,
                    response_tokens=s.response_tokens[:r],
                    behaviour_logprobs=s.behaviour_logprobs[:r],
                    token_versions=s.token_versions[:r],
                    routed_experts=np.concatenate([s.routed_experts[: p + r - 1],
                                                   np.full((1, L, K), -1, np.int16)]),
                )  # fmt: skip
                return pack_batch([cut], [1.0], length_multiple=8), *flipped
    raise AssertionError("every prefix of every sample uses every expert in every layer")


# --------------------------------------------------------------------- the engine


def test_engine_records_each_fed_tokens_routes(samples, params_a):
    """Prompt tokens (prefill) and response tokens (decode, at the step that sampled the
    next one) carry the experts the learner's full-sequence forward routes them to; the
    last response token was never fed (-1)."""
    for s in samples:
        p, r = len(s.prompt_tokens), len(s.response_tokens)
        routes = s.routed_experts
        assert routes.shape == (p + r, L, K) and routes.dtype == np.int16
        assert np.all(routes[-1] == -1) and np.all(routes[:-1] >= 0)
        ids = np.concatenate([s.prompt_tokens, s.response_tokens])[None]
        live = np.asarray(_live_routes(params_a, jnp.asarray(ids)))[0]
        np.testing.assert_array_equal(routes[:-1], live[:-1])


# -------------------------------------------------------------- the learner's replay


def test_replay_keeps_logprobs_bitwise_when_a_perturbed_router_flips_experts(
    params_a, batch, short
):
    """Replaying the engine's own routes changes no bit; a router perturbed to send
    tokens to another expert moves the logprobs without replay, and changes none of
    their bits with it (the replayed experts' weights read only their own logits)."""
    fields, valid = _fields(batch), batch.loss_mask_bt > 0
    logp_a, live_a = _score(params_a, fields, None)
    logp_a_replay, _ = _score(params_a, fields, jnp.asarray(batch.routed_experts_btlk))
    np.testing.assert_array_equal(_bits(logp_a)[valid], _bits(logp_a_replay)[valid])
    recorded = batch.routed_experts_btlk >= 0
    np.testing.assert_array_equal(np.asarray(live_a)[recorded], batch.routed_experts_btlk[recorded])

    one, params_b, layer = short
    fields, valid = _fields(one), one.loss_mask_bt > 0
    routes = one.routed_experts_btlk
    logp_a, _ = _score(params_a, fields, None)
    logp_b, live_b = _score(params_b, fields, None)
    logp_b_replay, _ = _score(params_b, fields, jnp.asarray(routes))
    rows = routes[..., 0, 0] >= 0
    flips = np.any(
        np.sort(np.asarray(live_b)[..., layer, :], -1) != np.sort(routes[..., layer, :], -1), -1
    )[rows]
    moved = np.abs(np.asarray(logp_b) - np.asarray(logp_a))[valid]
    print(f"layer {layer}: {flips.sum()} of {flips.size} tokens flip; max |dlogp| {moved.max()}")
    assert flips.sum() >= 1 and moved.max() > 1e-3
    np.testing.assert_array_equal(_bits(logp_b_replay)[valid], _bits(logp_a)[valid])


LC = LearnerConfig(lr=1e-2, micro_batch_size=2, loss="ppo", logprob_chunk=8)


@pytest.fixture(scope="module")
def grad_fns():
    return {r: jax.jit(make_grad_fn(MOE, LC.replace(router_replay=r))) for r in (False, True)}


def test_router_gets_gradients_under_replay_and_mismatch_is_counted(params_a, short, grad_fns):
    """Under replay the router's gradient is nonzero (gate weights from the live
    logits) and equals the unreplayed one when the routes agree; the step metric
    router_mismatch_frac is 0 for the sampling params and counts the flipped decisions
    of a perturbed router with and without replay; the replayed loss of the perturbed
    router equals the sampling params' bit for bit."""
    b, params_b, _ = short
    mu = np.asarray(_score(params_a, _fields(b), None)[0])
    b = dataclasses.replace(b, behaviour_logp_bt=np.where(b.loss_mask_bt > 0, mu - 0.1, 0.0))
    fields = _fields(split_micro_batches(b, 2))
    version = jnp.int32(0)
    out = {r: grad_fns[r](params_a, params_a, fields, version) for r in (False, True)}
    for r in (False, True):  # (loss, grads, metrics)
        g = np.asarray(out[r][1]["layers"]["w_router_lde"])
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, r
        assert float(out[r][2]["router_mismatch_frac"]) == 0.0
    np.testing.assert_allclose(
        out[True][1]["layers"]["w_router_lde"], out[False][1]["layers"]["w_router_lde"], rtol=1e-6
    )
    out_b = {r: grad_fns[r](params_b, params_b, fields, version) for r in (False, True)}
    frac = {r: float(out_b[r][2]["router_mismatch_frac"]) for r in (False, True)}
    print(f"router_mismatch_frac without / with replay: {frac[False]:.4f} / {frac[True]:.4f}")
    assert frac[False] > 0 and frac[True] > 0
    assert float(out_b[True][0]) == float(out[False][0])  # replay: the sampled policy's loss
    assert float(out_b[False][0]) != float(out[False][0])
    assert np.abs(np.asarray(out_b[True][1]["layers"]["w_router_lde"])).max() > 0


def test_replay_needs_routes_and_experts(batch):
    with pytest.raises(ValueError, match="router_replay needs a model with experts"):
        make_grad_fn(get_preset("tiny"), LC.replace(router_replay=True))
    no_routes = {k: v for k, v in _fields(batch).items() if k != "routed_experts_btlk"}
    with pytest.raises(ValueError, match="routes absent"):
        policy_logprobs({}, no_routes, MOE, LC.replace(router_replay=True))
    with pytest.raises(ValueError, match="replay_btlk"):
        transformer.forward_routed(
            {"layers": {}}, MOE, jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32),
            replay_btlk=jnp.zeros((1, 3, L, K + 1), jnp.int32),
        )  # fmt: skip


# ------------------------------------------------------------------ the routes travel


def test_routes_survive_wire_packing_and_replay_checkpoint(samples, batch):
    """The generation programs' wire, the learner's packing and micro-batches, and the
    replay buffer's checkpoint carry the routes bit for bit."""
    for s in samples:
        header, arrays = decode(encode(*sample_message(s)))
        back = sample_from_message(header, arrays)
        assert back.routed_experts.dtype == np.int16
        np.testing.assert_array_equal(back.routed_experts, s.routed_experts)
    packed, placement = pack_rows(batch, row_length=64)
    for i in range(len(samples)):
        o, n = placement.offset[i], placement.length[i]
        np.testing.assert_array_equal(
            packed.routed_experts_btlk[placement.row[i], o : o + n],
            batch.routed_experts_btlk[i, :n],
        )
    split = split_micro_batches(batch, 2)  # 3 rows -> 2 x 2, the padding row all -1
    assert split.routed_experts_btlk.shape == (2, 2, *batch.routed_experts_btlk.shape[1:])
    assert np.all(split.routed_experts_btlk[1, 1] == -1)
    entries = [
        ReplayEntry(
            uid=i,
            sample=dataclasses.replace(s, reward=1.0),
            advantage=np.float32(0.5),
            prompt_key=str(i),
            start_version=0,
            ingest_version=0,
            replays=0,
        )
        for i, s in enumerate(samples)
    ]
    entries[1] = dataclasses.replace(  # a sample without routes (a dense model's) too
        entries[1], sample=dataclasses.replace(entries[1].sample, routed_experts=None)
    )
    arrays, meta = pack_entries(entries)
    back = unpack_entries(decode_arrays(encode_arrays(arrays)), meta)
    for e, b in zip(entries, back, strict=True):
        if e.sample.routed_experts is None:
            assert b.sample.routed_experts is None
        else:
            np.testing.assert_array_equal(b.sample.routed_experts, e.sample.routed_experts)


@pytest.mark.parametrize("in_flight", ["continue", "recompute"])
def test_partial_rollout_keeps_earlier_tokens_routes(engine, params_a, samples, in_flight):
    """A publish in the middle of a sample: the tokens fed before it keep the routes an
    uninterrupted run recorded (recompute's re-prefill adds only the unrecorded last
    token's); every later fed token has a route."""
    req = _request(*PROMPTS[1])
    full = samples[1]
    p = len(req.prompt_tokens)
    batcher = SlotBatcher(engine, params_a, policy_version=0, eos_id=-1, decode_block=4)
    batcher.add(req)
    batcher.step()  # prefill + first token + 4 decode steps
    params_b = jax.tree.map(lambda x: 1.5 * x, params_a)  # other weights: other routes
    batcher.set_params(params_b, 1, in_flight=in_flight)
    (got,) = [s for _ in range(5) for s in batcher.step()]
    assert got.token_versions.tolist() == [0] * 5 + [1] * 5
    fed_before = p + 4  # prompt, then response tokens 0..3 were fed under version 0
    np.testing.assert_array_equal(got.routed_experts[:fed_before], full.routed_experts[:fed_before])
    assert np.all(got.routed_experts[:-1] >= 0) and np.all(got.routed_experts[-1] == -1)
    np.testing.assert_array_equal(got.response_tokens[:5], full.response_tokens[:5])
