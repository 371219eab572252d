"""The engine's device programs: prefill, first-token sampling, insert and one decode step.

Each method is jitted once by ``LlamaEngine.__init__``; they read the engine's
static ``model_config`` / ``config`` and count traces in ``trace_counts``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jetstream.engine import engine_api

from jaxflash.generation.engine_state import (
    DecodeState,
    Prefix,
)
from jaxflash.generation.sampling import sample_key, sample_tokens
from jaxflash.models.kv_cache import KVCache, init_kv_cache
from jaxflash.models.llama import forward, unembed
from jaxflash.models.logprobs import logits_from_hidden


class EngineKernels:
    """Mixed into ``LlamaEngine`` (engine.py); uses its config and meshes."""

    def _prefill_impl(self, params, ids_1t, true_length):
        self.trace_counts[f"prefill_{ids_1t.shape[1]}"] += 1
        cfg, bucket = self.model_config, ids_1t.shape[1]
        positions_1t = jnp.arange(bucket, dtype=jnp.int32)[None]
        cache = init_kv_cache(cfg, 1, bucket)
        h_1td, cache = forward(params, cfg, ids_1t, positions_1t, cache)
        h_1d = jax.lax.dynamic_slice_in_dim(h_1td[0], true_length - 1, 1, axis=0)
        logits_1v = logits_from_hidden(h_1d, unembed(params, cfg)).astype(jnp.float32)
        return cache, logits_1v

    def _first_tokens_impl(self, logits_1v, true_length, ident_g4):
        width = ident_g4.shape[0]
        self.trace_counts[f"first_tokens_{width}"] += 1
        keys_g2 = jax.vmap(sample_key)(*(ident_g4[:, i] for i in range(4)))
        logits_gv = jnp.broadcast_to(logits_1v, (width, logits_1v.shape[1]))
        token_g, logp_g = self._sample(logits_gv, keys_g2)
        return [
            dict(
                true_length=true_length,
                first_token=token_g[g],
                first_logp=logp_g[g],
                seed=ident_g4[g, 0],
                prompt_id=ident_g4[g, 1],
                sample_index=ident_g4[g, 2],
                token_index=ident_g4[g, 3],
            )
            for g in range(width)
        ]

    def _sample(self, logits_bv, keys_b2):
        c = self.config
        return sample_tokens(
            logits_bv,
            keys_b2,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            greedy=c.greedy,
            valid_vocab_size=self.model_config.valid_vocab_size,  # padded ids never drawn
        )

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, emit):
        self.trace_counts[f"insert_{prefix.cache.k_lbskh.shape[2]}"] += 1
        start = (0, slot, 0, 0, 0)
        cache = KVCache(
            k_lbskh=jax.lax.dynamic_update_slice(state.cache.k_lbskh, prefix.cache.k_lbskh, start),
            v_lbskh=jax.lax.dynamic_update_slice(state.cache.v_lbskh, prefix.cache.v_lbskh, start),
        )

        def put(row_b, value):
            return row_b.at[slot].set(jnp.asarray(value, row_b.dtype))

        return DecodeState(
            cache=cache,
            next_token_b=put(state.next_token_b, prefix.first_token),
            next_logp_b=put(state.next_logp_b, prefix.first_logp),
            pos_b=put(state.pos_b, prefix.true_length),
            token_index_b=put(state.token_index_b, prefix.token_index + 1),
            seed_b=put(state.seed_b, prefix.seed),
            prompt_id_b=put(state.prompt_id_b, prefix.prompt_id),
            sample_index_b=put(state.sample_index_b, prefix.sample_index),
            length_b=put(state.length_b, jnp.where(emit, 0, 1)),
            pending_b=put(state.pending_b, emit),
        )

    def _generate_impl(self, params, state: DecodeState):
        self.trace_counts["generate"] += 1
        cfg, S = self.model_config, self.config.max_target_length
        h_b1d, cache = forward(
            params, cfg, state.next_token_b[:, None], state.pos_b[:, None], state.cache
        )
        logits_bv = logits_from_hidden(h_b1d[:, 0], unembed(params, cfg))
        keys_b2 = jax.vmap(sample_key)(
            state.seed_b, state.prompt_id_b, state.sample_index_b, state.token_index_b
        )
        token_b, logp_b = self._sample(logits_bv, keys_b2)
        room_b = state.pos_b + 1 < S
        pending_b = state.pending_b
        advance_b = room_b & ~pending_b
        valid_b = room_b | pending_b
        out_token_b = jnp.where(pending_b, state.next_token_b, token_b)
        out_logp_b = jnp.where(pending_b, state.next_logp_b, logp_b)
        step_b = advance_b.astype(jnp.int32)
        new_state = state.replace(
            cache=cache,
            next_token_b=jnp.where(advance_b, token_b, state.next_token_b),
            next_logp_b=jnp.where(advance_b, logp_b, state.next_logp_b),
            pos_b=state.pos_b + step_b,
            token_index_b=state.token_index_b + step_b,
            length_b=state.length_b + valid_b.astype(jnp.int32),
            pending_b=jnp.zeros_like(pending_b),
        )
        data_b4 = jnp.stack(
            [
                out_token_b,
                valid_b.astype(jnp.int32),
                new_state.length_b,
                jax.lax.bitcast_convert_type(out_logp_b.astype(jnp.float32), jnp.int32),
            ],
            axis=1,
        )
        result = engine_api.ResultTokens(
            data=data_b4, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )
        return new_state, result
