"""``EngineApi`` behind ``jetstream.engine.engine_api.Engine``, for JetStream's Driver.

``api.EngineApi`` has JetStream's Engine API in pure JAX and does not import
JetStream: ``jetstream.engine.engine_api`` imports seqio, which imports TensorFlow
(4-5 s per process start). Only serving a trained model through JetStream's own
orchestrator and gRPC server needs the real base class, so only this adapter
imports it (``serving.JetStreamService`` builds one).

What the adapter adds: the ``engine_api.Engine`` base class (the Driver checks
nothing else), ``generate`` results as ``engine_api.ResultTokens`` (the same int32
[B, 4] data; JetStream reads columns 0-2), and the tokenizer metadata the Driver
asks for. Everything else is delegated unchanged, so tokens are the engine's.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh
from jetstream.engine import engine_api, tokenizer_pb2

from jaxflash.generation.jetstream.api import EngineApi
from jaxflash.generation.jetstream.compat import JetStreamTokenizer
from jaxflash.generation.jetstream.state import Prefix, ServeState


class JetStreamEngine(engine_api.Engine):
    """JetStream's ``Engine`` interface over an ``EngineApi``.

    Args:
      api: the pure-JAX Engine API over the engine; built with ``tokenizer=`` to
        serve text.
    """

    def __init__(self, api: EngineApi):
        self.api = api

    def prefill(self, *, params: Any, **kwargs: Any) -> Prefix:
        """``EngineApi.prefill`` (one prompt, first token sampled)."""
        return self.api.prefill(params=params, **kwargs)

    def insert(self, prefix: Prefix, decode_state: ServeState, slot: int) -> ServeState:
        """``EngineApi.insert`` (the slot emits the prefill token first)."""
        return self.api.insert(prefix, decode_state, slot)

    def generate(
        self, params: Any, decode_state: ServeState
    ) -> tuple[ServeState, engine_api.ResultTokens]:
        """One decode step; the result as JetStream's ``ResultTokens`` (1 sample per slot)."""
        state, result = self.api.generate(params, decode_state)
        tokens = engine_api.ResultTokens(
            data=result.data,
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
        )
        return state, tokens

    def init_decode_state(self, *args: Any, **kwargs: Any) -> ServeState:
        return self.api.init_decode_state(*args, **kwargs)

    def load_params(self, *args: Any, **kwargs: Any) -> Any:
        return self.api.load_params(*args, **kwargs)

    def get_prefix_destination_sharding(self) -> Any:
        return self.api.get_prefix_destination_sharding()

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        """Placeholder metadata: ``build_tokenizer`` wraps the API's own tokenizer."""
        return tokenizer_pb2.TokenizerParameters(path="jaxflash", extra_ids=0)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
        """The API's tokenizer behind JetStream's Tokenizer interface.

        Raises:
          ValueError: the API was built without a tokenizer.
        """
        del metadata
        if self.api.tokenizer is None:
            raise ValueError("JetStreamEngine.build_tokenizer: build the EngineApi with tokenizer=")
        return JetStreamTokenizer(self.api.tokenizer, max_prefill_length=self.max_prefill_length)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.api.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.api.max_prefill_length

    @property
    def max_target_length(self) -> int:
        return self.api.max_target_length

    @property
    def mesh(self) -> Mesh:
        return self.api.mesh

    @property
    def colocated_cpus(self) -> None:
        """No host-offload devices are used."""
        return None
