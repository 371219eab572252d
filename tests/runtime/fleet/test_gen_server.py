"""GenerationServer: a thread per engine, submit / abort / weight updates / stop /
errors, and per-sample RNG independent of the server (tiny fp32 model)."""

import queue
import threading
import time

import jax
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.slot_loop import run_requests
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.runtime.fleet.gen_server import GenerationServer, GenerationServerError
from jaxflash.sharding.mesh import make_mesh
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams

CFG = get_preset("tiny")
NO_EOS = -1
ENGINE_CFG = EngineConfig(
    max_concurrent_decodes=2, max_prefill_length=16, max_target_length=40, temperature=1.0
)
WAIT_S = 60.0  # generous: 2 shared CPU cores


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def engine():
    return LlamaEngine(CFG, ENGINE_CFG, mesh=make_mesh(jax.devices()[:1], {}))


def request(prompt_id, prompt_len, max_new, sample_index=0):
    tokens = (np.arange(prompt_len, dtype=np.int32) * 37 + 11 * prompt_id) % CFG.vocab_size
    return GenerationRequest(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=tokens,
        sampling=SamplingParams(max_new_tokens=max_new, temperature=1.0),
    )


def collect(out, n):
    """n samples from a queue filled by on_finished, keyed (prompt_id, sample_index)."""
    got = {}
    for _ in range(n):
        s = out.get(timeout=WAIT_S)
        got[(s.prompt_id, s.sample_index)] = s
    return got


def test_two_servers_on_two_meshes_match_one_batcher(engine, params):
    reqs = [request(p, 3 + 2 * p, 5 + p, sample_index=i) for p in range(3) for i in range(2)]
    want = run_requests(engine, params, reqs, policy_version=0, eos_id=NO_EOS)
    out = queue.Queue()
    servers = [
        GenerationServer(
            f"gen{d}",
            LlamaEngine(CFG, ENGINE_CFG, mesh=make_mesh(jax.devices()[d : d + 1], {})),
            params,
            policy_version=0,
            eos_id=NO_EOS,
            partial_rollout="continue",
            on_finished=out.put,
        )
        for d in (1, 2)
    ]
    for s in servers:
        s.start()
    for i, r in enumerate(reqs):
        servers[i % 2].submit(r)
    got = collect(out, len(reqs))
    for s in servers:
        assert s.stop() == []
        assert s.stats()["delivered"] == 3 and s.load == 0
    for w in want:
        g = got[(w.prompt_id, w.sample_index)]
        np.testing.assert_array_equal(g.response_tokens, w.response_tokens)
        np.testing.assert_allclose(g.behaviour_logprobs, w.behaviour_logprobs, atol=1e-5)


def test_abort_queued_and_running(engine, params):
    out, release = queue.Queue(), threading.Event()

    def on_finished(sample):
        out.put(sample)
        release.wait(WAIT_S)  # hold the server after its first delivery

    server = GenerationServer(
        "g",
        engine,
        params,
        policy_version=0,
        eos_id=NO_EOS,
        partial_rollout="continue",
        on_finished=on_finished,
    )
    server.submit(request(9, 4, 5))
    assert server.abort_prompt(9) == 1  # still in the inbox
    assert server.abort_prompt(9) == 0
    server.submit(request(0, 4, 1))  # done at its first token
    server.submit(request(1, 4, 20))
    server.submit(request(2, 4, 20, sample_index=0))
    server.submit(request(2, 4, 20, sample_index=1))
    server.start()
    first = out.get(timeout=WAIT_S)
    # Held inside on_finished after step 1: slots hold prompts 1 and (2, 0); (2, 1) queued.
    assert (first.prompt_id, len(first.response_tokens)) == (0, 1)
    assert server.load == 3
    assert server.abort_prompt(2) == 2  # one running, one queued
    release.set()
    (last,) = collect(out, 1).values()
    assert (last.prompt_id, len(last.response_tokens)) == (1, 20)
    assert last.finish_reason == FinishReason.LENGTH
    stats = server.stats()
    assert (stats["submitted"], stats["delivered"], stats["aborted"]) == (5, 2, 3)
    assert server.stop() == [] and out.empty()  # aborted samples never delivered


