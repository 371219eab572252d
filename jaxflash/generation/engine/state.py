"""Static configuration and device-state types of ``LlamaEngine``.

``EngineConfig`` (slots, lengths, sampling), ``PrefillBatch`` / ``PromptPrefill``
(prompts run together), ``SampleStart`` (where a sample starts), ``DecodeState`` (all
slots), their sharding on a generation mesh and the ``BlockResult`` of
``generate_block``. JetStream's own bookkeeping (emitted lengths, pending prefill
tokens, ``Prefix``, ``DecodeResult``) is its adapter's (``generation.jetstream.state``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.models.caches.kv_cache import (
    LAYER_K_LOGICAL_AXES,
    LAYER_V_LOGICAL_AXES,
    LayerKVCache,
    init_layer_kv_cache,
)
from jaxflash.models.caches.paged_kv_cache import (
    PagedKVCache,
    PageTable,
    init_paged_kv_cache,
    pages_per_row,
)
from jaxflash.models.caches.pool_layout import PoolLayout, pool_layout
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.sharding.rules import Rules, logical_to_spec
from jaxflash.types import SamplingParams

KV_CACHE_KINDS = ("dense", "paged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Static shape and sampling choices of one engine (one compile each).

    Attributes:
      max_concurrent_decodes: B, decode slots.
      max_prefill_length: longest prompt in tokens; prompts are padded to
        power-of-two buckets between ``min_prefill_bucket`` and this.
      max_target_length: S, cache positions per slot = longest prompt + response.
      temperature, top_k, top_p: the sampling distribution (see
        ``jaxflash.algorithms.distributions``); fixed per engine.
      greedy: take the argmax instead of sampling (logprobs still under T/k/p).
      min_prefill_bucket: smallest prefill bucket in tokens.
      prefill_rows: sequences per prefill program. Sequences of one bucket are
        prefilled ``prefill_rows`` at a time (the last group padded), so a
        sequence's cache and first token never depend on which others were
        prefilled with it. 1 (the default) reproduces the single-prompt prefill
        bit for bit; on CPU batching prompts does not speed the (compute-bound)
        prefill up. On accelerators, 8-32 fills the matrix units better; XLA's
        kernels then round a few results 1 ulp differently than with 1 row.
      prefill_dense_max: largest prefill bucket (tokens) attended with dense [T, T]
        scores over a fresh cache, bit-identical to the engine's goldens; longer
        buckets attend through ``ModelConfig.attention``'s O(T) path (splash on TPU;
        ``engine.kernels.prefill``), equal to float rounding. 0: every bucket O(T).
        At 1024 the dense scores of a 12-head model are 48 MiB per row and layer;
        at 8192, 3 GiB.
      decode_block: decode steps per dispatch of a ``SlotBatcher`` driving this
        engine (one compiled block program per size). Tokens and logprobs do not
        depend on it; admissions, aborts and weight updates take effect at block
        boundaries, so a larger block trades that latency for fewer host round trips.
      kv_cache: "dense" (every slot reserves S positions) or "paged": one pool of
        ``num_pages`` pages of ``page_size`` positions per layer and a page table
        per slot (``models.caches.paged_kv_cache``); the slot loop takes pages as samples
        grow and returns them when they end (``page_pool``). Same tokens and
        logprobs as dense. JetStream's Driver (``generation.jetstream``) needs the
        dense cache.
      page_size: P, positions per page (paged only).
      num_pages: N, pages in the pool (paged only); 0 = B * ceil(S / P), the
        dense reservation. A request whose prompt + max_new_tokens needs more than
        N pages is refused by ``check_request`` (failed, with that reason).
      paged_attention: "auto" (the TPU kernel ``ragged_paged_attention`` when the
        engine's mesh is on TPU and the kernel tiles the heads one chip holds, else
        the pure-JAX reference), "reference" or "tpu_kernel"; the engine resolves
        "auto" when it is built.
      page_groups: G, slot groups the pool's pages and the slots split into (set by
        the engine from its mesh, ``models.caches.pool_layout.pool_layout``: every mesh
        axis that does not split kv heads); slot b takes pages only from group
        b // (B / G)'s N / G pages (``generation.page_pool``). B and N must be
        divisible by G.
    """

    max_concurrent_decodes: int
    max_prefill_length: int
    max_target_length: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    min_prefill_bucket: int = 16
    prefill_rows: int = 1
    prefill_dense_max: int = 1024
    decode_block: int = 1
    kv_cache: str = "dense"
    page_size: int = 16
    num_pages: int = 0
    paged_attention: str = "auto"
    page_groups: int = 1

    def __post_init__(self) -> None:
        if self.paged_attention not in ("auto", "reference", "tpu_kernel"):
            raise ValueError(
                "EngineConfig.paged_attention must be auto | reference | tpu_kernel, got "
                f"{self.paged_attention!r}"
            )
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(
                f"EngineConfig.kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}"
            )
        if self.prefill_dense_max < 0:
            raise ValueError(
                f"EngineConfig.prefill_dense_max must be >= 0, got {self.prefill_dense_max}"
            )
        if self.page_size < 1 or self.num_pages < 0:
            raise ValueError(
                f"EngineConfig: page_size must be >= 1 and num_pages >= 0 (0 = the dense "
                f"reservation), got page_size={self.page_size}, num_pages={self.num_pages}"
            )
        for name in (
            "max_concurrent_decodes",
            "max_prefill_length",
            "min_prefill_bucket",
            "prefill_rows",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.max_prefill_length < self.max_target_length:
            raise ValueError(
                f"EngineConfig.max_prefill_length={self.max_prefill_length} must be < "
                f"max_target_length={self.max_target_length} (room for a response)"
            )
        g = self.page_groups
        if g < 1 or self.max_concurrent_decodes % g or (self.paged and self.pool_pages % g):
            raise ValueError(
                f"EngineConfig: the paged pool splits into page_groups={g} slot groups, which "
                f"must divide max_concurrent_decodes={self.max_concurrent_decodes} and "
                f"num_pages={self.pool_pages}"
            )
        # SamplingParams validates temperature / top_k / top_p with named errors.
        SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def paged(self) -> bool:
        return self.kv_cache == "paged"

    @property
    def paged_kernel(self) -> bool:
        """Paged attention through the TPU kernel (``paged_attention`` resolved)."""
        return self.paged and self.paged_attention == "tpu_kernel"

    @property
    def pages_per_slot(self) -> int:
        """M = ceil(S / P), page-table entries per slot."""
        return pages_per_row(self.max_target_length, self.page_size)

    @property
    def pool_pages(self) -> int:
        """N, pages in the pool (``num_pages``, or the dense reservation B * M)."""
        return self.num_pages or self.max_concurrent_decodes * self.pages_per_slot

    @property
    def pages_per_group(self) -> int:
        """N / G, pages of one slot group."""
        return self.pool_pages // self.page_groups

    def matches(self, sampling: SamplingParams) -> bool:
        """Whether a request's distribution is the one this engine samples from."""
        return (sampling.temperature, sampling.top_k, sampling.top_p) == (
            self.temperature,
            self.top_k,
            self.top_p,
        )


@struct.dataclass
class PrefillBatch:
    """N sequences of one prefill bucket, run through the model together.

    Attributes:
      cache: LayerKVCache of N rows and length T (positions past a sequence's
        length hold junk that is overwritten before any query can see it).
      true_length_n: int32 [N] sequence lengths (padding rows repeat row 0).
      logits_nv: float32 [N, V] raw logits at each sequence's last position.
      routes_ntlk: MoE only: int16 [N, T, L, k] the top-k experts each layer chose
        for each token (``Sample.routed_experts``); None for a dense model.
    """

    cache: LayerKVCache
    true_length_n: jax.Array
    logits_nv: jax.Array
    routes_ntlk: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PromptPrefill:
    """One sequence of a ``PrefillBatch``, shareable by every sample of it.

    Valid only under the params it was computed with (``Prefiller.prefill_prompt``
    / ``prefill_many``).

    Attributes:
      batch: the batch it was run in.
      row: its row in ``batch``.
      true_length: P, its length in tokens.
    """

    batch: PrefillBatch
    row: int
    true_length: int


@dataclasses.dataclass(frozen=True)
class SampleStart:
    """Where and how one sample starts (``LlamaEngine.start_samples``).

    Attributes:
      prefill: the sample's prompt (or prompt + prefix) prefill.
      slot: decode slot in [0, B).
      seed, prompt_id, sample_index: RNG identity (``sampling.sample_key``).
      token_index: response index of the token drawn from the prefill's logits.
      budget: tokens the sample may still emit after that one (>= 0); the decode
        block stops the slot when it reaches 0.
      shared_pages: paged cache only: the slot's first ``shared_pages`` pages
        already hold this prompt (another sample's, mapped by ``page_pool``) and
        are not written again.
    """

    prefill: PromptPrefill
    slot: int
    seed: int
    prompt_id: int
    sample_index: int
    token_index: int
    budget: int
    shared_pages: int = 0


@struct.dataclass
class DecodeState:
    """Everything ``start_samples`` / ``generate_block`` transform; one row per slot.

    Attributes:
      cache: LayerKVCache, batch B, length S (one buffer per layer, updated in
        place), or with ``kv_cache="paged"`` a PagedKVCache (pools + page table).
      next_token_b: int32 [B] last sampled token, fed at the next step.
      next_logp_b: float32 [B] its log q.
      pos_b: int32 [B] position ``next_token_b`` occupies.
      token_index_b: int32 [B] response index of the token the next step samples.
      seed_b, prompt_id_b, sample_index_b: int32 [B] RNG identity per slot.
      budget_b: int32 [B] tokens the slot may still emit in ``generate_block``
        (set by ``start_samples``).
    """

    cache: LayerKVCache | PagedKVCache
    next_token_b: jax.Array
    next_logp_b: jax.Array
    pos_b: jax.Array
    token_index_b: jax.Array
    seed_b: jax.Array
    prompt_id_b: jax.Array
    sample_index_b: jax.Array
    budget_b: jax.Array


@dataclasses.dataclass(frozen=True)
class BlockResult:
    """Host copy of one ``generate_block``: up to ``steps`` decode steps for all slots.

    Attributes:
      tokens_nb: int32 [n, B] token emitted by slot b at step i (junk where not emitted).
      logps_nb: float32 [n, B] its log q.
      emitted_nb: bool [n, B] slot b emitted a token at step i.
      live_n: int32 [n] slots still decoding at the start of step i.
      steps: n, decode steps run (<= the requested number: the block ends early
        once every slot has stopped).
      routes_nbx: MoE only: int16 [n, B, L * k] the experts each layer routed the
        token slot b fed at step i to (the one sampled before step i's token);
        None for a dense model.
    """

    tokens_nb: np.ndarray
    logps_nb: np.ndarray
    emitted_nb: np.ndarray
    live_n: np.ndarray
    steps: int
    routes_nbx: np.ndarray | None = None


def state_shardings(
    model_config: ModelConfig, config: EngineConfig, mesh: Mesh, rules: Rules | None
) -> tuple[DecodeState, LayerKVCache]:
    """Shardings of the decode state and of a prefill's cache on ``mesh``.

    Each layer's cache buffers follow ``rules`` through ``LAYER_K_LOGICAL_AXES`` /
    ``LAYER_V_LOGICAL_AXES`` (e.g. kv heads over "tensor" with ``GENERATOR_RULES``;
    dims that do not divide stay replicated); a paged pool splits by kv head and by
    slot group (``models.caches.pool_layout.pool_layout``); per-slot vectors, scalars and
    the page table are replicated. Without rules everything is replicated. Pass the
    engine's resolved config (``LlamaEngine.config``): the page table's static fields
    follow it.

    Returns:
      (DecodeState of NamedShardings, LayerKVCache of NamedShardings for the caches
      ``prefill`` writes: [N, K, T, H] keys, [N, K, H, T] values).
    """
    rep = NamedSharding(mesh, PartitionSpec())
    c = model_config

    def cache_sharding(batch: int, length: int) -> LayerKVCache:
        if rules is None:
            return LayerKVCache(k_bksh=(rep,) * c.n_layers, v_bkhs=(rep,) * c.n_layers)
        k_shape = (batch, c.n_kv_heads, length, c.head_dim)
        v_shape = (batch, c.n_kv_heads, c.head_dim, length)
        k_sh = NamedSharding(mesh, logical_to_spec(LAYER_K_LOGICAL_AXES, mesh, rules, k_shape))
        v_sh = NamedSharding(mesh, logical_to_spec(LAYER_V_LOGICAL_AXES, mesh, rules, v_shape))
        return LayerKVCache(k_bksh=(k_sh,) * c.n_layers, v_bkhs=(v_sh,) * c.n_layers)

    if config.paged:
        # Pools split by kv head and by slot group (``pool_layout``); the page table is
        # replicated (each shard reads its rows' entries).
        layout = pool_layout(c, mesh, rules)
        pool = rep if layout is None else NamedSharding(mesh, layout.pool_spec)
        big = PagedKVCache(
            kv_pages=(pool,) * c.n_layers,
            pages=PageTable(
                table_bm=rep,
                max_len=config.max_target_length,
                kernel=config.paged_kernel,
                layout=layout,
            ),
        )
    else:
        big = cache_sharding(config.max_concurrent_decodes, config.max_target_length)
    one = cache_sharding(1, config.max_prefill_length)
    names = [f.name for f in dataclasses.fields(DecodeState) if f.name != "cache"]
    decode = DecodeState(cache=big, **{n: rep for n in names})
    return decode, one


def empty_decode_state(
    model_config: ModelConfig, config: EngineConfig, layout: PoolLayout | None = None
) -> DecodeState:
    """All slots idle: zero caches (``init_layer_kv_cache``) and zero per-slot vectors.

    ``layout``: a paged pool's split (``pool_layout`` of the engine's mesh and rules).

    Call it under jit (``LlamaEngine.init_decode_state`` does) so that every
    field is its own buffer: ``start_samples`` and ``generate_block`` donate the
    state, and XLA refuses to donate one buffer twice.
    """
    B = config.max_concurrent_decodes

    def zeros_b(dtype=jnp.int32):
        return jnp.zeros((B,), dtype)

    if config.paged:
        cache = init_paged_kv_cache(
            model_config,
            B,
            config.max_target_length,
            config.pool_pages,
            config.page_size,
            kernel=config.paged_kernel,
            layout=layout,
        )
    else:
        cache = init_layer_kv_cache(model_config, B, config.max_target_length)
    return DecodeState(
        cache=cache,
        next_token_b=zeros_b(),
        next_logp_b=zeros_b(jnp.float32),
        pos_b=zeros_b(),
        token_index_b=zeros_b(),
        seed_b=zeros_b(),
        prompt_id_b=zeros_b(),
        sample_index_b=zeros_b(),
        budget_b=zeros_b(),
    )
