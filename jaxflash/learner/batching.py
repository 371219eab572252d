"""Pack finished Samples into a padded, target-aligned TrainBatch (host numpy).

Layout per sequence (prompt p_0..p_{P-1}, response r_0..r_{R-1}):
    input_ids   p_0 .. p_{P-1} r_0 .. r_{R-2} r_{R-1} pad ...
    target_ids  p_1 .. r_0     r_1 .. r_{R-1} pad     pad ...
    loss_mask   0   .. 1       1   .. 1       0       0 ...
Position t predicts target t (``target[t] == input[t + 1]``); the mask is 1 exactly
on the R targets that are response tokens, i.e. t in [P-1, P+R-2], times the
sample's ``response_mask`` when it has one (multi-turn episodes: 0 on inserted
observation / tool tokens, which stay in the input as context but carry no loss,
advantage, behaviour logprob or version). Sequences are
right-padded, so pads never precede (and never influence) real tokens under the
causal mask. T is rounded up to a length bucket so the jitted step sees few shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxflash.types import Sample, TrainBatch

TRAIN_BATCH_FIELDS = (
    "input_ids_bt",
    "positions_bt",
    "target_ids_bt",
    "loss_mask_bt",
    "advantages_bt",
    "behaviour_logp_bt",
    "token_versions_bt",
    "cycle_bt",
    "segment_ids_bt",
)
# dtypes of the device batch (types.TrainBatch): ids, positions, versions, the
# cycle label and segment ids are int32; masks / advantages / logprobs float32.
ROUTES_FIELD = "routed_experts_btlk"
"""The optional TrainBatch field of MoE routes, int16 [B, T, L, k] (-1: none recorded):
not in ``TRAIN_BATCH_FIELDS`` (its shape is not [B, T]); each helper here moves it
with its row (``split_micro_batches``, ``packing.pack_rows``, ``device_batch``)."""
INT_FIELDS = frozenset(
    {"input_ids_bt", "positions_bt", "target_ids_bt", "token_versions_bt", "cycle_bt",
     "segment_ids_bt"}
)  # fmt: skip


def bucket_length(length: int, *, multiple: int = 32, power_of_two: bool = False) -> int:
    """Round ``length`` up to a bucket: a multiple of ``multiple`` or a power of two.

    Args:
      length: tokens (>= 1).
      multiple: bucket granularity when not ``power_of_two``.
      power_of_two: round to the next power of two (>= ``multiple``) instead.

    Raises:
      ValueError: length < 1 or multiple < 1.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if power_of_two:
        return max(multiple, 1 << (length - 1).bit_length())
    return -(-length // multiple) * multiple


def pack_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float] | np.ndarray,
    *,
    pad_id: int = 0,
    length_multiple: int = 32,
    power_of_two: bool = False,
    max_len: int | None = None,
    num_sequences: int | None = None,
    cycle_b: Sequence[int] | np.ndarray | None = None,
) -> TrainBatch:
    """Pack samples and their per-sample advantages into a padded TrainBatch.

    Args:
      samples: finished Samples (prompt + response tokens, behaviour logprobs,
        token versions, optional ``response_mask`` float [R] of 0/1). Rewards are
        not read here: advantages carry them.
      advantages: float [B_real], one advantage per sample, broadcast over its
        response tokens.
      pad_id: token id written into padding (its targets are masked).
      length_multiple, power_of_two: length bucket (see ``bucket_length``).
      max_len: if set, T may not exceed it (the model's max_seq_len).
      num_sequences: if set, pad the batch with empty (all-masked) rows to this
        many sequences so the batch shape is fixed; must be >= len(samples).
      cycle_b: int [B_real], each sample's replay cycle (0 fresh, 1 replayed);
        None: all fresh. Padding rows are fresh (they carry no tokens).

    Returns:
      TrainBatch of numpy arrays [B, T] (dtypes as in ``types.TrainBatch``);
      B = num_sequences or len(samples). ``routed_experts_btlk`` is set (int16
      [B, T, L, k], -1 where nothing was recorded) when any sample has routes.

    Raises:
      ValueError: empty input, mismatched lengths, a sample with an empty
        response, per-token arrays whose length differs from the response, a
        response_mask that is not 0/1 of the response's length, non-finite
        advantages, a sequence longer than ``max_len`` (names the sample), a
      ``cycle_b`` that is not 0/1 per sample, or routes that are not
      [T_prompt + T_resp, L, k] alike across samples.
    """
    if len(samples) == 0:
        raise ValueError("pack_batch: samples is empty")
    cycle = np.zeros(len(samples), np.int32) if cycle_b is None else np.asarray(cycle_b)
    if cycle.shape != (len(samples),) or not np.all((cycle == 0) | (cycle == 1)):
        raise ValueError(
            f"pack_batch: cycle_b must be 0/1 per sample, shape ({len(samples)},); got "
            f"shape {cycle.shape}"
        )
    adv_b = np.asarray(advantages, dtype=np.float32)
    if adv_b.shape != (len(samples),):
        raise ValueError(
            f"pack_batch: advantages must have shape ({len(samples)},), got {adv_b.shape}"
        )
    if not np.all(np.isfinite(adv_b)):
        raise ValueError(f"pack_batch: advantages contain non-finite values: {adv_b}")
    lengths, response_masks = [], []
    for s in samples:
        resp = np.asarray(s.response_tokens)
        tag = f"sample (prompt_id={s.prompt_id}, sample_index={s.sample_index})"
        if len(s.prompt_tokens) < 1:
            raise ValueError(f"pack_batch: {tag} has an empty prompt")
        if len(resp) < 1:
            raise ValueError(f"pack_batch: {tag} has an empty response")
        for name in ("behaviour_logprobs", "token_versions"):
            if len(getattr(s, name)) != len(resp):
                raise ValueError(
                    f"pack_batch: {tag} has {len(getattr(s, name))} {name} for "
                    f"{len(resp)} response tokens"
                )
        response_masks.append(_response_mask(s, len(resp), tag))
        total = len(s.prompt_tokens) + len(resp)
        if max_len is not None and total > max_len:
            raise ValueError(f"pack_batch: {tag} has {total} tokens > max_len={max_len}")
        lengths.append(total)
    T = bucket_length(max(lengths), multiple=length_multiple, power_of_two=power_of_two)
    if max_len is not None:
        T = min(T, max_len)
    B = len(samples) if num_sequences is None else num_sequences
    if B < len(samples):
        raise ValueError(f"pack_batch: num_sequences={B} < number of samples {len(samples)}")

    input_ids = np.full((B, T), pad_id, np.int32)
    target_ids = np.full((B, T), pad_id, np.int32)
    mask = np.zeros((B, T), np.float32)
    adv = np.zeros((B, T), np.float32)
    blogp = np.zeros((B, T), np.float32)
    versions = np.full((B, T), -1, np.int32)
    for b, s in enumerate(samples):
        prompt = np.asarray(s.prompt_tokens, np.int32)
        resp = np.asarray(s.response_tokens, np.int32)
        P, R = len(prompt), len(resp)
        full = np.concatenate([prompt, resp])
        input_ids[b, : P + R] = full
        target_ids[b, : P + R - 1] = full[1:]
        span = slice(P - 1, P + R - 1)  # targets that are response tokens
        keep = response_masks[b] > 0
        mask[b, span] = response_masks[b]
        adv[b, span] = np.where(keep, adv_b[b], 0.0)
        blogp[b, span] = np.where(keep, np.asarray(s.behaviour_logprobs, np.float32), 0.0)
        versions[b, span] = np.where(keep, np.asarray(s.token_versions, np.int32), -1)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    routes = _routes(samples, lengths, B, T)
    cycle_bt = np.zeros((B, T), np.int32)
    cycle_bt[: len(samples)] = cycle.astype(np.int32)[:, None]
    return TrainBatch(
        input_ids_bt=input_ids,
        positions_bt=positions,
        target_ids_bt=target_ids,
        loss_mask_bt=mask,
        advantages_bt=adv,
        behaviour_logp_bt=blogp,
        token_versions_bt=versions,
        cycle_bt=cycle_bt,
        segment_ids_bt=np.ones((B, T), np.int32),  # one sequence per row
        routed_experts_btlk=routes,
    )


