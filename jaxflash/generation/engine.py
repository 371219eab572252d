"""JetStream ``Engine`` over jaxflash's Llama forward: slots, a KV cache, sampling.

``LlamaEngine`` implements ``jetstream.engine.engine_api.Engine`` on the pure
function ``jaxflash.models.llama.forward`` — the same code the learner runs — so
engine logprobs and learner logprobs agree to float rounding.

Life of a request (B = ``max_concurrent_decodes`` slots, S = ``max_target_length``):

- ``prefill(params=, padded_tokens=, true_length=)`` runs the prompt (padded to a
  power-of-two bucket, at most ``max_prefill_length``) at positions 0..P-1,
  samples the first response token from the last prompt position and returns a
  ``Prefix``: the prompt's k/v [L, 1, bucket, K, H], the first token and its
  logprob, and the sample's RNG identity (seed, prompt_id, sample_index).
- ``insert(prefix, decode_state, slot)`` copies that into row ``slot``.
- ``generate(params, decode_state)`` runs one decode step for all B slots: feed
  each slot's last token at its position, sample the next one. ``params`` is an
  argument of every call, so new weights apply at the next step with nothing
  rebuilt or recompiled; in-flight sequences keep their cache (partial rollout).

Recompute (AReaL's interruptible rollout, arXiv 2505.24298): after a weight
update, ``prefill`` of prompt + the n tokens generated so far with
``token_index=n`` rebuilds the sample's KV cache under the new weights and
draws its next token with the key the uninterrupted sample would have used.

Prefix sharing (G samples per prompt in RL): ``prefill`` is ``prefill_prompt``
(forward pass: KV cache + last-position logits) followed by ``first_tokens``
(one sampled first token per sample identity). A slot loop calls
``prefill_prompt`` once per prompt and ``first_tokens`` for all its samples, so
the prompt runs once instead of G times, with bit-identical results (a row of
``sample_tokens`` depends only on its logits and key).

Positions: a prompt of P tokens fills 0..P-1 and response token i sits at P+i,
so a sequence holds at most S tokens in all (prompt + response).

First token and JetStream's Driver: JetStream 0.2.2's Driver ignores anything
prefill samples and only streams what ``generate`` returns. ``insert`` therefore
by default marks the slot *pending*: its next ``generate`` emits the prefill's
token (the slot does not advance that step). jaxflash's slot loop reads the first
token from the Prefix and inserts with ``emit_prefill_token=False``, so no step
is spent on it.

Each ``generate`` returns ``ResultTokens`` with data int32 [B, 4]: column 0 the
token, 1 validity (0 once the slot's cache is full), 2 tokens emitted so far by
the slot, 3 the token's logprob bit-cast to int32 (read with ``result_logprobs``;
JetStream ignores extra columns). One array means one device-to-host copy.

Compilation: prefill compiles once per bucket, first_tokens once per power-of-two
sample count, insert once per bucket, generate once; ``trace_counts`` counts traces
so tests can assert it.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jetstream.engine import engine_api, tokenizer_pb2

from jaxflash.generation.engine_kernels import EngineKernels
from jaxflash.generation.engine_state import (
    LOGP_COLUMN,
    DecodeState,
    EngineConfig,
    Prefix,
    PromptPrefill,
    empty_decode_state,
    result_logprobs,
    state_shardings,
)
from jaxflash.generation.jetstream_compat import JetStreamTokenizer
from jaxflash.models.config import ModelConfig
from jaxflash.models.llama import abstract_params, logical_axes
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import Rules, logical_to_shardings

__all__ = [
    "LOGP_COLUMN",
    "DecodeState",
    "EngineConfig",
    "LlamaEngine",
    "Prefix",
    "PromptPrefill",
    "result_logprobs",
]


class LlamaEngine(EngineKernels, engine_api.Engine):
    """JetStream engine for jaxflash's Llama decoder.

    Args:
      model_config: the decoder's ``ModelConfig``.
      config: slots, lengths and sampling (``EngineConfig``).
      mesh: devices the engine runs on; default ``make_mesh`` (data, fsdp,
        tensor) over ``jax.devices()[0]``.
      rules: logical-axis rules (e.g. ``jaxflash.sharding.rules.GENERATOR_RULES``)
        for the KV cache and for params that arrive unplaced; None replicates
        everything on the mesh. Params already on the mesh keep their sharding.
      tokenizer: optional object with ``encode``, ``decode``, ``eos_id``,
        ``pad_id`` (``jaxflash.models.tokenizer.Tokenizer``); needed only to
        serve text through JetStream's Driver.
      load_params_fn: returns the params for ``load_params`` (JetStream's server
        calls it once at start).

    Raises:
      ValueError: if max_target_length exceeds model_config.max_seq_len.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        tokenizer: Any = None,
        load_params_fn: Callable[[], Any] | None = None,
    ):
        if config.max_target_length > model_config.max_seq_len:
            raise ValueError(
                f"EngineConfig.max_target_length={config.max_target_length} exceeds "
                f"ModelConfig.max_seq_len={model_config.max_seq_len}"
            )
        self.model_config = model_config
        self.config = config
        self._mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], {})
        self._replicated = NamedSharding(self._mesh, PartitionSpec())
        self.tokenizer = tokenizer
        self._load_params_fn = load_params_fn
        self._auto_prompt_id = itertools.count()  # for requests without an identity
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._param_shardings = (
            None
            if rules is None
            else logical_to_shardings(
                logical_axes(model_config), self._mesh, rules, shapes=abstract_params(model_config)
            )
        )
        state_sh, self._prefix_shardings = state_shardings(model_config, config, self._mesh, rules)
        rep = self._replicated
        self._prefill_jit = jax.jit(
            self._prefill_impl, out_shardings=(self._prefix_shardings.cache, rep)
        )
        self._first_jit = jax.jit(self._first_tokens_impl, out_shardings=rep)
        self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=state_sh)
        self._generate_jit = jax.jit(
            self._generate_impl, donate_argnums=(1,), out_shardings=(state_sh, rep)
        )
        self._init_jit = jax.jit(
            lambda: empty_decode_state(model_config, config), out_shardings=state_sh
        )

    # ---------------------------------------------------------------- prefill

    def prefill_bucket(self, length: int) -> int:
        """Padded length for a prompt of ``length`` tokens: the smallest power of
        two >= length and >= min_prefill_bucket, capped at max_prefill_length.

        Raises:
          ValueError: length < 1 or length > max_prefill_length (names both).
        """
        limit = self.config.max_prefill_length
        if length > limit:
            raise ValueError(f"prompt of {length} tokens exceeds max_prefill_length={limit} tokens")
        if length < 1:
            raise ValueError(f"prompt must have at least 1 token, got {length}")
        bucket = max(self.config.min_prefill_bucket, 1 << (length - 1).bit_length())
        return min(bucket, limit)

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array | np.ndarray,
        true_length: int,
        seed: int = 0,
        prompt_id: int | None = None,
        sample_index: int = 0,
        token_index: int = 0,
    ) -> Prefix:
        """Run a prompt and sample its first response token.

        Args:
          params: model params (nested dict, see docs/CONTRACTS.md).
          existing_prefix: not supported (must be None).
          padded_tokens: int [T_pad] prompt tokens; only the first true_length count.
          true_length: P, the prompt length in tokens.
          seed, prompt_id, sample_index: RNG identity of the sample (see
            ``sampling.sample_key``); prompt_id None draws a fresh id from a
            per-engine counter (what JetStream's Driver gets).
          token_index: response index of the token sampled here. 0 for a
            prompt; n to resume a sample whose prompt + first n response tokens
            are ``padded_tokens`` (AReaL-style recompute, arXiv 2505.24298):
            the token drawn at position P-1 uses key token_index n, the one the
            uninterrupted sample would have used, and decoding continues with
            n + 1. P (prompt + prefix) is bounded by max_prefill_length.

        Returns:
          Prefix on the engine's mesh.

        Raises:
          ValueError: P > max_prefill_length ("prompt of P tokens exceeds
            max_prefill_length=..."), P < 1, or P > len(padded_tokens).
          NotImplementedError: existing_prefix is given.
        """
        if existing_prefix is not None:
            raise NotImplementedError("LlamaEngine.prefill: existing_prefix is not supported")
        if token_index < 0:
            raise ValueError(f"prefill: token_index must be >= 0, got {token_index}")
        if prompt_id is None:
            prompt_id = next(self._auto_prompt_id)
        shared = self.prefill_prompt(
            params=params, padded_tokens=padded_tokens, true_length=true_length
        )
        (prefix,) = self.first_tokens(
            shared, [(seed, prompt_id, sample_index)], token_index=token_index
        )
        return prefix

    def prefill_prompt(
        self, *, params: Any, padded_tokens: jax.Array | np.ndarray, true_length: int
    ) -> PromptPrefill:
        """Run a prompt once, keeping its KV cache and last-position logits.

        The shareable half of ``prefill``: G samples of one prompt (GRPO-style
        replication) call this once and ``first_tokens`` once for all G, instead
        of G full prefills. ``prefill`` is exactly these two calls, so tokens
        and logprobs are bit-identical either way (each row of
        ``sample_tokens`` depends only on its own logits and key).

        Args:
          params: model params.
          padded_tokens: int [T_pad]; only the first true_length count.
          true_length: P, tokens in the sequence (prompt, or prompt + prefix).

        Returns:
          PromptPrefill (cache [L, 1, bucket, K, H], true_length, logits f32 [1, V]).

        Raises:
          ValueError: P > max_prefill_length, P < 1, or P > len(padded_tokens).
        """
        # Explicit copies both ways, so the engine runs under
        # jax.transfer_guard("disallow") (implicit transfers are bugs there).
        tokens = np.asarray(jax.device_get(padded_tokens)).reshape(-1)
        true_length = int(true_length)
        if true_length > tokens.shape[0]:
            raise ValueError(
                f"prefill: true_length={true_length} exceeds len(padded_tokens)={tokens.shape[0]}"
            )
        bucket = self.prefill_bucket(true_length)
        ids_1t = np.zeros((1, bucket), np.int32)
        ids_1t[0, :true_length] = tokens[:true_length]
        ids_1t, length = jax.device_put((ids_1t, np.int32(true_length)), self._replicated)
        cache, logits_1v = self._prefill_jit(params, ids_1t, length)
        return PromptPrefill(cache=cache, true_length=length, logits_1v=logits_1v)

    def first_tokens(
        self,
        shared: PromptPrefill,
        identities: list[tuple[int, int, int]],
        *,
        token_index: int = 0,
    ) -> list[Prefix]:
        """Sample each sample's first token from one ``prefill_prompt``.

        Args:
          shared: from ``prefill_prompt`` under the params the samples use.
          identities: (seed, prompt_id, sample_index) per sample, N >= 1.
          token_index: response index of the tokens drawn (0 for a prompt, n
            for a recompute of prompt + n tokens; see ``prefill``).

        Returns:
          N Prefixes, in order; they share ``shared.cache`` (insert does not
          donate a Prefix, so each can be inserted into its own slot).

        Raises:
          ValueError: no identities, or token_index < 0.
        """
        if not identities:
            raise ValueError("first_tokens: identities is empty")
        if token_index < 0:
            raise ValueError(f"prefill: token_index must be >= 0, got {token_index}")
        n = len(identities)
        width = 1 << (n - 1).bit_length()  # power-of-two rows: few compiles
        ident_g4 = np.zeros((width, 4), np.int32)
        ident_g4[:n, :3] = np.asarray(identities, np.int64).reshape(n, 3)
        ident_g4[n:, :3] = ident_g4[0, :3]  # padding rows: discarded copies of row 0
        ident_g4[:, 3] = token_index
        ident_g4 = jax.device_put(ident_g4, self._replicated)
        rows = self._first_jit(shared.logits_1v, shared.true_length, ident_g4)
        return [Prefix(cache=shared.cache, **row) for row in rows[:n]]

    # ----------------------------------------------------------------- insert

    def insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slot: int,
        *,
        emit_prefill_token: bool = True,
    ) -> DecodeState:
        """Put a prefilled prompt into slot ``slot`` (the old state is donated).

        Args:
          prefix: from ``prefill``.
          decode_state: current state; its buffers are donated (do not reuse it).
          slot: int in [0, max_concurrent_decodes).
          emit_prefill_token: True (JetStream's Driver): the next ``generate``
            emits the prefill's token for this slot. False (jaxflash's slot
            loop, which reads it from the Prefix): the next step samples the
            second token.

        Raises:
          ValueError: slot out of range.
        """
        if not 0 <= slot < self.config.max_concurrent_decodes:
            raise ValueError(
                f"insert: slot={slot} outside [0, {self.config.max_concurrent_decodes})"
            )
        slot_emit = jax.device_put((np.int32(slot), np.bool_(emit_prefill_token)), self._replicated)
        return self._insert_jit(prefix, decode_state, *slot_emit)

    # --------------------------------------------------------------- generate

    def generate(
        self, params: Any, decode_state: DecodeState
    ) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One decode step for every slot (the old state is donated).

        A slot whose next token would not fit in the cache (position >= S) is
        marked invalid and does not advance; a pending slot emits its prefill
        token instead. Slots never inserted produce junk rows (ignore them).

        Args:
          params: model params; may differ from call to call (same shapes and
            dtypes), which takes effect at this step without recompiling.
          decode_state: current state; its buffers are donated.

        Returns:
          (new DecodeState, ResultTokens with int32 data [B, 4]: token, valid,
          emitted length, logprob bits — see ``result_logprobs``).
        """
        return self._generate_jit(params, decode_state)

    # ------------------------------------------------- state, params, plumbing

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """Empty slots: zero cache [L, B, S, K, H], every slot idle."""
        del args, kwargs
        # Built under jit so every field is its own buffer: generate and insert
        # donate the state, and XLA refuses to donate one buffer twice.
        return self._init_jit()

    def load_params(self, *args, **kwargs) -> Any:
        """Params from ``load_params_fn``, placed on the engine's mesh.

        Raises:
          ValueError: the engine was built without ``load_params_fn``.
        """
        del args, kwargs
        if self._load_params_fn is None:
            raise ValueError("LlamaEngine.load_params: construct the engine with load_params_fn")
        return self.place_params(self._load_params_fn())

    def place_params(self, params: Any) -> Any:
        """Put params on the engine's mesh.

        Leaves that are already jax arrays on exactly the mesh's devices keep
        their sharding (e.g. generator shardings from ``sync``); anything else
        (numpy, other devices) gets the ``rules`` sharding, or is replicated.
        """
        devices = set(self._mesh.devices.flat)

        def place(leaf, sharding):
            if isinstance(leaf, jax.Array) and set(leaf.sharding.device_set) == devices:
                return leaf
            return jax.device_put(leaf, sharding)

        if self._param_shardings is None:
            return jax.tree.map(lambda leaf: place(leaf, self._replicated), params)
        return jax.tree.map(place, params, self._param_shardings)

    def get_prefix_destination_sharding(self) -> Any:
        """A Prefix-shaped tree of NamedShardings (KV cache per ``rules``)."""
        return self._prefix_shardings

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        """Placeholder metadata: ``build_tokenizer`` wraps the engine's own tokenizer."""
        return tokenizer_pb2.TokenizerParameters(path="jaxflash", extra_ids=0)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
        """The engine's tokenizer behind JetStream's Tokenizer interface.

        Raises:
          ValueError: the engine was built without a tokenizer.
        """
        del metadata
        if self.tokenizer is None:
            raise ValueError("LlamaEngine.build_tokenizer: construct the engine with tokenizer=")
        return JetStreamTokenizer(self.tokenizer, max_prefill_length=self.max_prefill_length)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def max_target_length(self) -> int:
        return self.config.max_target_length

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        """No host-offload devices are used."""
        return None
