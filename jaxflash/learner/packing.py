"""Sequence packing: the rows of a padded TrainBatch laid end to end in fewer rows.

``pack_batch`` pads every sequence of a batch to one length bucket, so a batch with
one long response and many short ones is mostly padding. ``pack_rows`` moves each
row's tokens (up to its last loss-carrying target: nothing after it feeds the loss)
into rows of ``row_length`` tokens by first-fit decreasing, each sequence with its
own segment id (1, 2, ... within a row; 0 marks padding) and its own positions
(RoPE restarts per sequence). The model attends within segments
(``models.caches.attention``), so every token sees exactly the context it had unpacked and
the logprobs are those of the unpacked batch (tests/learner/test_packing.py).

What the loss reads per sequence must then be read per segment: the sequence count
of the ``seq-mean-*`` normalisers is counted over segments (``sequence_count``);
losses and aggregations that reduce over a row as one sequence (GSPO's sequence
ratio, sequence-level rollout corrections, seq-mean-token-mean's per-row length, the
dual cycle's per-row labels) are refused with packing (``check_packing``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.learner.batching import ROUTES_FIELD, TRAIN_BATCH_FIELDS
from jaxflash.models.caches.attention import SHARED_PREFIX_SHIFT
from jaxflash.types import TrainBatch

# Losses whose per-token terms read only their own token (no sum over a row).
TOKEN_LEVEL_LOSSES = ("vanilla_pg", "ppo", "decoupled_ppo", "tis", "cispo", "token_mis", "icepop")
# Aggregations that need only token sums and the (segment-counted) sequence count.
PACKABLE_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def check_packing(loss: str, aggregation: str, replay_loss: str | None) -> None:
    """Refuse what would read a packed row as one sequence.

    Raises:
      ValueError: a loss outside ``TOKEN_LEVEL_LOSSES``, an aggregation outside
        ``PACKABLE_AGGREGATIONS``, or a replay loss (the dual cycle labels rows).
    """
    if loss not in TOKEN_LEVEL_LOSSES:
        raise ValueError(
            f"LearnerConfig.packing needs a token-level loss {TOKEN_LEVEL_LOSSES}; {loss!r} "
            "reduces over a row as one sequence (set packing=False)"
        )
    if aggregation not in PACKABLE_AGGREGATIONS:
        raise ValueError(
            f"LearnerConfig.packing needs aggregation in {PACKABLE_AGGREGATIONS}, got "
            f"{aggregation!r} (its per-row length would mix packed sequences)"
        )
    if replay_loss is not None:
        raise ValueError(
            "LearnerConfig.packing does not take a replay_loss (rows carry a cycle; "
            "replay.* sets it when replay is on: set learner.packing=False or turn replay off)"
        )


@dataclasses.dataclass(frozen=True)
class RowPlacement:
    """Where each row of the unpacked batch went: its tokens ``[start[i], start[i] +
    length[i])`` to row ``row[i]``, tokens ``[offset[i], offset[i] + length[i])``;
    length 0 (row ``-1``): it had no loss. ``start`` None: 0 (``pack_rows``); under
    ``pack_groups`` the tokens before ``start[i]`` are the group's shared prefix."""

    row: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    start: np.ndarray | None = None


def _needed_lengths(mask_bt: np.ndarray) -> np.ndarray:
    """Tokens each row needs: through its last loss-carrying target (0 if none)."""
    valid = mask_bt > 0
    last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
    return np.where(valid.any(axis=1), last + 1, 0)


def pack_rows(
    batch: TrainBatch,
    *,
    row_length: int = 0,
    min_rows: int = 1,
) -> tuple[TrainBatch, RowPlacement]:
    """Pack a host TrainBatch's rows into fewer rows with segment ids.

    Args:
      batch: TrainBatch of numpy arrays [B, T], one sequence per row (``pack_batch``).
      row_length: tokens per packed row if longer than the batch's T (which
        ``pack_batch`` bucketed from its longest sequence); 0: T.
      min_rows: at least this many rows (empty ones are all-masked).

    Returns:
      (packed TrainBatch [R, L] with ``segment_ids_bt`` set, RowPlacement of each
      input row). Rows without a loss-carrying token are left out.

    Raises:
      ValueError: a batch that is already packed (a row with segment id > 1) or not
        [B, T].
    """
    mask = _unpacked_mask(batch, "pack_rows")
    need = _needed_lengths(mask)
    length = max(row_length, mask.shape[1])
    row, offset, used_rows = _first_fit(need, length)
    n_rows = max(used_rows, min_rows)
    seg = np.zeros((n_rows, length), np.int32)
    count = np.zeros(n_rows, np.int32)
    for i in sorted(np.flatnonzero(row >= 0), key=lambda i: offset[i]):
        count[row[i]] += 1
        seg[row[i], offset[i] : offset[i] + need[i]] = count[row[i]]
    copies = [(i, 0, need[i], row[i], offset[i]) for i in np.flatnonzero(row >= 0)]
    packed = _lay_out(batch, copies, seg)
    return packed, RowPlacement(row=row, offset=offset, length=need)


