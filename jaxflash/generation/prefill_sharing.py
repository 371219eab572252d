"""Prompt prefills for the slot loop, shared by fresh samples of one prompt.

Prefix sharing (``share_prefix=True``, the default): fresh requests with the same
prompt tokens reuse one prompt prefill (``Prefiller.prefill_prompt``) and each
draws its own first token from it (``first_tokens``), so a prompt replicated G
times is prefilled once, not G times, with bit-identical tokens and logprobs.
A prefill is kept for later fills while queued requests still need it, and
dropped at every weight swap (valid only under the params it ran with).

``SharedPrefills`` owns the kept prefills; ``slot_loop.SlotBatcher`` asks it for
the prefills of each fill and tells it which prompts are still queued.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxflash.generation.engine.prefill import Prefiller
from jaxflash.generation.engine.state import PromptPrefill
from jaxflash.generation.slot_types import SlotStats


class SharedPrefills:
    """Prefills of one engine's prompts under the current params, kept for reuse.

    Args:
      prefiller: the engine's ``Prefiller`` (``LlamaEngine.prefiller``).
      share_prefix: fresh sequences with equal prompt tokens share one prefill;
        False prefills every sequence alone. Tokens and logprobs are bit-identical
        either way.
      capacity: most prefills kept between fills (the engine's slot count B).
    """

    def __init__(self, prefiller: Prefiller, *, share_prefix: bool, capacity: int):
        self.prefiller = prefiller
        self.share_prefix = bool(share_prefix)
        self._capacity = int(capacity)
        # prompt tokens (bytes) -> its prefill under the current params; at most
        # `capacity` entries, cleared by `clear`, pruned by `keep_only`.
        self._shared: dict[bytes, PromptPrefill] = {}

    def clear(self) -> None:
        """Forget every kept prefill (call when the params change)."""
        self._shared.clear()

    def prefills(
        self,
        params: Any,
        runs: Sequence[tuple[np.ndarray, Sequence[int]]],
        stats: SlotStats,
    ) -> list[PromptPrefill]:
        """One prefill per run, all new ones in one ``prefill_many``.

        Fresh runs of one prompt share a prefill (also one kept from an earlier
        fill); a recompute (a run with generated tokens) or ``share_prefix=False``
        prefills alone.

        Args:
          params: the params the prefills run under (placed on the engine's mesh).
          runs: per run, (prompt tokens int [P], tokens generated so far).
          stats: counters updated in place (``prefills``, ``shared_prefills``,
            ``recompute_tokens``).

        Returns:
          One PromptPrefill per run, in order.
        """
        out: dict[int, PromptPrefill] = {}
        todo: list[np.ndarray] = []  # sequences to prefill now
        owners: list[list[int] | bytes] = []  # run indices, or the shared prompt key
        groups: dict[bytes, list[int]] = {}
        for i, (prompt_tokens, generated) in enumerate(runs):
            prompt = np.asarray(prompt_tokens, np.int32)
            if self.share_prefix and not generated:
                groups.setdefault(prompt.tobytes(), []).append(i)
                continue
            # A recompute re-prefills prompt + prefix; its next token has response
            # index len(generated), keyed as if never interrupted.
            tokens = np.concatenate([prompt, np.asarray(generated, np.int32)])
            if generated:
                stats.recompute_tokens += tokens.shape[0]
            todo.append(tokens)
            owners.append([i])
        for key, members in groups.items():
            shared = self._shared.get(key)
            if shared is None:
                todo.append(np.frombuffer(key, np.int32))
                owners.append(key)
                stats.shared_prefills += len(members) - 1
            else:
                stats.shared_prefills += len(members)
                for i in members:
                    out[i] = shared
        if todo:
            stats.prefills += len(todo)
            for owner, prefill in zip(
                owners, self.prefiller.prefill_many(params, todo), strict=True
            ):
                if isinstance(owner, bytes):
                    self._shared[owner] = prefill
                    owner = groups[owner]
                for i in owner:
                    out[i] = prefill
        return [out[i] for i in range(len(runs))]

    def keep_only(self, wanted_prompts: Iterable[np.ndarray]) -> None:
        """Keep only prefills of ``wanted_prompts`` (the queued fresh requests'
        prompt tokens), at most ``capacity``, dropping the oldest first."""
        if not self._shared:
            return
        wanted = {np.asarray(p, np.int32).tobytes() for p in wanted_prompts}
        for key in [k for k in self._shared if k not in wanted]:
            del self._shared[key]
        while len(self._shared) > self._capacity:
            del self._shared[next(iter(self._shared))]  # oldest first
