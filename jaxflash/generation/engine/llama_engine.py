"""The slot loop's engine over jaxflash's decoder forward: slots, a KV cache, sampling.

``LlamaEngine`` runs the pure function ``jaxflash.models.decoder.transformer.forward``
— the same code the learner runs — so engine logprobs and learner logprobs agree to
float rounding. Its device programs are the pure functions of ``engine.kernels``;
the engine jits them, places params (``engine.weights``, ``engine.params``: layers
unstacked, so a decode step reads each layer's weights in place) and counts
compilations from outside (``trace_counts``).

The slot loop (``generation.slot_loop``) drives it (B = ``max_concurrent_decodes``
slots, S = ``max_target_length``): ``prefiller.prefill_many(params, sequences)`` runs
prompts ``prefill_rows`` at a time per bucket (prefix sharing: each distinct prompt
once); ``start_samples(state, starts)`` draws every new sample's first token and
puts it in its slot in one dispatch; ``generate_block(params, state, steps=n, ...)``
decodes up to n steps in one jitted loop and returns tokens in a block, so the host
syncs once per block and new requests / aborts / weights apply at block boundaries.
JetStream's Engine API (``prefill`` / ``insert`` / ``generate``, for its Driver and
gRPC server) is an adapter over this engine with its own state
(``generation.jetstream``).

``params`` is an argument of every call, so new weights apply at the next step with
nothing rebuilt or recompiled; in-flight sequences keep their cache (partial
rollout). Recompute (AReaL's interruptible rollout, arXiv 2505.24298): prefilling
prompt + the n tokens generated so far and starting the sample with
``token_index=n`` rebuilds its cache under new weights and draws its next token
with the key the uninterrupted sample would have used.

Positions: a prompt of P tokens fills 0..P-1 and response token i sits at P+i, so a
sequence holds at most S tokens.

Compilation: prefill once per bucket, starts once per (power-of-two sample count,
bucket), generate_block once per block size.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
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
    DecodeState,
    EngineConfig,
    PromptPrefill,
    SampleStart,
    state_shardings,
)
from jaxflash.generation.engine.weights import EngineWeights
from jaxflash.models.adapters.lora import LoraConfig
from jaxflash.models.caches.kv_cache import LayerKVCache
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.sharding.mesh import make_mesh
from jaxflash.sharding.rules import Rules


class LlamaEngine:
    """Generation engine for jaxflash's decoder, driven by the slot loop.

    Args:
      model_config: the decoder's ``ModelConfig``.
      config: slots, lengths and sampling (``EngineConfig``).
      mesh: devices the engine runs on; default ``make_mesh`` (data, fsdp,
        tensor) over ``jax.devices()[0]``.
      rules: logical-axis rules (e.g. ``jaxflash.sharding.rules.GENERATOR_RULES``)
        for params and KV caches; None replicates everything on the mesh.
      lora: serve a LoRA model (``models.adapters.lora``): params are the stored base with
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
        self.lora = lora
        # Accepted param trees, placement, LoRA adapters (see engine.weights).
        self.weights = EngineWeights(model_config, self._mesh, rules, lora)
        self._state_sh, self._prefill_cache_sh = state_shardings(
            model_config, config, self._mesh, rules
        )
        self._programs = Programs(
            model_config, config, self._state_sh, self._prefill_cache_sh, self._replicated, layout
        )
        # Prompt prefill (buckets, batched prefill, first tokens); see engine.prefill.
        self.prefiller = Prefiller(config, self._programs, self._replicated)

    @property
    def prefill_jit(self) -> Any:
        """The jitted prefill program, for ahead-of-time lowering (``sizing``):
        ``(params, ids int32 [N, T], true_length int32 [N]) -> PrefillBatch``;
        params unstacked on ``engine_shardings`` (see ``place_params``)."""
        return self._programs.prefill

    def generate_block_jit(self, steps: int) -> Any:
        """The jitted ``generate_block`` of ``steps`` decode steps, for ahead-of-time
        lowering (``sizing``): ``(params, DecodeState, live bool [B], stop int32
        [n_stop], page_table=None) -> (DecodeState, out int32 [steps, B, 3], live_n,
        steps run)``, state donated (``engine.kernels.generate_block``)."""
        return self._programs.generate_block(steps)

    @property
    def state_shardings(self) -> DecodeState:
        """The decode state's NamedShardings on the engine's mesh."""
        return self._state_sh

    @property
    def prefill_cache_shardings(self) -> LayerKVCache:
        """NamedShardings of a prefill's cache ([N, K, T, H] keys, [N, K, H, T] values)."""
        return self._prefill_cache_sh

    @property
    def replicated(self) -> NamedSharding:
        """Replicated on the engine's mesh (explicit host-to-device copies)."""
        return self._replicated

    @property
    def trace_counts(self) -> collections.Counter[str]:
        """Traces (= compilations) per program and input shape, e.g. ``generate``,
        ``prefill_4x16``, ``start_8_4x16``, ``generate_block_8`` (a copy)."""
        return collections.Counter(self._programs.traces)

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

    def prefill_routes(self, prefills: Sequence[PromptPrefill]) -> list[np.ndarray]:
        """A MoE engine's routes of each prefilled sequence, in one host copy.

        Args:
          prefills: ``PromptPrefill`` results (of this engine's prefills).

        Returns:
          int16 [P, L, k] per prefill (P its true length): each layer's top-k experts
          of each token (``Sample.routed_experts``).

        Raises:
          ValueError: the engine's model has no experts.
        """
        if not self.model_config.is_moe:
            raise ValueError("prefill_routes: the engine's model has no experts")
        rows = [p.batch.routes_ntlk[p.row] for p in prefills]
        return [
            np.asarray(r[: p.true_length])
            for r, p in zip(jax.device_get(rows), prefills, strict=True)
        ]

    # ---------------------------------------------------------------- decoding

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
        # Built under jit so every field is its own buffer: start_samples and
        # generate_block donate the state, and XLA refuses to donate one buffer twice.
        return self._programs.init_state()

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