def _unpacked_mask(batch: TrainBatch, who: str) -> np.ndarray:
    """The loss mask [B, T] of a batch with one sequence per row, else ValueError."""
    if batch.segment_ids_bt is not None and np.max(batch.segment_ids_bt) > 1:
        raise ValueError(f"{who}: the batch is already packed (a row has 2+ segments)")
    mask = np.asarray(batch.loss_mask_bt)
    if mask.ndim != 2:
        raise ValueError(f"{who}: expected [B, T] arrays, got {mask.shape}")
    return mask


def _first_fit(size: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit decreasing of items of ``size`` tokens (0: left out) into rows of
    ``length`` (stable: equal sizes keep their order) -> (row, offset per item, row
    -1 when left out; rows used)."""
    order = sorted((i for i in range(len(size)) if size[i] > 0), key=lambda i: -size[i])
    free: list[int] = []
    row = np.full(len(size), -1, np.int64)
    offset = np.zeros(len(size), np.int64)
    for i in order:
        r = next((r for r, f in enumerate(free) if f >= size[i]), len(free))
        if r == len(free):
            free.append(length)
        row[i], offset[i] = r, length - free[r]
        free[r] -= size[i]
    return row, offset, len(free)


def _lay_out(batch: TrainBatch, copies: list, seg: np.ndarray) -> TrainBatch:
    """The packed TrainBatch [R, L] of segment ids ``seg``: every field's tokens
    ``[a, b)`` of row i copied to row r from column o, for each (i, a, b, r, o) of
    ``copies``; padding is 0 (versions and routes -1), its positions 0, 1, ... (it is
    segment 0: it sees only padding, and nothing sees it)."""
    shape = np.shape(batch.loss_mask_bt)
    out = {}
    for name in (*TRAIN_BATCH_FIELDS, ROUTES_FIELD):
        src = getattr(batch, name)
        if name == "segment_ids_bt" or (name == ROUTES_FIELD and src is None):
            continue
        src = np.zeros(shape, np.int32) if src is None else np.asarray(src)
        fill = -1 if name in ("token_versions_bt", ROUTES_FIELD) else 0
        dst = np.full((*seg.shape, *src.shape[2:]), fill, src.dtype)
        for i, a, b, r, o in copies:
            dst[r, o : o + b - a] = src[i, a:b]
        out[name] = dst
    used = seg > 0
    out["positions_bt"] = np.where(used, out["positions_bt"], _pad_positions(used))
    return TrainBatch(**out, segment_ids_bt=seg)


def pack_groups(
    batch: TrainBatch,
    *,
    row_length: int = 0,
    length_multiple: int = 1,
    min_rows: int = 1,
) -> tuple[TrainBatch, RowPlacement]:
    """Pack a host TrainBatch with each shared prompt laid out once per group.

    Rows whose tokens before their first loss-carrying target are identical (input
    ids, positions and recorded MoE routes: the G samples of one prompt) form a group.
    A group is laid out as its shared prefix (the prompt without its last token,
    segment ``(k << 16) | 0``) followed by each row's continuation from the prompt's
    last token on (segment ``(k << 16) | j``, j = 1, 2, ...), with the rows' own
    positions. Attention lets every continuation see its group's prefix and itself
    (``models.caches.attention.segments_visible``), so each token has the context it
    had unpacked and its logprob is the unpacked one up to float summation order,
    while the prompt's forward and backward run once per group instead of G times
    (the shared-prefix layout of GRPO training, e.g. arXiv 2506.05433). Groups go
    into rows by first-fit decreasing as in ``pack_rows``.

    Args:
      batch: TrainBatch of numpy arrays [B, T], one sequence per row (``pack_batch``).
      row_length: tokens per packed row where longer than T and the longest group.
      length_multiple: the row length is rounded up to a multiple of this.
      min_rows: at least this many rows (empty ones are all-masked).

    Returns:
      (packed TrainBatch [R, L] with ``segment_ids_bt`` set, RowPlacement of each
      input row: its continuation's place, ``start`` = its shared prefix's length).
      Rows without a loss-carrying token are left out.

    Raises:
      ValueError: a batch that is already packed, or not [B, T].
    """
    mask = _unpacked_mask(batch, "pack_groups")
    need = _needed_lengths(mask)
    # The prefix: columns before the input that predicts the first loss target (the
    # prompt's last token), which each continuation carries itself.
    prefix = np.argmax(mask > 0, axis=1)
    ids, pos = np.asarray(batch.input_ids_bt), np.asarray(batch.positions_bt)
    routes = batch.routed_experts_btlk
    groups: dict[bytes, list[int]] = {}
    for i in np.flatnonzero(need > 0):
        c = prefix[i]
        key = [np.int64(c).tobytes(), ids[i, :c].tobytes(), pos[i, :c].tobytes()]
        if routes is not None:
            key.append(np.asarray(routes)[i, :c].tobytes())
        groups.setdefault(b"|".join(key), []).append(int(i))
    members = list(groups.values())
    size = [prefix[m[0]] + sum(need[i] - prefix[i] for i in m) for m in members]
    length = max(row_length, mask.shape[1], max(size, default=0))
    length = -(-length // length_multiple) * length_multiple
    group_row, group_offset, used_rows = _first_fit(np.asarray(size, np.int64), length)
    n_rows = max(used_rows, min_rows)
    where = [(g, group_row[g], group_offset[g]) for g in range(len(members))]
    row = np.full(len(need), -1, np.int64)
    offset = np.zeros(len(need), np.int64)
    start = np.zeros(len(need), np.int64)
    seg = np.zeros((n_rows, length), np.int32)
    count = np.zeros(n_rows, np.int32)
    copies = []  # (src row, src from, src to, dst row, dst from)
    for g, r, o in sorted(where, key=lambda x: (x[1], x[2])):
        count[r] += 1
        first, c = members[g][0], prefix[members[g][0]]
        base = int(count[r]) << SHARED_PREFIX_SHIFT
        copies.append((first, 0, c, r, o))
        seg[r, o : o + c] = base
        o += c
        for j, i in enumerate(members[g], start=1):
            n = need[i] - c
            copies.append((i, c, need[i], r, o))
            seg[r, o : o + n] = base | j
            row[i], offset[i], start[i] = r, o, c
            o += n
    packed = _lay_out(batch, copies, seg)
    return packed, RowPlacement(row=row, offset=offset, length=need - start, start=start)


def _pad_positions(used_rl: np.ndarray) -> np.ndarray:
    """int32 [R, L]: 0, 1, ... along each row's padding tail."""
    first_pad = used_rl.sum(axis=1, keepdims=True)
    return np.maximum(np.arange(used_rl.shape[1])[None] - first_pad, 0).astype(np.int32)


def unpack_rows(x_rl: np.ndarray, placement: RowPlacement, shape: tuple[int, int]) -> np.ndarray:
    """Per-token values of a packed batch [R, L] back to the unpacked rows ``shape``
    [B, T] (zeros where a row had no token)."""
    out = np.zeros(shape, np.asarray(x_rl).dtype)
    for i in np.flatnonzero(placement.row >= 0):
        o, n = placement.offset[i], placement.length[i]
        s = 0 if placement.start is None else placement.start[i]
        out[i, s : s + n] = x_rl[placement.row[i], o : o + n]
    return out


def padding_fraction(batch: TrainBatch) -> float:
    """Share of a [B, T] batch's token slots that hold no sequence token (through each
    row's last loss-carrying target; rows without loss count as padding)."""
    mask = np.asarray(batch.loss_mask_bt)
    mask = mask.reshape(-1, mask.shape[-1])
    return 1.0 - float(_needed_lengths(mask).sum()) / mask.size


def sequence_count(mask_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """float32: sequences (row, segment) with at least one valid token, over [..., T]
    arrays whose segments are contiguous runs (``pack_rows``)."""
    valid = mask_bt > 0
    t = jnp.arange(valid.shape[-1])
    last_valid = jax.lax.cummax(jnp.where(valid, t, -1), axis=valid.ndim - 1)
    prev = jnp.concatenate([jnp.full(valid.shape[:-1] + (1,), -1), last_valid[..., :-1]], -1)
    prev_seg = jnp.take_along_axis(segment_ids_bt, jnp.maximum(prev, 0), axis=-1)
    first = valid & ((prev < 0) | (prev_seg != segment_ids_bt))
    return jnp.sum(first).astype(jnp.float32)
