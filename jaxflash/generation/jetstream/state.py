"""The JetStream adapter's device state and the types its API moves.

``ServeState`` is the engine's ``DecodeState`` plus what only JetStream's Driver
needs: per slot the tokens emitted through ``ResultTokens`` so far and whether the
prefill's token is still to be emitted (JetStream 0.2.2's Driver streams only what
``generate`` returns, so ``insert`` marks the slot pending and its next ``generate``
emits the prefill token). ``Prefix`` is one prefilled prompt (JetStream moves
prefixes between its prefill and generate threads), ``DecodeResult`` one
``generate`` step's output in the layout of JetStream's ``ResultTokens``, kept here
so that nothing on this path imports JetStream (whose ``engine_api`` pulls
TensorFlow).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct
from jax.sharding import NamedSharding

from jaxflash.generation.engine.state import DecodeState
from jaxflash.models.caches.kv_cache import LayerKVCache

LOGP_COLUMN = 3  # column of DecodeResult.data holding the float32 logprob bits


@struct.dataclass
class ServeState:
    """Everything JetStream's ``insert`` / ``generate`` transform; one row per slot.

    Attributes:
      decode: the engine's ``DecodeState`` (cache, tokens, positions, RNG identity,
        budgets), dense cache only.
      length_b: int32 [B] tokens emitted through ``ResultTokens`` so far.
      pending_b: bool [B] the prefill token still has to be emitted.
    """

    decode: DecodeState
    length_b: jax.Array
    pending_b: jax.Array


@struct.dataclass
class Prefix:
    """A prefilled prompt (batch of one), ready to ``insert`` into a slot.

    Attributes:
      cache: LayerKVCache of the prompt, batch 1, length bucket (pad positions hold
        junk that is overwritten before any query can see it).
      true_length: int32 [] prompt length P.
      first_token: int32 [] response token sampled at position P-1.
      first_logp: float32 [] its log q.
      seed, prompt_id, sample_index: int32 [] RNG identity of the sample.
      token_index: int32 [] response index of ``first_token``: 0 for a prompt,
        n when the prefilled sequence is prompt + n already generated tokens.
    """

    cache: LayerKVCache
    true_length: jax.Array
    first_token: jax.Array
    first_logp: jax.Array
    seed: jax.Array
    prompt_id: jax.Array
    sample_index: jax.Array
    token_index: jax.Array


@struct.dataclass
class DecodeResult:
    """What one ``generate`` step emits, one row per slot (a pytree).

    The layout of JetStream's ``ResultTokens`` with one sample per slot (columns 0
    token, 1 valid, 2 emitted length), plus column 3 for the logprob;
    ``adapter.JetStreamEngine`` wraps it in a ``ResultTokens`` for JetStream's
    orchestrator, which reads only columns 0-2.

    Attributes:
      data: int32 [B, 4]: token, valid (0/1), emitted length, float32 logprob
        bit-cast to int32 (see ``result_logprobs``).
    """

    data: jax.Array


def result_logprobs(result: DecodeResult | np.ndarray) -> np.ndarray:
    """float32 [B] logprobs of the tokens in a ``generate`` result.

    Args:
      result: the DecodeResult (or JetStream's ``ResultTokens`` wrapping it: any
        object with ``data``), or its ``data`` already copied to host (int32
        [B, 4]); a device array is copied with an explicit device_get.
    """
    data = getattr(result, "data", result)
    data = np.asarray(jax.device_get(data))
    return np.ascontiguousarray(data[:, LOGP_COLUMN]).view(np.float32)


def serve_shardings(
    decode: DecodeState, prefill_cache: LayerKVCache, replicated: NamedSharding
) -> tuple[ServeState, Prefix]:
    """Shardings of a ``ServeState`` and of a ``Prefix``: the engine's decode state and
    prefill cache shardings, everything else replicated."""
    state = ServeState(decode=decode, length_b=replicated, pending_b=replicated)
    names = [f.name for f in dataclasses.fields(Prefix) if f.name != "cache"]
    prefix = Prefix(cache=prefill_cache, **{n: replicated for n in names})
    return state, prefix
