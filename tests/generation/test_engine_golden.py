"""Engine outputs are bit-identical to goldens recorded before the engine was optimised.

The goldens in ``tests/data/engine_golden.npz`` were recorded from the engine as of
commit 45e787d (layer ``lax.scan``, batch-1 prefill, one decode step per dispatch)
with ``python -m tests.generation.test_engine_golden --record`` — run it again only to
re-baseline on purpose. Every later engine change (unrolled layers, in-place cache
updates, block decoding, batched prefill, bucketed attention) must reproduce every
token and every behaviour logprob bit for bit, for the same seeds.

Goldens are specific to the CPU backend of the jax version they were recorded with
(float results depend on XLA's kernels); the test skips on any other platform or
jax version rather than compare numbers from a different machine. Within that, the
host's vector ISA still changes XLA CPU's rounding: on an AVX-512 host the goldens
(recorded on another host) gave every token, slot and length bit-equal and 34-80 of
~220 logprobs 1-2 ulp apart (SmolLM2's 30 layers: every token equal, logprobs up to
3.1e-5 apart). So tokens and every integer field compare exactly, and logprobs
within ``LOGP_ULPS`` units in the last place (tiny model) or ``SMOLLM2_LOGP_ATOL``
(SmolLM2): a change that
alters what is sampled or how a logprob is computed moves far more than that
(bit-identity between the engine's own paths on one host is checked exactly by
test_engine_block and test_generation_prefix_sharing).

Cases: the tiny model through ``run_requests`` (continuous batching with refills,
prefix sharing on and off, T=1 / top-k+top-p / greedy), the JetStream-style path
(prefill, insert emitting the prefill token, one ``generate`` per step) and, as a
slow test, SmolLM2-135M with its real weights.
"""

from __future__ import annotations

import argparse
import os
import sys

from tests.paths import TESTS

if __name__ == "__main__":  # record under the same device setup as tests/conftest.py
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.api import EngineApi
from jaxflash.generation.jetstream.state import result_logprobs
from jaxflash.generation.slot_loop import run_requests
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.types import GenerationRequest, SamplingParams

GOLDEN = os.path.join(TESTS, "data", "engine_golden.npz")
RECORDED_WITH = ("cpu", "0.10.2")  # (platform, jax version) of the recording
TINY = get_preset("tiny")
NO_EOS = -1
LOGP_ULPS = 4  # float32 logprob bound across host ISAs; measured 2 (see above)
SMOLLM2_LOGP_ATOL = 1e-4  # the same for 30 real layers; measured 3.1e-5
SAMPLINGS = {
    "t1": dict(temperature=1.0, top_k=0, top_p=1.0),
    "t07_k20_p09": dict(temperature=0.7, top_k=20, top_p=0.9),
}


def _requests(sampling: dict, *, n_prompts: int, group: int, vocab: int, seed: int):
    """Prompts of varied lengths (3..16 tokens) and budgets, G samples each."""
    out = []
    for p in range(n_prompts):
        length = 3 + (p * 5) % 14
        tokens = (np.arange(length, dtype=np.int32) * 37 + 11 * p + 1) % vocab
        for g in range(group):
            out.append(
                GenerationRequest(
                    prompt_id=100 + p,
                    sample_index=g,
                    prompt_tokens=tokens,
                    sampling=SamplingParams(max_new_tokens=4 + (7 * p + 3 * g) % 25, **sampling),
                    seed=seed,
                )
            )
    return out


def _flatten(samples) -> dict[str, np.ndarray]:
    return {
        "lengths": np.asarray([len(s.response_tokens) for s in samples], np.int32),
        "tokens": np.concatenate([s.response_tokens for s in samples]).astype(np.int32),
        "logp_bits": np.concatenate([s.behaviour_logprobs for s in samples])
        .astype(np.float32)
        .view(np.int32),
    }


