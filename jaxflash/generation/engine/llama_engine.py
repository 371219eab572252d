"""The generation engine over jaxflash's decoder forward: slots, a KV cache, sampling.

``LlamaEngine`` has JetStream's Engine API (``prefill`` / ``insert`` / ``generate``)
in pure JAX, without importing JetStream (whose ``engine_api`` pulls TensorFlow
through seqio, 4-5 s per process); ``jetstream_engine.JetStreamEngine`` adapts it to
``jetstream.engine.engine_api.Engine`` for JetStream's Driver and gRPC server
(``serving``). It runs the pure function ``jaxflash.models.llama.forward`` — the
same code the learner runs — so engine logprobs and learner logprobs agree to float
rounding. Its device programs are the pure functions of ``engine.kernels``; the
engine jits them, places params (``engine.weights``, ``engine.params``: layers
unstacked, so a decode step reads each layer's weights in place) and counts
compilations from outside (``trace_counts``).

Two ways to drive it (B = ``max_concurrent_decodes`` slots, S = ``max_target_length``):

- JetStream's API (its Driver and gRPC server, through ``JetStreamEngine``):
  ``prefill(params=, padded_tokens=, true_length=) -> Prefix`` runs one prompt
  (padded to a power-of-two bucket, at most ``max_prefill_length``) at positions
  0..P-1 and samples the first response token; ``insert(prefix, state, slot)``
  copies it into a slot; ``generate(params, state)`` runs one decode step for all
  slots. JetStream 0.2.2's Driver only streams what ``generate`` returns, so
  ``insert`` by default marks the slot pending: its next ``generate`` emits the
  prefill's token.
- jaxflash's slot loop: ``prefiller.prefill_many(params, sequences)`` runs prompts
  ``prefill_rows`` at a time per bucket (prefix sharing: each distinct prompt once);
  ``start_samples(state, starts)`` draws every new sample's first token and puts it
  in its slot in one dispatch; ``generate_block(params, state, steps=n, ...)``
  decodes up to n steps in one jitted loop and returns tokens in a block, so the
  host syncs once per block and new requests / aborts / weights apply at block
  boundaries.

``params`` is an argument of every call, so new weights apply at the next step with
nothing rebuilt or recompiled; in-flight sequences keep their cache (partial
rollout). Recompute (AReaL's interruptible rollout, arXiv 2505.24298): prefilling
prompt + the n tokens generated so far with ``token_index=n`` rebuilds a sample's
cache under new weights and draws its next token with the key the uninterrupted
sample would have used.

Positions: a prompt of P tokens fills 0..P-1 and response token i sits at P+i, so a
sequence holds at most S tokens. ``generate`` returns a ``DecodeResult``
(JetStream's ``ResultTokens`` layout) with data int32 [B, 4]: token, validity (0
once the slot's cache is full), tokens emitted so far, logprob bit-cast to int32
(``result_logprobs``); JetStream ignores column 3.

Compilation: prefill once per bucket, starts once per (power-of-two sample count,
bucket), insert once per bucket, generate once, generate_block once per block size.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.generation.engine.host_arrays import block_result, start_groups, stop_array
from jaxflash.generation.engine.paging import resolve_paged
from jaxflash.generation.engine.prefill import Prefiller
from jaxflash.generation.engine.programs import Programs
from jaxflash.generation.engine.state import (
    BlockResult,
    DecodeResult,
    DecodeState,
    EngineConfig,
    Prefix,
    SampleStart,
    state_shardings,
)
from jaxflash.generation.engine.weights import EngineWeights
from jaxflash.models.config import ModelConfig
from jaxflash.models.lora import LoraConfig
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import Rules


class LlamaEngine:
    """Generation engine for jaxflash's decoder (JetStream's Engine API, pure JAX).

    Args:
      model_config: the decoder's ``ModelConfig``.
      config: slots, lengths and sampling (``EngineConfig``).
      mesh: devices the engine runs on; default ``make_mesh`` (data, fsdp,
        tensor) over ``jax.devices()[0]``.
      rules: logical-axis rules (e.g. ``jaxflash.sharding.rules.GENERATOR_RULES``)
        for params and KV caches; None replicates everything on the mesh.
      tokenizer: optional object with ``encode``, ``decode``, ``eos_id``,
        ``pad_id`` (``jaxflash.models.tokenizer.Tokenizer``); needed only to
        serve text through JetStream's Driver (``JetStreamEngine``).
      load_params_fn: returns the params for ``load_params`` (JetStream's server
        calls it once at start).
      lora: serve a LoRA model (``models.lora``): params are the stored base with
        the adapters beside their weights, applied unmerged; ``place_base`` once and
        ``with_adapters`` per update move only the adapters.

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
        lora: LoraConfig | None = None,
    ):
        if config.max_target_length > model_config.max_seq_len:
            raise ValueError(
                f"EngineConfig.max_target_length={config.max_target_length} exceeds "
                f"ModelConfig.max_seq_len={model_config.max_seq_len}"
            )
        self._mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], {})
        # Paged: the pool's slot groups and "auto" attention follow the mesh.
        config, layout = resolve_paged(model_config, config, self._mesh, rules)
        self.model_config = model_config
        self.config = config
        self._replicated = NamedSharding(self._mesh, PartitionSpec())
        self.tokenizer = tokenizer
        self._load_params_fn = load_params_fn
        self._auto_prompt_id = itertools.count()  # for requests without an identity
        self.lora = lora
        # Accepted param trees, placement, LoRA adapters (see engine.weights).
        self.weights = EngineWeights(model_config, self._mesh, rules, lora)
        state_sh, self._prefix_shardings = state_shardings(model_config, config, self._mesh, rules)
        self._programs = Programs(
            model_config, config, state_sh, self._prefix_shardings, self._replicated, layout
        )
        # Prompt prefill (buckets, batched prefill, first tokens); see engine.prefill.
        self.prefiller = Prefiller(config, self._programs, self._replicated)

    @property
    def prefill_jit(self) -> Any:
        """The jitted prefill program, for ahead-of-time lowering (``sizing``):
        ``(params, ids int32 [N, T], true_length int32 [N]) -> PrefillBatch``;
        params unstacked on ``engine_shardings`` (see ``place_params``)."""
        return self._programs.prefill

    @property
    def generate_jit(self) -> Any:
        """The jitted single decode step, for ahead-of-time lowering (``sizing``):
        ``(params, DecodeState) -> (DecodeState, DecodeResult)``, state donated."""
        return self._programs.generate

    @property
    def trace_counts(self) -> collections.Counter[str]:
        """Traces (= compilations) per program and input shape, e.g. ``generate``,
        ``prefill_4x16``, ``start_8_4x16``, ``generate_block_8`` (a copy)."""
        return collections.Counter(self._programs.traces)

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
            per-engine counter (what JetStream's Driver gets).
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
            raise NotImplementedError("LlamaEngine.prefill: existing_prefix is not supported")
        if token_index < 0:
            raise ValueError(f"prefill: token_index must be >= 0, got {token_index}")
        if prompt_id is None:
            prompt_id = next(self._auto_prompt_id)
        shared = self.prefiller.prefill_prompt(
            params=params, padded_tokens=padded_tokens, true_length=true_length
        )
        (prefix,) = self.prefiller.first_tokens(
            shared, [(seed, prompt_id, sample_index)], token_index=token_index
        )
        return prefix

    # ------------------------------------------------------ starting samples

    def start_samples(
        self,
        decode_state: DecodeState,
        starts: Sequence[SampleStart],
        page_table: np.ndarray | jax.Array | None = None,
    ) -> tuple[DecodeState, np.ndarray, np.ndarray]:
        """Draw each sample's first token and put the sample in its slot.

        One dispatch per distinct ``PrefillBatch`` and one host copy in all. The
        slot then decodes its second token at the next ``generate_block``
        (nothing is pending).

        Args:
          decode_state: current state; donated.
          starts: where and how each sample starts (slots distinct).
          page_table: paged cache only (required there): int32 [B, M] with each
            new sample's pages mapped (``page_pool.PagePool.device_table``).

        Returns:
          (new state, first tokens int32 [N], their logprobs float32 [N]) in order.

        Raises:
          ValueError: a slot out of range, a repeated slot, or a negative budget;
            a paged engine without ``page_table``.
        """
        results = []
        table = self._page_table(page_table)
        for members, arrays in start_groups(starts, self.config.max_concurrent_decodes):
            if self.config.paged:  # the whole table at the first group, then the state's
                from_g = np.zeros(arrays[0].shape, np.int32)
                from_g[: len(members)] = [starts[i].shared_pages for i in members]
                arrays = (*arrays, table, from_g)
                table = None
            arrays = jax.device_put(arrays, self._replicated)
            batch = starts[members[0]].prefill.batch
            decode_state, token_g, logp_g = self._programs.start(decode_state, batch, *arrays)
            results.append((members, token_g, logp_g))
        host = jax.device_get([(t, lp) for _, t, lp in results])
        tokens = np.zeros((len(starts),), np.int32)
        logps = np.zeros((len(starts),), np.float32)
        for (members, _, _), (token_g, logp_g) in zip(results, host, strict=True):
            tokens[members] = token_g[: len(members)]
            logps[members] = logp_g[: len(members)]
        return decode_state, tokens, logps

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
            emits the prefill's token for this slot. False: the next step samples
            the second token.

        Raises:
          ValueError: slot out of range.
        """
        if self.config.paged:
            raise NotImplementedError(
                "insert: a paged engine (kv_cache='paged') starts samples through the slot "
                "loop (start_samples with a page table); JetStream's Driver needs "
                "kv_cache='dense'"
            )
        if not 0 <= slot < self.config.max_concurrent_decodes:
            raise ValueError(
                f"insert: slot={slot} outside [0, {self.config.max_concurrent_decodes})"
            )
        slot_emit = jax.device_put((np.int32(slot), np.bool_(emit_prefill_token)), self._replicated)
        return self._programs.insert(decode_state, prefix, *slot_emit)

    # --------------------------------------------------------------- generate

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, DecodeResult]:
        """One decode step for every slot (the old state is donated).

        A slot whose next token would not fit in the cache (position >= S) is
        marked invalid and does not advance; a pending slot emits its prefill
        token instead. Slots never inserted produce junk rows (ignore them).

        Args:
          params: model params; may differ from call to call (same shapes and
            dtypes), which takes effect at this step without recompiling.
          decode_state: current state; its buffers are donated.

        Returns:
          (new DecodeState, DecodeResult with int32 data [B, 4]: token, valid,
          emitted length, logprob bits — see ``result_logprobs``).
        """
        return self._programs.generate(params, decode_state)

    def generate_block(
        self,
        params: Any,
        decode_state: DecodeState,
        *,
        steps: int,
        live: np.ndarray,
        stop_ids: Sequence[int],
        page_table: np.ndarray | jax.Array | None = None,
    ) -> tuple[DecodeState, BlockResult]:
        """Up to ``steps`` decode steps in one dispatch, one host copy of the tokens.

        Slot b decodes while live (see ``engine.kernels.generate_block``): from
        ``live[b]`` until it emits a stop token or its budget (set by
        ``start_samples``) runs out. Same tokens and logprobs as ``steps`` single
        steps.

        Args:
          params: model params.
          decode_state: current state; donated.
          steps: maximum decode steps (compiles once per value).
          live: bool [B] slots holding a running sample.
          stop_ids: token ids that end a sample (may be empty).
          page_table: paged cache only (required there): int32 [B, M] with every
            page the block writes mapped; a slot whose next page is not mapped stops.

        Returns:
          (new state, BlockResult on the host).

        Raises:
          ValueError: steps < 1 or ``live`` not of shape [B]; a paged engine
            without ``page_table``.
        """
        B = self.config.max_concurrent_decodes
        live = np.asarray(live, bool)
        if steps < 1 or live.shape != (B,):
            raise ValueError(
                f"generate_block: need steps >= 1 and live [B={B}], got {steps}, {live.shape}"
            )
        table = self._page_table(page_table)
        live_dev, stop_dev, table = jax.device_put(
            (live, stop_array(stop_ids), table), self._replicated
        )
        program = self._programs.generate_block(steps)
        state, out_nb3, live_n, n = program(params, decode_state, live_dev, stop_dev, table)
        out_nb3, live_n, n = jax.device_get((out_nb3, live_n, n))
        result = block_result(out_nb3, live_n, int(n))
        return state, result

    def _page_table(self, page_table: np.ndarray | jax.Array | None) -> Any:
        """The page table a paged engine's program takes (None for a dense one)."""
        if not self.config.paged:
            return None
        if page_table is None:
            raise ValueError("a paged engine (kv_cache='paged') needs page_table=")
        return page_table

    # ------------------------------------------------- state, params, plumbing

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """Empty slots: zero caches, every slot idle."""
        del args, kwargs
        # Built under jit so every field is its own buffer: generate and insert
        # donate the state, and XLA refuses to donate one buffer twice.
        return self._programs.init_state()

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
        """Params in the engine's layout (layers unstacked) on the engine's mesh.

        Takes stacked (learner / sync / checkpoint) or unstacked params, host or
        device (``engine.weights.EngineWeights.place_params``).
        """
        return self.weights.place_params(params)

    def place_base(self, base: Any) -> Any:
        """The frozen base of a LoRA engine, placed once (``EngineWeights.place_base``)."""
        return self.weights.place_base(base)

    def with_adapters(self, base: Any, adapters: Any) -> Any:
        """LoRA params: the placed base with ``adapters`` (``EngineWeights.with_adapters``)."""
        return self.weights.with_adapters(base, adapters)

    def check_params(self, params: Any) -> None:
        """Refuse params unlike the engine's model (``EngineWeights.check_params``)."""
        self.weights.check_params(params)

    def get_prefix_destination_sharding(self) -> Any:
        """A Prefix-shaped tree of NamedShardings (KV cache per ``rules``)."""
        return self._prefix_shardings

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def max_target_length(self) -> int:
        return self.config.max_target_length

    @property
    def mesh(self) -> Mesh:
        return self._mesh
