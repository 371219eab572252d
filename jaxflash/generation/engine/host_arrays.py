"""Host-side array building for the engine's programs (pure numpy, no devices).

Programs compile once per input shape, so the host pads every batch it sends to a
fixed or power-of-two size: prefill groups to exactly ``prefill_rows`` rows, sample
starts to a power of two (padding entries target slot B, which the program drops),
stop-token lists to at least 8 entries of -1. ``block_result`` unpacks the one
array a decode block returns.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jaxflash.generation.engine.state import BlockResult, SampleStart


def pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def prefill_groups(
    seqs: Sequence[np.ndarray], bucket_of: Callable[[int], int], rows: int
) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    """Sequences grouped by bucket, ``rows`` at a time, right-padded.

    Args:
      seqs: 1-D int32 token arrays.
      bucket_of: padded length of a sequence of n tokens (raises on bad n).
      rows: rows per group; a short last group repeats its first row.

    Yields:
      (indices into seqs, ids int32 [rows, bucket], lengths int32 [rows]).
    """
    by_bucket: dict[int, list[int]] = collections.defaultdict(list)
    for i, seq in enumerate(seqs):
        by_bucket[bucket_of(seq.shape[0])].append(i)
    for bucket, members in by_bucket.items():
        for first in range(0, len(members), rows):
            group = members[first : first + rows]
            ids_nt = np.zeros((rows, bucket), np.int32)
            length_n = np.zeros((rows,), np.int32)
            for r, i in enumerate(group):
                ids_nt[r, : seqs[i].shape[0]] = seqs[i]
                length_n[r] = seqs[i].shape[0]
            ids_nt[len(group) :], length_n[len(group) :] = ids_nt[0], length_n[0]
            yield group, ids_nt, length_n


def identity_rows(identities: Sequence[tuple[int, int, int]], token_index: int) -> np.ndarray:
    """int32 [pow2(N), 4] rows (seed, prompt_id, sample_index, token_index); padding
    rows copy the first."""
    n = len(identities)
    ident_g4 = np.zeros((pow2(n), 4), np.int32)
    ident_g4[:n, :3] = np.asarray(identities, np.int64).reshape(n, 3)
    ident_g4[n:, :3] = ident_g4[0, :3]
    ident_g4[:, 3] = token_index
    return ident_g4


def start_groups(
    starts: Sequence[SampleStart], num_slots: int
) -> list[tuple[list[int], tuple[np.ndarray, ...]]]:
    """The ``start`` program's inputs, one group per distinct prefill batch.

    Returns:
      [(indices into starts, (row_g, slot_g, ident_g4, budget_g))], G = pow2(group
      size); padding entries have slot ``num_slots`` (dropped by the program).

    Raises:
      ValueError: slots repeated or outside [0, num_slots), or a negative budget.
    """
    slots = [s.slot for s in starts]
    if len(set(slots)) != len(slots) or any(not 0 <= s < num_slots for s in slots):
        raise ValueError(
            f"start_samples: slots must be distinct and in [0, {num_slots}), got {slots}"
        )
    if any(s.budget < 0 for s in starts):
        raise ValueError("start_samples: budget must be >= 0")
    by_batch: dict[int, list[int]] = collections.defaultdict(list)
    for i, s in enumerate(starts):
        by_batch[id(s.prefill.batch)].append(i)
    out = []
    for members in by_batch.values():
        g = pow2(len(members))
        row_g = np.zeros((g,), np.int32)
        slot_g = np.full((g,), num_slots, np.int32)
        ident_g4 = np.zeros((g, 4), np.int32)
        budget_g = np.zeros((g,), np.int32)
        for k, i in enumerate(members):
            s = starts[i]
            row_g[k], slot_g[k], budget_g[k] = s.prefill.row, s.slot, s.budget
            ident_g4[k] = (s.seed, s.prompt_id, s.sample_index, s.token_index)
        ident_g4[len(members) :] = ident_g4[0]
        out.append((members, (row_g, slot_g, ident_g4, budget_g)))
    return out


def stop_array(stop_ids: Sequence[int]) -> np.ndarray:
    """int32 [max(8, pow2(n))] stop ids padded with -1 (never a token)."""
    stop = np.full((max(8, pow2(len(stop_ids))),), -1, np.int32)
    stop[: len(stop_ids)] = np.asarray(list(stop_ids), np.int32)
    return stop


def block_result(out_nb3: np.ndarray, live_n: np.ndarray, steps_run: int) -> BlockResult:
    """Unpack ``generate_block``'s (token, logprob bits, emitted) array [n, B, 3]
    (a MoE engine's has the fed token's routes, L * k more columns)."""
    out_nb3 = np.asarray(out_nb3[:steps_run])
    routes = out_nb3[:, :, 3:].astype(np.int16) if out_nb3.shape[2] > 3 else None
    return BlockResult(
        routes_nbx=routes,
        tokens_nb=out_nb3[:, :, 0].copy(),
        logps_nb=np.ascontiguousarray(out_nb3[:, :, 1]).view(np.float32),
        emitted_nb=out_nb3[:, :, 2].astype(bool),
        live_n=np.asarray(live_n[:steps_run]),
        steps=steps_run,
    )
