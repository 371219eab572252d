"""One stored trajectory of the replay buffer, and how entries become checkpoint data.

An entry keeps the Sample exactly as generated (tokens, behaviour logprobs,
per-token versions, response mask, reward) with read-only copies of its arrays,
so a replayed sample's importance ratio is always taken against the behaviour
logprobs that were stored, never against something recomputed or mutated later.

Persistence: ``pack_entries`` turns entries into a few flat numpy arrays (ragged
per-entry arrays concatenated, with lengths) plus JSON-able per-entry metadata;
``unpack_entries`` inverts it bit for bit. ``encode_arrays`` / ``decode_arrays``
wrap the arrays as base64 of an ``.npz`` so the whole buffer fits the JSON
metadata item of a checkpoint (``checkpoint.CheckpointMeta.extra``).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxflash.types import FinishReason, Sample

_FINISH = tuple(FinishReason)


def prompt_key(prompt_tokens: np.ndarray) -> str:
    """Stable identity of a prompt's text: sha1 of its int32 tokens (16 hex digits).

    Prompt ids are dataset cursor positions, so the same question met again in a
    later epoch has a new id; per-prompt replay (RePO) keys on the tokens instead.
    """
    data = np.ascontiguousarray(np.asarray(prompt_tokens, np.int32)).tobytes()
    return hashlib.sha1(data).hexdigest()[:16]


def _frozen(x: Any, dtype: Any) -> np.ndarray:
    a = np.array(x, dtype=dtype, copy=True)
    a.flags.writeable = False
    return a


@dataclasses.dataclass(kw_only=True)
class ReplayEntry:
    """A trajectory in the buffer.

    Attributes:
      uid: insertion counter (unique, increasing): the buffer's age order.
      sample: the Sample with read-only array copies.
      advantage: float32 [] (per-sequence) or [T_resp] (per-token, multi-turn),
        as given at ingestion (Marin: advantages fixed at ingestion).
      prompt_key: ``prompt_key(sample.prompt_tokens)``.
      start_version: oldest policy version among the sample's tokens; age at
        learner version v is v - start_version.
      ingest_version: learner version at which it was stored (fresh-trained).
      replays: times drawn for replay so far.
    """

    uid: int
    sample: Sample
    advantage: np.ndarray
    prompt_key: str
    start_version: int
    ingest_version: int
    replays: int = 0

    def age(self, learner_version: int) -> int:
        return int(learner_version) - self.start_version


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replayed:
    """A trajectory drawn for the replay cycle of one learner step.

    Attributes:
      sample: the stored Sample (read-only arrays; behaviour logprobs as generated).
      advantage: float32 [] or [T_resp], the stored advantage (the composer may
        recompute it, see ``dual_cycle``).
      uid: the entry's insertion counter.
      prompt_key: see ``prompt_key``.
      age: learner version - start version at the draw, <= the buffer's max_age.
      replay_count: 1 on its first replay, up to the buffer's max_reuse.
    """

    sample: Sample
    advantage: np.ndarray
    uid: int
    prompt_key: str
    age: int
    replay_count: int


def _plain(o: Any) -> Any:
    if isinstance(o, np.ndarray | np.generic):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def freeze_sample(sample: Sample) -> Sample:
    """A copy of ``sample`` whose arrays are read-only copies (dtypes as in types.Sample).

    ``reward_info`` is copied as plain JSON (numpy scalars become Python numbers), so
    the entry can go into a checkpoint's JSON metadata.

    Raises:
      TypeError: ``reward_info`` holds something JSON cannot represent (names the sample).
    """
    try:
        info = json.loads(json.dumps(sample.reward_info, default=_plain))
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"sample (prompt {sample.prompt_id}, index {sample.sample_index}): reward_info "
            f"is not JSON-serialisable: {err}"
        ) from None
    return dataclasses.replace(
        sample,
        prompt_tokens=_frozen(sample.prompt_tokens, np.int32),
        response_tokens=_frozen(sample.response_tokens, np.int32),
        behaviour_logprobs=_frozen(sample.behaviour_logprobs, np.float32),
        token_versions=_frozen(sample.token_versions, np.int32),
        response_mask=None
        if sample.response_mask is None
        else _frozen(sample.response_mask, np.float32),
        routed_experts=None
        if sample.routed_experts is None
        else _frozen(sample.routed_experts, np.int16),
        reward_info=info,
    )


def advantage_array(adv: Any, sample: Sample, what: str) -> np.ndarray:
    """``adv`` as float32 [] or [T_resp]; ValueError (prefixed ``what``) otherwise."""
    a = np.asarray(adv, np.float32)
    if a.ndim not in (0, 1) or (a.ndim == 1 and a.size != len(sample.response_tokens)):
        raise ValueError(
            f"{what}: advantage must be a scalar or [T_resp={len(sample.response_tokens)}], "
            f"got shape {a.shape}"
        )
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what}: advantage is not finite")
    return a


def check_sample(sample: Sample, what: str) -> None:
    """ValueError (prefixed ``what``) unless arrays match T_resp and the reward is finite."""
    r = len(sample.response_tokens)
    for name in ("behaviour_logprobs", "token_versions"):
        if len(getattr(sample, name)) != r:
            raise ValueError(
                f"{what}: {name} has {len(getattr(sample, name))} entries, expected {r}"
            )
    if sample.response_mask is not None and len(sample.response_mask) != r:
        raise ValueError(
            f"{what}: response_mask has {len(sample.response_mask)} entries, expected {r}"
        )
    if sample.reward is None or not np.isfinite(float(sample.reward)):
        raise ValueError(f"{what}: reward must be a finite number, got {sample.reward!r}")


def pack_entries(entries: Sequence[ReplayEntry]) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Entries -> (flat arrays, per-entry JSON metadata); inverse of ``unpack_entries``.

    Returns:
      arrays: int64 ``scalars`` [n, 8] (uid, prompt_id, sample_index, start_version,
        ingest_version, replays, Sample.start_version, finish code); float64
        ``reward`` [n]; int64 ``lengths`` [n, 4] (prompt, response, mask (0 = no
        mask), advantage (0 = per-sequence)); concatenations ``prompt_tokens``,
        ``response_tokens``, ``token_versions`` (int32), ``behaviour_logprobs``,
        ``response_mask``, ``advantage_tokens`` (float32) and ``advantage_scalar``
        float32 [n]; with MoE routes also ``routed_experts`` int16 [sum of routed
        tokens, L, k] and ``routed_tokens`` int64 [n] (0: the sample has none).
      meta: per entry {"reward_info", "text"} (``reward_info`` is already plain JSON:
        ``freeze_sample`` made it so at ingestion).
    """
    n = len(entries)
    scalars = np.zeros((n, 8), np.int64)
    lengths = np.zeros((n, 4), np.int64)
    reward = np.zeros(n, np.float64)
    adv_scalar = np.zeros(n, np.float32)
    parts: dict[str, list[np.ndarray]] = {
        k: []
        for k in (
            "prompt_tokens",
            "response_tokens",
            "token_versions",
            "behaviour_logprobs",
            "response_mask",
            "advantage_tokens",
        )
    }
    meta = []
    routes, routed = [], np.zeros(n, np.int64)
    for i, e in enumerate(entries):
        s = e.sample
        if s.routed_experts is not None:
            routes.append(np.asarray(s.routed_experts, np.int16))
            routed[i] = len(s.routed_experts)
        scalars[i] = (
            e.uid,
            s.prompt_id,
            s.sample_index,
            e.start_version,
            e.ingest_version,
            e.replays,
            s.start_version,
            _FINISH.index(FinishReason(s.finish_reason)),
        )
        reward[i] = float(s.reward)
        mask_len = 0 if s.response_mask is None else len(s.response_mask)
        adv_len = 0 if e.advantage.ndim == 0 else e.advantage.size
        lengths[i] = (len(s.prompt_tokens), len(s.response_tokens), mask_len, adv_len)
        parts["prompt_tokens"].append(np.asarray(s.prompt_tokens, np.int32))
        parts["response_tokens"].append(np.asarray(s.response_tokens, np.int32))
        parts["token_versions"].append(np.asarray(s.token_versions, np.int32))
        parts["behaviour_logprobs"].append(np.asarray(s.behaviour_logprobs, np.float32))
        if s.response_mask is not None:
            parts["response_mask"].append(np.asarray(s.response_mask, np.float32))
        if adv_len:
            parts["advantage_tokens"].append(e.advantage.astype(np.float32))
        else:
            adv_scalar[i] = e.advantage
        meta.append({"reward_info": s.reward_info, "text": s.response_text})
    dtypes = {"prompt_tokens": np.int32, "response_tokens": np.int32, "token_versions": np.int32}
    arrays = {
        k: np.concatenate(v).astype(dtypes.get(k, np.float32))
        if v
        else np.zeros(0, dtypes.get(k, np.float32))
        for k, v in parts.items()
    }
    arrays.update(scalars=scalars, lengths=lengths, reward=reward, advantage_scalar=adv_scalar)
    if routes:  # only a MoE run's buffer has them (older checkpoints lack the keys)
        arrays.update(routed_experts=np.concatenate(routes), routed_tokens=routed)
    return arrays, meta