def _routes(samples: Sequence[Sample], lengths: list[int], B: int, T: int) -> np.ndarray | None:
    """int16 [B, T, L, k] of the samples' ``routed_experts`` (-1 elsewhere), or None
    when no sample has routes."""
    have = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not have:
        return None
    lk = np.shape(have[0])[1:]
    out = np.full((B, T, *lk), -1, np.int16)
    for b, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        if s.routed_experts is None:
            continue
        r = np.asarray(s.routed_experts)
        if r.shape != (n, *lk):
            raise ValueError(
                f"pack_batch: sample (prompt_id={s.prompt_id}, sample_index={s.sample_index}) "
                f"routed_experts has shape {r.shape}, expected {(n, *lk)}"
            )
        out[b, :n] = r
    return out


def _response_mask(sample: Sample, length: int, tag: str) -> np.ndarray:
    """float32 [length]: the sample's ``response_mask`` (checked 0/1), or all ones."""
    if sample.response_mask is None:
        return np.ones(length, np.float32)
    mask = np.asarray(sample.response_mask, np.float32).reshape(-1)
    if mask.shape != (length,) or not np.all((mask == 0) | (mask == 1)):
        raise ValueError(
            f"pack_batch: {tag} response_mask must be 0/1 of length {length}, got shape "
            f"{mask.shape} with values {np.unique(mask)[:4]}"
        )
    return mask


