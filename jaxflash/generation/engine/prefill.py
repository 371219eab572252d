"""Prompt prefill for ``LlamaEngine``: buckets, batched prefill, first tokens.

``Prefiller`` owns the prefill half of the engine (``engine.prefiller``): it pads
each sequence (prompt, or prompt + generated prefix for a recompute) to a
power-of-two bucket, runs ``prefill_rows`` of one bucket per jitted forward pass
(prefix sharing: each distinct prompt once) and draws samples' first tokens from
a shared prefill. Its device programs are ``engine.programs.Programs``' prefill,
first_tokens and take_row; the engine's decode half (slots, ``start_samples``,
``generate_block``) consumes its ``PromptPrefill`` results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxflash.generation.engine.host_arrays import identity_rows, prefill_groups
from jaxflash.generation.engine.programs import Programs
from jaxflash.generation.engine.state import EngineConfig, Prefix, PromptPrefill


class Prefiller:
    """Prefill programs of one engine, driven from the host.

    Args:
      config: the engine's ``EngineConfig`` (buckets, ``prefill_rows``).
      programs: the engine's jitted ``Programs``.
      replicated: replicated sharding on the engine's mesh, for explicit copies
        (the engine runs under ``transfer_guard("disallow")``).
    """

    def __init__(self, config: EngineConfig, programs: Programs, replicated: NamedSharding):
        self.config = config
        self._programs = programs
        self._replicated = replicated

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

    def prefill_many(
        self, params: Any, sequences: Sequence[np.ndarray | jax.Array]
    ) -> list[PromptPrefill]:
        """Run many sequences: ``prefill_rows`` of one bucket per forward pass.

        The last group of a bucket is padded with copies of its first row, so every
        program has exactly ``prefill_rows`` rows and each sequence's results are
        the same whichever sequences it is prefilled with (see
        ``EngineConfig.prefill_rows``).

        Args:
          params: model params (``place_params`` them first for speed).
          sequences: 1-D int token arrays (prompt, or prompt + generated prefix).

        Returns:
          One PromptPrefill per sequence, in order.

        Raises:
          ValueError: a sequence longer than max_prefill_length or empty.
        """
        seqs = [np.asarray(jax.device_get(s), np.int32).reshape(-1) for s in sequences]
        out: dict[int, PromptPrefill] = {}
        rows = self.config.prefill_rows
        for group, ids_nt, length_n in prefill_groups(seqs, self.prefill_bucket, rows):
            # Explicit copies: the engine runs under transfer_guard("disallow").
            arrays = jax.device_put((ids_nt, length_n), self._replicated)
            batch = self._programs.prefill(params, *arrays)
            for r, i in enumerate(group):
                out[i] = PromptPrefill(batch=batch, row=r, true_length=int(length_n[r]))
        return [out[i] for i in range(len(seqs))]

    def prefill_prompt(
        self, *, params: Any, padded_tokens: jax.Array | np.ndarray, true_length: int
    ) -> PromptPrefill:
        """Run one sequence (``prefill_many`` of one); shareable by all its samples.

        Args:
          params: model params.
          padded_tokens: int [T_pad]; only the first true_length count.
          true_length: P, tokens in the sequence (prompt, or prompt + prefix).

        Raises:
          ValueError: P > max_prefill_length, P < 1, or P > len(padded_tokens).
        """
        tokens = np.asarray(jax.device_get(padded_tokens)).reshape(-1)
        if int(true_length) > tokens.shape[0]:
            raise ValueError(
                f"prefill: true_length={int(true_length)} exceeds len(padded_tokens)="
                f"{tokens.shape[0]}"
            )
        return self.prefill_many(params, [tokens[: int(true_length)]])[0]

    def first_tokens(
        self,
        shared: PromptPrefill,
        identities: list[tuple[int, int, int]],
        *,
        token_index: int = 0,
    ) -> list[Prefix]:
        """JetStream Prefixes of N samples drawn from one ``prefill_prompt``.

        Args:
          shared: from ``prefill_prompt`` / ``prefill_many`` under the samples' params.
          identities: (seed, prompt_id, sample_index) per sample, N >= 1.
          token_index: response index of the tokens drawn (0 for a prompt, n for a
            recompute of prompt + n tokens; see ``LlamaEngine.prefill``).

        Returns:
          N Prefixes, in order, sharing one [1, bucket] cache.

        Raises:
          ValueError: no identities, or token_index < 0.
        """
        if not identities:
            raise ValueError("first_tokens: identities is empty")
        if token_index < 0:
            raise ValueError(f"prefill: token_index must be >= 0, got {token_index}")
        n = len(identities)
        ident_g4 = identity_rows(identities, token_index)
        row_dev, ident_dev = jax.device_put((np.int32(shared.row), ident_g4), self._replicated)
        token_g, logp_g = self._programs.first_tokens(shared.batch.logits_nv, row_dev, ident_dev)
        cache, true_length = self._programs.take_row(shared.batch, row_dev)
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
            for g in range(n)
        ]
