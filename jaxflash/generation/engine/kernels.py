"""The engine's device programs, as pure functions of (params, state, static config).

``LlamaEngine`` jits each of them once per input shape with the static
configuration bound (``functools.partial``) and counts the traces from outside.
None of them reads or writes anything but its arguments.

- ``prefill``: N sequences of one bucket in one forward pass -> ``PrefillBatch``
  (dense attention up to ``EngineConfig.prefill_dense_max`` tokens, O(T) above).
- ``sample_first``: first tokens of G samples from prefill logits.
- ``start``: ``sample_first`` + write each sample's prefill rows and per-slot
  vectors into its slot (one dispatch for a whole fill).
- ``generate_block``: up to ``steps`` decode steps in one ``lax.while_loop``; a slot
  stops on a stop token, on its budget or when the cache is full, and the loop
  ends early once every slot has stopped. Tokens come back as one [n, B, 3] array.

Their pieces — ``place_rows`` (prefill rows into slots), ``next_tokens`` (one forward
step and sample for every slot) and ``room`` (which slots may take a step) — are
public: JetStream's ``insert`` / ``generate`` (``generation.jetstream.kernels``) are
built from them, so its decode steps are the slot loop's.

Params may be stacked ([L, ...], as the learner holds them) or unstacked
(``models.decoder.transformer.unstack_layers``, as ``LlamaEngine.place_params`` returns them);
stacked ones are unstacked inside the program (static slices: correct, but each
call copies every layer's weights — pass placed params for speed).

Every decode step is the same sequence of operations in every decode path, so
tokens and logprobs are bit-identical between ``generate_block``, JetStream's
``generate`` and the engine before these programs were unrolled
(tests/generation/test_engine_golden.py).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, use_abstract_mesh

from jaxflash.generation.engine.state import DecodeState, EngineConfig, PrefillBatch
from jaxflash.generation.sampling import draw_tokens, sample_key, sample_tokens
from jaxflash.models.caches.kv_cache import LayerKVCache, init_layer_kv_cache
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.logprobs import exact_log_q, exact_logits, logits_from_hidden
from jaxflash.models.decoder.transformer import forward, forward_routed, unembed, unstack_layers

__all__ = [
    "generate_block",
    "next_tokens",
    "place_rows",
    "prefill",
    "room",
    "sample_first",
    "start",
]


def prefill(
    params,
    ids_nt,
    true_length_n,
    *,
    model_config: ModelConfig,
    dense_max: int | None = None,
    mesh: Mesh | None = None,
) -> PrefillBatch:
    """Run N sequences of one bucket; keep their caches and last-position logits.

    Attention: a bucket of T <= ``dense_max`` tokens writes k/v into a fresh cache and
    attends over it with [T, T] scores per head (the dense path, bit-identical to the
    engine's goldens); a longer one attends causally over its own tokens through
    ``model_config.attention`` (blockwise on CPU, XLA / cuDNN flash on GPU, splash on
    TPU: O(T) memory) and then writes k/v (``forward(..., fresh_cache=True)``). The
    two agree to float rounding (tests/generation/test_engine_block.py).

    Args:
      params: model params (stacked or unstacked layers).
      ids_nt: int32 [N, T] right-padded token ids.
      true_length_n: int32 [N] lengths in [1, T].
      model_config: static.
      dense_max: largest bucket prefilled densely (``EngineConfig.prefill_dense_max``);
        None: every bucket.
      mesh: the engine's mesh: the O(T) path runs under its abstract mesh, so that
        "auto" resolves for the mesh's chips and splash's ``shard_map`` (and Mosaic,
        for compile-only chips) find them.

    Returns:
      PrefillBatch (caches of N rows and length T, lengths, float32 logits [N, V],
      a MoE model's routes int16 [N, T, L, k]).
    """
    params = unstack_layers(params)
    n, t = ids_nt.shape
    positions_nt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    cache = init_layer_kv_cache(model_config, n, t)
    fresh = not (dense_max is None or t <= dense_max or model_config.exact_numerics)
    scope = contextlib.nullcontext() if mesh is None else use_abstract_mesh(mesh.abstract_mesh)
    with scope if fresh else contextlib.nullcontext():
        h_ntd, cache, routes_ntlk = _forward_routes(
            params, model_config, ids_nt, positions_nt, cache, fresh_cache=fresh
        )
    h_nd = jnp.take_along_axis(h_ntd, (true_length_n - 1)[:, None, None], axis=1)[:, 0]
    logits_nv = _logits(h_nd, params, model_config)
    return PrefillBatch(
        cache=cache, true_length_n=true_length_n, logits_nv=logits_nv, routes_ntlk=routes_ntlk
    )


def _forward_routes(params, mc: ModelConfig, ids_bt, pos_bt, cache, fresh_cache=False):
    """``forward`` plus, for a MoE model, the live top-k experts int16 [B, T, L, k]
    (None for a dense one): what a sample's ``routed_experts`` records."""
    if not mc.is_moe:
        return *forward(params, mc, ids_bt, pos_bt, cache, fresh_cache=fresh_cache), None
    h, cache, _, routes_btlk = forward_routed(
        params, mc, ids_bt, pos_bt, cache, fresh_cache=fresh_cache
    )
    return h, cache, routes_btlk.astype(jnp.int16)


def _logits(h_bd, params, mc: ModelConfig):
    """float32 [B, V] logits (the exact mode's row blocks with ``exact_numerics``)."""
    if mc.exact_numerics:
        return exact_logits(h_bd, unembed(params, mc))
    return logits_from_hidden(h_bd, unembed(params, mc)).astype(jnp.float32)


def _sample(logits_bv, keys_b2, mc: ModelConfig, ec: EngineConfig):
    if mc.exact_numerics:  # log q in the learner's row blocks (models.caches.exact)
        logq_bv = exact_log_q(
            logits_bv,
            temperature=ec.temperature,
            top_k=ec.top_k,
            top_p=ec.top_p,
            valid_vocab_size=mc.valid_vocab_size,
        )
        return draw_tokens(logq_bv, keys_b2, greedy=ec.greedy, logits_bv=logits_bv)
    return sample_tokens(
        logits_bv,
        keys_b2,
        temperature=ec.temperature,
        top_k=ec.top_k,
        top_p=ec.top_p,
        greedy=ec.greedy,
        valid_vocab_size=mc.valid_vocab_size,  # padded ids never drawn
    )


def sample_first(logits_gv, ident_g4, *, model_config: ModelConfig, engine_config: EngineConfig):
    """First tokens of G samples: row g from ``logits_gv[g]`` with its own key.

    Args:
      logits_gv: float32 [G, V] raw logits.
      ident_g4: int32 [G, 4] (seed, prompt_id, sample_index, token_index).

    Returns:
      (token_g int32 [G], logp_g float32 [G]).
    """
    keys_g2 = jax.vmap(sample_key)(*(ident_g4[:, i] for i in range(4)))
    return _sample(logits_gv, keys_g2, model_config, engine_config)


def with_page_table(state: DecodeState, table_bm) -> DecodeState:
    """``state`` with the host's page table (paged cache; None keeps the state's)."""
    if table_bm is None:
        return state
    c = state.cache
    return state.replace(cache=c.replace(pages=c.pages.replace(table_bm=table_bm)))


def room(st: DecodeState, ec: EngineConfig):
    """bool [B]: the slot's next token fits (position + 1 < S) and the cache can store
    this step's entry (position ``pos_b``; a paged cache: its page is mapped, see
    ``SlotCache.writable``)."""
    return (st.pos_b + 1 < ec.max_target_length) & st.cache.writable(st.pos_b)


def place_rows(
    state: DecodeState, cache: LayerKVCache, row_g, slot_g, values: dict, from_g=None
) -> DecodeState:
    """Write prefill rows ``cache[row_g]`` into slots ``slot_g`` (the state's cache
    owns how: ``SlotCache.write_prefill``; a paged one skips each entry's first
    ``from_g`` pages) and set per-slot vectors; entries whose slot is out of range
    (padding) are dropped."""
    new_cache = state.cache.write_prefill(cache, row_g, slot_g, from_g)
    return _put(state.replace(cache=new_cache), slot_g, values)


def _put(state: DecodeState, slot_g, values: dict) -> DecodeState:
    def put(name):
        row_b = getattr(state, name)
        return row_b.at[slot_g].set(jnp.asarray(values[name], row_b.dtype), mode="drop")

    return state.replace(**{name: put(name) for name in values})


def start(
    state: DecodeState,
    batch: PrefillBatch,
    row_g,
    slot_g,
    ident_g4,
    budget_g,
    table_bm=None,
    from_g=None,
    *,
    model_config: ModelConfig,
    engine_config: EngineConfig,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Sample G first tokens from ``batch`` and start the samples in their slots.

    Args:
      state: decode state (donated by the caller's jit).
      batch: the prefills the samples start from.
      row_g: int32 [G] row of ``batch`` per sample.
      slot_g: int32 [G] slot per sample; B (out of range) for padding entries.
      ident_g4: int32 [G, 4] (seed, prompt_id, sample_index, token_index).
      budget_g: int32 [G] tokens each may emit after its first one.
      table_bm, from_g: paged cache only: the host's page table int32 [B, M] (with
        the new samples' pages mapped) and int32 [G] leading pages each sample
        shares with an earlier one (not written).

    Returns:
      (state, first token_g int32 [G], logp_g float32 [G]).
    """
    token_g, logp_g = sample_first(
        batch.logits_nv[row_g], ident_g4, model_config=model_config, engine_config=engine_config
    )
    values = dict(
        next_token_b=token_g,
        next_logp_b=logp_g,
        pos_b=batch.true_length_n[row_g],
        token_index_b=ident_g4[:, 3] + 1,
        seed_b=ident_g4[:, 0],
        prompt_id_b=ident_g4[:, 1],
        sample_index_b=ident_g4[:, 2],
        budget_b=budget_g,
    )
    state = with_page_table(state, table_bm)
    return place_rows(state, batch.cache, row_g, slot_g, values, from_g), token_g, logp_g


def next_tokens(params, state: DecodeState, mc: ModelConfig, ec: EngineConfig):
    """Feed every slot's last token at its position; sample the next one.

    Returns:
      (the cache with that token's k/v written, token_b int32 [B], logp_b float32 [B],
      a MoE model's routes of the fed token int16 [B, L, k] or None).
    """
    h_b1d, cache, routes_b1lk = _forward_routes(
        params, mc, state.next_token_b[:, None], state.pos_b[:, None], state.cache
    )
    logits_bv = _logits(h_b1d[:, 0], params, mc)
    keys_b2 = jax.vmap(sample_key)(
        state.seed_b, state.prompt_id_b, state.sample_index_b, state.token_index_b
    )
    token_b, logp_b = _sample(logits_bv, keys_b2, mc, ec)
    return cache, token_b, logp_b, None if routes_b1lk is None else routes_b1lk[:, 0]


def generate_block(
    params,
    state: DecodeState,
    live_b,
    stop_s,
    table_bm=None,
    *,
    steps: int,
    model_config: ModelConfig,
    engine_config: EngineConfig,
):
    """Up to ``steps`` decode steps in one program (the slot loop's decode).

    Slot b decodes while it is live: it starts live when ``live_b[b]``, and stops
    after emitting a token in ``stop_s``, after emitting its last budgeted token
    (``state.budget_b``), or when its next token would not fit in the cache. A
    stopped slot does not advance (its later rows are not emitted). The loop ends
    after ``steps`` steps or once no slot is live.

    Args:
      params: model params.
      state: decode state (donated by the caller's jit).
      live_b: bool [B] slots holding a running sample.
      stop_s: int32 [n_stop] stop token ids (pad with -1, never sampled).
      table_bm: paged cache only: the host's page table int32 [B, M], with every
        page the block writes mapped (None keeps the state's).
      steps: static maximum number of steps.

    Returns:
      (state, out_nb3 int32 [steps, B, 3] = (token, logprob bits, emitted) — a MoE
      model's [steps, B, 3 + L * k], the fed token's routes after them —, live_n
      int32 [steps] live slots at the start of each step, steps run int32 []).
    """
    params = unstack_layers(params)
    mc, ec = model_config, engine_config
    batch = live_b.shape[0]
    state = with_page_table(state, table_bm)

    def cond(carry):
        i, _, live_b, _, _ = carry
        return (i < steps) & jnp.any(live_b)

    def body(carry):
        i, st, live_b, out_nb3, live_n = carry
        cache, token_b, logp_b, routes_blk = next_tokens(params, st, mc, ec)
        room_b = room(st, ec)
        emit_b = live_b & room_b
        step_b = emit_b.astype(jnp.int32)
        budget_b = st.budget_b - step_b
        stop_b = jnp.any(token_b[:, None] == stop_s[None, :], axis=1)
        done_b = ~room_b | (emit_b & (stop_b | (budget_b <= 0)))
        st = st.replace(
            cache=cache,
            next_token_b=jnp.where(emit_b, token_b, st.next_token_b),
            next_logp_b=jnp.where(emit_b, logp_b, st.next_logp_b),
            pos_b=st.pos_b + step_b,
            token_index_b=st.token_index_b + step_b,
            budget_b=budget_b,
        )
        row_b3 = jnp.stack(
            [token_b, jax.lax.bitcast_convert_type(logp_b.astype(jnp.float32), jnp.int32), step_b],
            axis=1,
        )
        if routes_blk is not None:
            row_b3 = jnp.concatenate([row_b3, routes_blk.reshape(batch, -1).astype(jnp.int32)], 1)
        out_nb3 = jax.lax.dynamic_update_index_in_dim(out_nb3, row_b3, i, axis=0)
        live_n = live_n.at[i].set(jnp.sum(live_b.astype(jnp.int32)))
        return i + 1, st, live_b & ~done_b, out_nb3, live_n

    init = (
        jnp.zeros((), jnp.int32),
        state,
        live_b,
        jnp.zeros(
            (steps, batch, 3 + (mc.n_layers * mc.n_experts_per_token if mc.is_moe else 0)),
            jnp.int32,
        ),
        jnp.zeros((steps,), jnp.int32),
    )
    n, state, _, out_nb3, live_n = jax.lax.while_loop(cond, body, init)
    return state, out_nb3, live_n, n