def unpack_entries(arrays: dict[str, np.ndarray], meta: list[dict]) -> list[ReplayEntry]:
    """Inverse of ``pack_entries`` (bit-exact arrays, read-only)."""
    scalars, lengths = arrays["scalars"], arrays["lengths"]
    if len(meta) != len(scalars):
        raise ValueError(
            f"replay state: {len(scalars)} entries in arrays but {len(meta)} in metadata"
        )
    cursor: dict[str, int] = {}

    def take(name: str, length: int) -> np.ndarray:
        start = cursor.get(name, 0)
        cursor[name] = start + length
        return arrays[name][start : start + length]

    routed = arrays.get("routed_tokens", np.zeros(len(scalars), np.int64))
    out = []
    for i in range(len(scalars)):
        uid, pid, sidx, start_v, ingest_v, replays, sample_start, finish = (
            int(x) for x in scalars[i]
        )
        p_len, r_len, m_len, a_len = (int(x) for x in lengths[i])
        sample = Sample(
            prompt_id=pid,
            sample_index=sidx,
            prompt_tokens=take("prompt_tokens", p_len),
            response_tokens=take("response_tokens", r_len),
            token_versions=take("token_versions", r_len),
            behaviour_logprobs=take("behaviour_logprobs", r_len),
            start_version=sample_start,
            finish_reason=_FINISH[finish],
            reward=float(arrays["reward"][i]),
            reward_info=meta[i]["reward_info"],
            response_text=meta[i]["text"],
            response_mask=take("response_mask", m_len) if m_len else None,
            routed_experts=take("routed_experts", int(routed[i])) if routed[i] else None,
        )
        advantage = take("advantage_tokens", a_len) if a_len else arrays["advantage_scalar"][i]
        out.append(
            ReplayEntry(
                uid=uid,
                sample=freeze_sample(sample),
                advantage=_frozen(advantage, np.float32),
                prompt_key=prompt_key(sample.prompt_tokens),
                start_version=start_v,
                ingest_version=ingest_v,
                replays=replays,
            )
        )
    return out


def encode_arrays(arrays: dict[str, np.ndarray]) -> str:
    """Arrays -> base64 text of an uncompressed ``.npz`` (bit-exact, JSON-safe)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_arrays(text: str) -> dict[str, np.ndarray]:
    """Inverse of ``encode_arrays``; refuses pickled objects."""
    with np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
