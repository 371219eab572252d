"""JetStream's Engine API in pure JAX over the slot loop's engine.

``EngineApi(engine)`` gives a ``LlamaEngine`` the calls JetStream's Driver makes —
``prefill`` (one prompt, first token sampled), ``insert`` (a prefix into a slot),
``generate`` (one decode step for every slot) — over its own ``ServeState`` (the
engine's ``DecodeState`` plus emitted lengths and pending prefill tokens), without
importing JetStream. ``adapter.JetStreamEngine`` puts it behind
``jetstream.engine.engine_api.Engine`` for the Driver (``serving``).

JetStream 0.2.2's Driver only streams what ``generate`` returns and drops the token
``prefill`` samples, so ``insert`` by default marks the slot pending: its next
``generate`` emits the prefill's token. Params are an argument of every call (no
recompilation); the Driver fixes them at start, which is why RL rollouts use the
slot loop instead (``serving``'s docstring).

Compilation: prefill once per bucket (the engine's), first tokens once per sample
count, insert once per bucket, generate once (``trace_counts``).
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflash.generation.engine.host_arrays import identity_rows
from jaxflash.generation.engine.llama_engine import LlamaEngine
from jaxflash.generation.engine.state import PromptPrefill
from jaxflash.generation.jetstream import kernels
from jaxflash.generation.jetstream.state import DecodeResult, Prefix, ServeState, serve_shardings


class EngineApi:
    """JetStream's Engine API (``prefill`` / ``insert`` / ``generate``) over an engine.

    Args:
      engine: the slot loop's engine, with a dense cache.
      tokenizer: optional object with ``encode``, ``decode``, ``eos_id``, ``pad_id``
        (``jaxflash.models.text.tokenizer.Tokenizer``); needed only to serve text
        through JetStream's Driver (``adapter.JetStreamEngine.build_tokenizer``).
      load_params_fn: returns the params for ``load_params`` (JetStream's server
        calls it once at start).

    Raises:
      NotImplementedError: a paged engine (``kv_cache="paged"``): its samples start
        through the slot loop, which maps their pages.
    """

    def __init__(
        self,
        engine: LlamaEngine,
        *,
        tokenizer: Any = None,
        load_params_fn: Callable[[], Any] | None = None,
    ):
        if engine.config.paged:
            raise NotImplementedError(
                "EngineApi: a paged engine (kv_cache='paged') starts samples through the slot "
                "loop (start_samples with a page table); JetStream's Driver needs "
                "kv_cache='dense'"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self._load_params_fn = load_params_fn
        self._auto_prompt_id = itertools.count()  # for requests without an identity
        self._replicated = engine.replicated
        self.traces: collections.Counter[str] = collections.Counter()
        mc, ec, rep = engine.model_config, engine.config, self._replicated
        state_sh, self._prefix_shardings = serve_shardings(
            engine.state_shardings, engine.prefill_cache_shardings, rep
        )
        self._first_tokens = jax.jit(
            self._counted(
                lambda logits, row, ident: f"first_tokens_{ident.shape[0]}",
                functools.partial(kernels.first_tokens, model_config=mc, engine_config=ec),
            ),
            out_shardings=rep,
        )
        # A Prefix holds its own [1, bucket] cache (JetStream moves Prefixes around).
        self._take_row = jax.jit(
            lambda batch, row: (
                jax.tree.map(lambda x: x[row][None], batch.cache),
                batch.true_length_n[row],
            )
        )
        self._insert = jax.jit(
            self._counted(
                lambda st, prefix, *_: f"insert_{prefix.cache.max_len}",
                functools.partial(kernels.insert, engine_config=ec),
            ),
            donate_argnums=(0,),
            out_shardings=state_sh,
        )
        self._generate = jax.jit(
            self._counted(
                lambda *_: "generate",
                functools.partial(kernels.generate, model_config=mc, engine_config=ec),
            ),
            donate_argnums=(1,),
            out_shardings=(state_sh, rep),
        )
        B = ec.max_concurrent_decodes
        self._books = jax.jit(
            lambda: (jax.numpy.zeros((B,), jax.numpy.int32), jax.numpy.zeros((B,), bool)),
            out_shardings=(rep, rep),
        )

    @property
    def trace_counts(self) -> collections.Counter[str]:
        """Traces of this API's own programs (``first_tokens_<G>``, ``insert_<bucket>``,
        ``generate``; the prefill's are the engine's), a copy."""
        return collections.Counter(self.traces)

    # ---------------------------------------------------------------- prefill

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
        """Run a prompt and sample its first response token (JetStream's prefill).

        Args:
          params: model params (nested dict, see docs/CONTRACTS.md).
          existing_prefix: not supported (must be None).
          padded_tokens: int [T_pad] prompt tokens; only the first true_length count.
          true_length: P, the prompt length in tokens.
          seed, prompt_id, sample_index: RNG identity of the sample (see
            ``sampling.sample_key``); prompt_id None draws a fresh id from a
            per-API counter (what JetStream's Driver gets).
          token_index: response index of the token sampled here. 0 for a prompt;
            n to resume a sample whose prompt + first n response tokens are
            ``padded_tokens`` (recompute): the token drawn at position P-1 uses key
            n and decoding continues with n + 1. P is bounded by max_prefill_length.

        Returns:
          Prefix on the engine's mesh.

        Raises:
          ValueError: P > max_prefill_length ("prompt of P tokens exceeds
            max_prefill_length=..."), P < 1, P > len(padded_tokens), token_index < 0.
          NotImplementedError: existing_prefix is given.
        """
        if existing_prefix is not None:
            raise NotImplementedError("EngineApi.prefill: existing_prefix is not supported")
        if token_index < 0:
            raise ValueError(f"prefill: token_index must be >= 0, got {token_index}")
        if prompt_id is None:
            prompt_id = next(self._auto_prompt_id)
        shared = self.engine.prefiller.prefill_prompt(
            params=params, padded_tokens=padded_tokens, true_length=true_length
        )
        (prefix,) = self.first_tokens(
            shared, [(seed, prompt_id, sample_index)], token_index=token_index
        )
        return prefix

    def first_tokens(
        self,
        shared: PromptPrefill,
        identities: list[tuple[int, int, int]],
        *,
        token_index: int = 0,
    ) -> list[Prefix]:
        """Prefixes of N samples drawn from one ``Prefiller.prefill_prompt``.

        Args:
          shared: from ``prefill_prompt`` / ``prefill_many`` under the samples' params.
          identities: (seed, prompt_id, sample_index) per sample, N >= 1.
          token_index: response index of the tokens drawn (0 for a prompt, n for a
            recompute of prompt + n tokens; see ``prefill``).

        Returns:
          N Prefixes, in order, sharing one [1, bucket] cache.

        Raises:
          ValueError: no identities, or token_index < 0.
        """
        if not identities:
            raise ValueError("first_tokens: identities is empty")
        if token_index < 0:
            raise ValueError(f"prefill: token_index must be >= 0, got {token_index}")
        ident_g4 = identity_rows(identities, token_index)
        row_dev, ident_dev = jax.device_put((np.int32(shared.row), ident_g4), self._replicated)
        token_g, logp_g = self._first_tokens(shared.batch.logits_nv, row_dev, ident_dev)
        cache, true_length = self._take_row(shared.batch, row_dev)
        return [
            Prefix(
                cache=cache,
                true_length=true_length,
                first_token=token_g[g],
                first_logp=logp_g[g],
                seed=ident_dev[g, 0],
                prompt_id=ident_dev[g, 1],
                sample_index=ident_dev[g, 2],
                token_index=ident_dev[g, 3],
            )
            for g in range(len(identities))
        ]

    # ----------------------------------------------------------------- insert

    def insert(
        self, prefix: Prefix, decode_state: ServeState, slot: int, *, emit_prefill_token=True
    ) -> ServeState:
        """Put a prefilled prompt into slot ``slot`` (the old state is donated).

        Args:
          prefix: from ``prefill``.
          decode_state: current state; its buffers are donated (do not reuse it).
          slot: int in [0, max_concurrent_decodes).
          emit_prefill_token: True (JetStream's Driver): the next ``generate``
            emits the prefill's token for this slot. False: the next step samples
            the second token.

        Raises:
          ValueError: slot out of range.
        """
        B = self.engine.config.max_concurrent_decodes
        if not 0 <= slot < B:
            raise ValueError(f"insert: slot={slot} outside [0, {B})")
        slot_emit = jax.device_put((np.int32(slot), np.bool_(emit_prefill_token)), self._replicated)
        return self._insert(decode_state, prefix, *slot_emit)

    # --------------------------------------------------------------- generate

    def generate(self, params: Any, decode_state: ServeState) -> tuple[ServeState, DecodeResult]:
        """One decode step for every slot (the old state is donated).

        A slot whose next token would not fit in the cache (position >= S) is
        marked invalid and does not advance; a pending slot emits its prefill
        token instead. Slots never inserted produce junk rows (ignore them).

        Args:
          params: model params; may differ from call to call (same shapes and
            dtypes), which takes effect at this step without recompiling.
          decode_state: current state; its buffers are donated.

        Returns:
          (new ServeState, DecodeResult with int32 data [B, 4]: token, valid,
          emitted length, logprob bits — see ``state.result_logprobs``).
        """
        return self._generate(params, decode_state)

    # ------------------------------------------------- state, params, plumbing

    def init_decode_state(self, *args: Any, **kwargs: Any) -> ServeState:
        """Empty slots: the engine's empty ``DecodeState``, nothing emitted or pending."""
        del args, kwargs
        length_b, pending_b = self._books()
        return ServeState(
            decode=self.engine.init_decode_state(), length_b=length_b, pending_b=pending_b
        )

    def load_params(self, *args: Any, **kwargs: Any) -> Any:
        """Params from ``load_params_fn``, placed on the engine's mesh.

        Raises:
          ValueError: built without ``load_params_fn``.
        """
        del args, kwargs
        if self._load_params_fn is None:
            raise ValueError("EngineApi.load_params: construct it with load_params_fn")
        return self.engine.place_params(self._load_params_fn())

    def get_prefix_destination_sharding(self) -> Any:
        """A Prefix-shaped tree of NamedShardings (KV cache per the engine's rules)."""
        return self._prefix_shardings

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.config.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.engine.config.max_prefill_length

    @property
    def max_target_length(self) -> int:
        return self.engine.config.max_target_length

    @property
    def mesh(self) -> Mesh:
        return self.engine.mesh

    def _counted(self, name: Callable[..., str], fn: Callable) -> Callable:
        """``fn`` that adds one to ``traces[name(*args)]`` each time jax traces it."""

        def traced(*args, **kwargs):
            self.traces[name(*args, **kwargs)] += 1
            return fn(*args, **kwargs)

        return traced