def split_micro_batches(batch: TrainBatch, micro_batch_size: int) -> TrainBatch:
    """Reshape [B, T] fields to [M, b, T] with b = micro_batch_size.

    A batch whose B is not a multiple of b is first padded with empty rows
    (mask 0, versions -1), which add nothing to the loss or its normalisers.

    Args:
      batch: TrainBatch of numpy arrays [B, T] (``cycle_bt`` None: all fresh;
        ``segment_ids_bt`` None: unpacked).
      micro_batch_size: sequences per micro-batch (b >= 1).

    Returns:
      TrainBatch of numpy arrays [M, b, T], M = ceil(B / b), every field set.

    Raises:
      ValueError: micro_batch_size < 1 or fields with inconsistent shapes.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    shape = np.shape(batch.input_ids_bt)
    if len(shape) != 2:
        raise ValueError(f"split_micro_batches: expected [B, T] arrays, got {shape}")
    B, T = shape
    M = -(-B // micro_batch_size)
    extra = M * micro_batch_size - B
    out = {}
    for name in TRAIN_BATCH_FIELDS:
        x = getattr(batch, name)
        # cycle_bt None: all fresh; segment_ids_bt None: one sequence per row (id 0).
        x = np.zeros((B, T), np.int32) if x is None else np.asarray(x)
        if x.shape != (B, T):
            raise ValueError(f"split_micro_batches: {name} has shape {x.shape}, expected {(B, T)}")
        if extra:
            fill = -1 if name == "token_versions_bt" else 0
            pad = np.full((extra, T), fill, x.dtype)
            if name == "positions_bt":
                pad = np.broadcast_to(np.arange(T, dtype=x.dtype), (extra, T))
            x = np.concatenate([x, pad])
        out[name] = x.reshape(M, micro_batch_size, T)
    routes = batch.routed_experts_btlk
    if routes is not None:
        routes = np.asarray(routes)
        if routes.shape[:2] != (B, T):
            raise ValueError(
                f"split_micro_batches: {ROUTES_FIELD} has shape {routes.shape}, expected "
                f"{(B, T)} + (L, k)"
            )
        pad = np.full((extra, *routes.shape[1:]), -1, routes.dtype)
        routes = np.concatenate([routes, pad]).reshape(M, micro_batch_size, *routes.shape[1:])
    return TrainBatch(**out, routed_experts_btlk=routes)


def batch_counts(batch: TrainBatch) -> tuple[int, int]:
    """(masked tokens, sequences with at least one masked token) of a host batch."""
    mask = np.asarray(batch.loss_mask_bt)
    mask_st = mask.reshape(-1, mask.shape[-1])
    return int(mask_st.sum()), int((mask_st.sum(-1) > 0).sum())
