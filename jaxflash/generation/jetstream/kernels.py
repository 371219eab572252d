"""JetStream's ``insert`` and ``generate`` as pure functions over a ``ServeState``.

Built from the engine's own pieces (``generation.engine.kernels``: ``place_rows``,
``next_tokens``, ``room``, ``sample_first``), so every decode step is the same
sequence of operations as the slot loop's ``generate_block`` and tokens and
logprobs are bit-identical to it (tests/generation/test_engine_golden.py, "driver").
``api.EngineApi`` jits them with the static configuration bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.generation.engine import kernels as engine_kernels
from jaxflash.generation.engine.state import EngineConfig
from jaxflash.generation.jetstream.state import DecodeResult, Prefix, ServeState
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.transformer import unstack_layers


def first_tokens(
    logits_nv, row, ident_g4, *, model_config: ModelConfig, engine_config: EngineConfig
):
    """G first tokens drawn from row ``row`` of a prefill's logits, one key each.

    Args:
      logits_nv: float32 [N, V] a ``PrefillBatch``'s last-position logits.
      row: int32 [] the sequence's row.
      ident_g4: int32 [G, 4] (seed, prompt_id, sample_index, token_index).

    Returns:
      (token_g int32 [G], logp_g float32 [G]).
    """
    logits_gv = jnp.broadcast_to(logits_nv[row], (ident_g4.shape[0], logits_nv.shape[1]))
    return engine_kernels.sample_first(
        logits_gv, ident_g4, model_config=model_config, engine_config=engine_config
    )


def insert(state: ServeState, prefix: Prefix, slot, emit, *, engine_config: EngineConfig):
    """Put ``prefix`` into ``slot``; ``emit`` marks it pending (the next ``generate``
    emits the prefill token). Budget: the cache's room only.

    Args:
      state: the adapter's state (donated by the caller's jit).
      prefix: a prefilled prompt (batch of one).
      slot: int32 [] in [0, B).
      emit: bool [].

    Returns:
      The new ``ServeState``.
    """
    one = jnp.zeros((1,), jnp.int32)
    slot_1 = jnp.asarray(slot, jnp.int32)[None]
    values = dict(
        next_token_b=prefix.first_token[None],
        next_logp_b=prefix.first_logp[None],
        pos_b=prefix.true_length[None],
        token_index_b=prefix.token_index[None] + 1,
        seed_b=prefix.seed[None],
        prompt_id_b=prefix.prompt_id[None],
        sample_index_b=prefix.sample_index[None],
        budget_b=jnp.full((1,), engine_config.max_target_length, jnp.int32),
    )
    decode = engine_kernels.place_rows(state.decode, prefix.cache, one, slot_1, values)
    length_1 = jnp.where(emit, 0, 1)[None]
    return ServeState(
        decode=decode,
        length_b=state.length_b.at[slot_1].set(length_1.astype(jnp.int32), mode="drop"),
        pending_b=state.pending_b.at[slot_1].set(jnp.asarray(emit)[None], mode="drop"),
    )


def generate(params, state: ServeState, *, model_config: ModelConfig, engine_config: EngineConfig):
    """One decode step for every slot (JetStream's ``generate``).

    A slot whose next token would not fit (position + 1 >= S) is invalid and does
    not advance; a pending slot emits its prefill token and does not advance.

    Returns:
      (state, DecodeResult with int32 data [B, 4]: token, valid, emitted length,
      logprob bits).
    """
    params = unstack_layers(params)
    st = state.decode
    # JetStream's serving path does not record MoE routes (the slot loop does).
    cache, token_b, logp_b, _ = engine_kernels.next_tokens(params, st, model_config, engine_config)
    room_b = engine_kernels.room(st, engine_config)
    pending_b = state.pending_b
    advance_b = room_b & ~pending_b
    valid_b = room_b | pending_b
    out_token_b = jnp.where(pending_b, st.next_token_b, token_b)
    out_logp_b = jnp.where(pending_b, st.next_logp_b, logp_b)
    step_b = advance_b.astype(jnp.int32)
    decode = st.replace(
        cache=cache,
        next_token_b=jnp.where(advance_b, token_b, st.next_token_b),
        next_logp_b=jnp.where(advance_b, logp_b, st.next_logp_b),
        pos_b=st.pos_b + step_b,
        token_index_b=st.token_index_b + step_b,
        budget_b=st.budget_b - step_b,
    )
    length_b = state.length_b + valid_b.astype(jnp.int32)
    new_state = ServeState(decode=decode, length_b=length_b, pending_b=jnp.zeros_like(pending_b))
    data_b4 = jnp.stack(
        [
            out_token_b,
            valid_b.astype(jnp.int32),
            length_b,
            jax.lax.bitcast_convert_type(out_logp_b.astype(jnp.float32), jnp.int32),
        ],
        axis=1,
    )
    return new_state, DecodeResult(data=data_b4)