def tiny_cases() -> dict[str, np.ndarray]:
    """Every tiny-model case, as flat arrays keyed '<case>/<field>'."""
    params = init_params(TINY, seed=0)
    out: dict[str, np.ndarray] = {}
    for name, sampling in [*SAMPLINGS.items(), ("greedy", SAMPLINGS["t07_k20_p09"])]:
        engine = LlamaEngine(
            TINY,
            EngineConfig(
                max_concurrent_decodes=3,
                max_prefill_length=16,
                max_target_length=48,
                greedy=name == "greedy",
                **sampling,
            ),
        )
        reqs = _requests(sampling, n_prompts=7, group=2, vocab=TINY.vocab_size, seed=3)
        for share in (True, False):
            samples = run_requests(
                engine, params, reqs, policy_version=0, eos_id=NO_EOS, share_prefix=share
            )
            for k, v in _flatten(samples).items():
                out[f"{name}_share{int(share)}/{k}"] = v
        # An EOS that does occur: the most frequent token of the t1 run.
        if name == "t1":
            eos = int(np.bincount(out["t1_share1/tokens"]).argmax())
            samples = run_requests(engine, params, reqs, policy_version=0, eos_id=eos)
            for k, v in _flatten(samples).items():
                out[f"t1_eos/{k}"] = v
            out["t1_eos/eos_id"] = np.asarray([eos], np.int32)
    # JetStream-style: prefill, insert emitting the prefill token, generate per step.
    engine = LlamaEngine(
        TINY, EngineConfig(max_concurrent_decodes=2, max_prefill_length=16, max_target_length=32)
    )
    api = EngineApi(engine)  # JetStream's Engine API over the engine
    state = api.init_decode_state()
    for slot, length in enumerate((5, 11)):
        tokens = (np.arange(length, dtype=np.int32) * 13 + 7) % TINY.vocab_size
        prefix = api.prefill(
            params=engine.place_params(params), padded_tokens=tokens, true_length=length, seed=1
        )
        state = api.insert(prefix, state, slot)
    placed = engine.place_params(params)
    rows = []
    for _ in range(30):
        state, result = api.generate(placed, state)
        data = np.asarray(jax.device_get(result.data))
        rows.append(np.stack([data[:, 0], data[:, 1], data[:, 2], data[:, 3]], axis=1))
        assert result_logprobs(data).dtype == np.float32
    out["driver/data"] = np.stack(rows).astype(np.int32)  # [steps, B, 4]
    return out


def smollm2_case() -> dict[str, np.ndarray]:
    """SmolLM2-135M (real GGUF weights), 8 prompts x 2 samples, 24 new tokens, T=1."""
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path

    config, host_params = load_gguf(smollm2_gguf_path())
    engine = LlamaEngine(
        config, EngineConfig(max_concurrent_decodes=8, max_prefill_length=64, max_target_length=96)
    )
    reqs = _requests(SAMPLINGS["t1"], n_prompts=8, group=2, vocab=config.vocab_size, seed=5)
    reqs = [
        GenerationRequest(
            prompt_id=r.prompt_id,
            sample_index=r.sample_index,
            prompt_tokens=r.prompt_tokens,
            sampling=SamplingParams(max_new_tokens=24),
            seed=r.seed,
        )
        for r in reqs
    ]
    params = engine.place_params(host_params)
    samples = run_requests(engine, params, reqs, policy_version=0, eos_id=2)
    return {f"smollm2/{k}": v for k, v in _flatten(samples).items()}


def _golden() -> dict[str, np.ndarray]:
    if (jax.default_backend(), jax.__version__) != RECORDED_WITH:
        pytest.skip(f"goldens were recorded on {RECORDED_WITH}")
    with np.load(GOLDEN) as f:
        return dict(f)


def _ulps(got_bits: np.ndarray, want_bits: np.ndarray) -> np.ndarray:
    """|difference| in float32 units in the last place, of int32 bit patterns of one sign."""
    assert np.array_equal(got_bits < 0, want_bits < 0), "logprob signs differ"
    return np.abs(got_bits.astype(np.int64) - want_bits.astype(np.int64))


def _assert_same(
    got: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
    prefix: str,
    *,
    logp_atol: float | None = None,
) -> None:
    keys = sorted(k for k in want if k.startswith(prefix))
    assert keys and sorted(k for k in got if k.startswith(prefix)) == keys
    for key in keys:
        g, w = got[key], want[key]
        assert g.shape == w.shape, (key, g.shape, w.shape)
        if key.endswith("logp_bits") and logp_atol is not None:
            np.testing.assert_allclose(g.view(np.float32), w.view(np.float32), atol=logp_atol)
        elif key.endswith("logp_bits"):
            assert _ulps(g, w).max(initial=0) <= LOGP_ULPS, key
        elif key == "driver/data":  # [steps, B, 4]: token, valid, length, logprob bits
            np.testing.assert_array_equal(g[..., :3], w[..., :3], err_msg=key)
            assert _ulps(g[..., 3], w[..., 3]).max(initial=0) <= LOGP_ULPS, key
        else:
            np.testing.assert_array_equal(g, w, err_msg=key)


def test_tiny_engine_is_bit_identical_to_goldens():
    want = _golden()
    got = tiny_cases()
    for prefix in ("t1_", "t07_", "greedy_", "driver/"):
        _assert_same(got, want, prefix)


@pytest.mark.slow
def test_smollm2_engine_is_bit_identical_to_golden():
    want = _golden()
    _assert_same(smollm2_case(), want, "smollm2/", logp_atol=SMOLLM2_LOGP_ATOL)


def _record() -> None:
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    arrays = {**tiny_cases(), **smollm2_case()}
    np.savez_compressed(GOLDEN, **arrays)
    print(f"wrote {len(arrays)} arrays to {GOLDEN}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Record engine goldens (re-baselines the test).")
    ap.add_argument("--record", action="store_true", required=True)
    ap.parse_args()
    sys.exit(_record())
