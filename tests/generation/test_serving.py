"""JetStream compatibility and serving: the jax.tree_map shim, and a greedy completion
over JetStream's own Driver + gRPC server equal to the engine's own greedy decode."""

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.compat import (
    JetStreamTokenizer,
    ensure_jetstream_compat,
    import_orchestrator,
)
from jaxflash.generation.jetstream.serving import decode_text, serve
from jaxflash.generation.slot_loop import run_requests
from jaxflash.models.config.presets import get_preset
from jaxflash.models.decoder.transformer import init_params
from jaxflash.types import GenerationRequest, SamplingParams

CFG = get_preset("tiny")


class ToyTokenizer:
    """Characters -> ids 3..98; ids decode to "<id>" so any generated id prints."""

    eos_id = 2
    pad_id = 0

    def encode(self, text):
        return [3 + ord(c) % 96 for c in text]

    def decode(self, ids):
        return "".join(f"<{int(i)}>" for i in ids)


def test_compat_shim_makes_orchestrator_delete_pytree_work():
    level = logging.getLogger().level
    handlers = list(logging.getLogger().handlers)
    ensure_jetstream_compat()
    assert jax.tree_map is jax.tree.map
    assert ensure_jetstream_compat() is False  # never replaces an existing attribute
    orchestrator = import_orchestrator()
    # The orchestrator's import-time root-logger changes are undone.
    assert logging.getLogger().level == level and logging.getLogger().handlers == handlers
    tree = {"k": jnp.ones(3), "rest": [jnp.zeros(2), 7]}
    orchestrator.delete_pytree(tree)  # what the Driver calls after every insert
    assert tree["k"].is_deleted() and tree["rest"][0].is_deleted()


def test_tokenizer_adapter_truncates_like_jetstream_and_stops_on_eos():
    tok = JetStreamTokenizer(ToyTokenizer(), max_prefill_length=4)
    ids, n = tok.encode("abcdef", is_bos=True, max_prefill_length=4, jax_padding=False)
    assert n == 4 and list(ids) == [3 + ord(c) % 96 for c in "cdef"]  # keeps the last 4
    assert tok.stop_tokens == {2} and tok.decode([5, 6]) == "<5><6>"
    with pytest.raises(ValueError, match="no attribute 'encode'"):
        JetStreamTokenizer(object(), max_prefill_length=4)


def _scaled(params, factor):
    return {
        k: _scaled(v, factor) if isinstance(v, dict) else v * factor if k[:2] in ("w_", "em") else v
        for k, v in params.items()
    }


def _greedy_reference(engine, params, tokenizer, prompt, max_tokens):
    request = GenerationRequest(
        prompt_id=0,
        sample_index=0,
        prompt_tokens=np.asarray(tokenizer.encode(prompt), np.int32),
        sampling=SamplingParams(
            temperature=engine.config.temperature,
            top_k=engine.config.top_k,
            top_p=engine.config.top_p,
            max_new_tokens=max_tokens,
        ),
    )
    (sample,) = run_requests(engine, params, [request], policy_version=0, eos_id=tokenizer.eos_id)
    ids = [int(t) for t in sample.response_tokens if int(t) != tokenizer.eos_id]
    return ids, tokenizer.decode(ids)


def _serve_and_compare(engine, params, tokenizer, prompts, max_tokens):
    expected = [_greedy_reference(engine, params, tokenizer, p, max_tokens) for p in prompts]
    threads_before = set(threading.enumerate())
    with serve(engine, params, tokenizer=tokenizer) as service:
        got = [decode_text(service.address, p, max_tokens=max_tokens) for p in prompts]
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(threading.enumerate()) - threads_before == set(), "server threads left running"
    return expected, got


def test_grpc_greedy_completion_equals_engine_greedy_decode():
    tokenizer = ToyTokenizer()
    engine = LlamaEngine(
        CFG,
        EngineConfig(
            max_concurrent_decodes=2, max_prefill_length=16, max_target_length=40, greedy=True
        ),
    )
    # Init std 0.02 makes greedy decoding repeat the last prompt token; weights
    # scaled 10x give varied tokens, so an off-by-one in the stream would show.
    params = _scaled(init_params(CFG, seed=3), 10.0)
    prompts = ["hello jax", "slot two!", "third one reuses a slot"[:16]]
    expected, got = _serve_and_compare(engine, params, tokenizer, prompts, max_tokens=10)
    for (ids, text), served in zip(expected, got, strict=True):
        assert len(ids) == 10 and len(set(ids)) > 5
        assert text == served
    assert expected[0][1] != expected[1][1]


@pytest.mark.slow
def test_grpc_serves_real_smollm2_greedy():
    from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.models.text.tokenizer import Tokenizer

    path = smollm2_gguf_path()
    config, params = load_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=1, max_prefill_length=64, max_target_length=96, greedy=True
        ),
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}]
    )
    expected, got = _serve_and_compare(engine, params, tokenizer, [prompt], max_tokens=8)
    assert got[0] == expected[0][1]
    assert "5" in got[0]


def _outward_ipv4() -> str | None:
    """This machine's non-loopback IPv4 address, if it has one (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _answers(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _health(address: str) -> bool:
    import grpc
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        return stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=10).is_live


def test_server_binds_loopback_by_default_and_exposes_only_when_asked():
    engine = LlamaEngine(
        CFG,
        EngineConfig(max_concurrent_decodes=1, max_prefill_length=8, max_target_length=16),
    )
    params = init_params(CFG, seed=0)
    outward = _outward_ipv4()
    with serve(engine, params, tokenizer=ToyTokenizer()) as service:
        assert service.host == "127.0.0.1" and service.address == f"127.0.0.1:{service.port}"
        assert _health(service.address)
        assert _answers("127.0.0.1", service.port)
        if outward is not None:  # JetStream's own server would answer here ([::])
            assert not _answers(outward, service.port)
        assert not _answers("::1", service.port)
    with serve(engine, params, tokenizer=ToyTokenizer(), host="0.0.0.0") as exposed:
        assert exposed.address == f"127.0.0.1:{exposed.port}" and _health(exposed.address)
        if outward is not None:
            assert _answers(outward, exposed.port)
