"""``LlamaEngine`` behind ``jetstream.engine.engine_api.Engine``, for JetStream's Driver.

The engine core (``engine.LlamaEngine``) has JetStream's Engine API in pure JAX and
does not import JetStream: ``jetstream.engine.engine_api`` imports seqio, which
imports TensorFlow (4-5 s per process start, paid by every RL process before the
split). Only serving a trained model through JetStream's own orchestrator and
gRPC server needs the real base class, so only this adapter imports it
(``serving.JetStreamService`` builds one).

What the adapter adds: the ``engine_api.Engine`` base class (the Driver checks
nothing else), ``generate`` results as ``engine_api.ResultTokens`` (the same int32
[B, 4] data; JetStream reads columns 0-2), and the tokenizer metadata the Driver
asks for. Everything else is delegated unchanged, so tokens are the core's.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh
from jetstream.engine import engine_api, tokenizer_pb2

from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import DecodeState, Prefix
from jaxflash.generation.jetstream_compat import JetStreamTokenizer


class JetStreamEngine(engine_api.Engine):
    """JetStream's ``Engine`` interface over a ``LlamaEngine``.

    Args:
      engine: the core engine; built with ``tokenizer=`` to serve text.
    """

    def __init__(self, engine: LlamaEngine):
        self.engine = engine

    def prefill(self, *, params: Any, **kwargs: Any) -> Prefix:
        """``LlamaEngine.prefill`` (one prompt, first token sampled)."""
        return self.engine.prefill(params=params, **kwargs)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """``LlamaEngine.insert`` (the slot emits the prefill token first)."""
        return self.engine.insert(prefix, decode_state, slot)

    def generate(
        self, params: Any, decode_state: DecodeState
    ) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One decode step; the result as JetStream's ``ResultTokens`` (1 sample per slot)."""
        state, result = self.engine.generate(params, decode_state)
        tokens = engine_api.ResultTokens(
            data=result.data,
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
        )
        return state, tokens

    def init_decode_state(self, *args: Any, **kwargs: Any) -> DecodeState:
        return self.engine.init_decode_state(*args, **kwargs)

    def load_params(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.load_params(*args, **kwargs)

    def get_prefix_destination_sharding(self) -> Any:
        return self.engine.get_prefix_destination_sharding()

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        """Placeholder metadata: ``build_tokenizer`` wraps the engine's own tokenizer."""
        return tokenizer_pb2.TokenizerParameters(path="jaxflash", extra_ids=0)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
        """The engine's tokenizer behind JetStream's Tokenizer interface.

        Raises:
          ValueError: the engine was built without a tokenizer.
        """
        del metadata
        if self.engine.tokenizer is None:
            raise ValueError("JetStreamEngine.build_tokenizer: build the engine with tokenizer=")
        return JetStreamTokenizer(self.engine.tokenizer, max_prefill_length=self.max_prefill_length)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def max_target_length(self) -> int:
        return self.engine.max_target_length

    @property
    def mesh(self) -> Mesh:
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        """No host-offload devices are used."""
        return None
