"""Prompt prefill for ``LlamaEngine``: buckets and batched prefill.

``Prefiller`` owns the prefill half of the engine (``engine.prefiller``): it pads
each sequence (prompt, or prompt + generated prefix for a recompute) to a
power-of-two bucket and runs ``prefill_rows`` of one bucket per jitted forward pass
(prefix sharing: each distinct prompt once). Its device program is
``engine.programs.Programs``' prefill; the engine's decode half (slots,
``start_samples``, which draws each sample's first token, and ``generate_block``)
consumes its ``PromptPrefill`` results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxflash.generation.engine.host_arrays import prefill_groups
from jaxflash.generation.engine.programs import Programs
from jaxflash.generation.engine.state import EngineConfig, PromptPrefill


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