@pytest.mark.parametrize("policy", ["continue", "restart", "recompute"])
def test_update_weights_mid_generation(engine, params, policy):
    new_params = init_params(CFG, seed=1)
    out = queue.Queue()
    server = None

    def on_finished(sample):
        out.put(sample)
        if sample.prompt_id == 0:  # after step 1: prompt 1 holds 2 tokens at version 0
            server.update_weights(new_params, 1)

    server = GenerationServer(
        "g",
        engine,
        params,
        policy_version=0,
        eos_id=NO_EOS,
        partial_rollout=policy,
        on_finished=on_finished,
    )
    server.submit(request(0, 4, 1))
    server.submit(request(1, 5, 6))
    server.submit(request(2, 3, 4))  # takes prompt 0's slot at step 1
    server.submit(request(3, 3, 4))  # queued until step 2: starts under version 1
    with server:
        got = collect(out, 4)
        with pytest.raises(ValueError, match="version 1 after version 1"):
            server.update_weights(new_params, 1)
        stats = server.stats()
    assert (stats["delivered"], stats["aborted"], stats["weight_updates"]) == (4, 0, 1)
    assert server.version == 1
    (old,) = run_requests(engine, params, [request(1, 5, 6)], policy_version=0, eos_id=NO_EOS)
    (fresh,) = run_requests(engine, new_params, [request(1, 5, 6)], policy_version=1, eos_id=NO_EOS)
    sample = got[(1, 0)]
    assert list(got[(3, 0)].token_versions) == [1, 1, 1, 1]
    assert got[(3, 0)].start_version == 1
    if policy == "restart":
        assert list(sample.token_versions) == [1] * 6 and sample.start_version == 1
        assert list(got[(2, 0)].token_versions) == [1, 1, 1, 1]
        np.testing.assert_array_equal(sample.response_tokens, fresh.response_tokens)
        assert stats["restarted"] == 2
    else:
        assert list(sample.token_versions) == [0, 0, 1, 1, 1, 1] and sample.start_version == 0
        assert list(got[(2, 0)].token_versions) == [0, 0, 1, 1]
        np.testing.assert_array_equal(sample.response_tokens[:2], old.response_tokens[:2])
        assert stats["recomputed"] == (2 if policy == "recompute" else 0)


def test_idle_server_blocks_and_stop_joins(engine, params):
    server = GenerationServer(
        "g",
        engine,
        params,
        policy_version=0,
        eos_id=NO_EOS,
        partial_rollout="continue",
        on_finished=lambda s: None,
    )
    server.start()
    time.sleep(0.3)
    stats = server.stats()
    assert stats["wakeups"] == 0 and stats["steps"] == 0  # blocked, not spinning
    assert server.stop() == []
    assert not server._thread.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        server.submit(request(0, 4, 2))
    with pytest.raises(ValueError, match="partial_rollout must be one of"):
        GenerationServer(
            "g",
            engine,
            params,
            policy_version=0,
            eos_id=NO_EOS,
            partial_rollout="resume",
            on_finished=lambda s: None,
        )


def test_bad_request_raises_in_the_caller(engine, params):
    server = GenerationServer(
        "g",
        engine,
        params,
        policy_version=0,
        eos_id=NO_EOS,
        partial_rollout="continue",
        on_finished=lambda s: None,
    )
    with pytest.raises(ValueError, match=r"prompt_id=4, sample_index=0.*max_prefill_length"):
        server.submit(request(4, 17, 2))
    server.submit(request(4, 3, 2))
    with pytest.raises(ValueError, match=r"request \(4, 0\) already submitted"):
        server.submit(request(4, 3, 2))
    assert server.stop() == [(4, 0)]  # never started: still outstanding


def test_engine_error_surfaces(engine, params, monkeypatch):
    def boom(params, state, **kwargs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine, "generate_block", boom)  # what SlotBatcher.step decodes with
    server = GenerationServer(
        "g",
        engine,
        params,
        policy_version=0,
        eos_id=NO_EOS,
        partial_rollout="continue",
        on_finished=lambda s: None,
    )
    server.start()
    server.submit(request(5, 4, 3))
    server._thread.join(WAIT_S)
    assert not server._thread.is_alive()
    with pytest.raises(GenerationServerError, match="device fell over") as info:
        server.check()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(GenerationServerError):
        server.submit(request(6, 4, 3))
    with pytest.raises(GenerationServerError):
        server.stats()
    assert server.stop() == [(5, 0)]  # never delivered, listed for the caller


def test_update_weights_refuses_a_tree_unlike_the_model_in_the_caller(engine, params):
    from jaxflash.sharding.leaves import LayoutMismatchError

    server = GenerationServer(
        "g",
        engine,
        params,
        policy_version=0,
        eos_id=NO_EOS,
        partial_rollout="continue",
        on_finished=lambda s: None,
    )
    bf16 = jax.tree.map(lambda x: x.astype("bfloat16"), params)
    with server:
        with pytest.raises(LayoutMismatchError, match=r"\['embed_vd'\].*bfloat16.*float32"):
            server.update_weights(bf16, 1)
        server.check()  # the server thread is alive
        assert server.version == 0
        server.update_weights(params, 1)  # the refused call did not take version 1
