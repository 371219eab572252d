"""Small scored Samples for replay tests (host numpy only)."""

import numpy as np

from jaxflash.types import FinishReason, Sample


def make_sample(
    pid: int,
    idx: int = 0,
    *,
    start: int = 0,
    reward: float = 1.0,
    length: int = 3,
    prompt: tuple[int, ...] | None = None,
    versions=None,
    logp_seed: int | None = None,
    mask=None,
) -> Sample:
    """A finished Sample; behaviour logprobs are distinct per (pid, idx) unless seeded."""
    tv = np.full(length, start, np.int32) if versions is None else np.asarray(versions, np.int32)
    rng = np.random.default_rng(pid * 1000 + idx if logp_seed is None else logp_seed)
    return Sample(
        prompt_id=pid,
        sample_index=idx,
        prompt_tokens=np.array(prompt if prompt is not None else (7, pid % 97 + 1), np.int32),
        response_tokens=rng.integers(3, 50, tv.size).astype(np.int32),
        behaviour_logprobs=-rng.random(tv.size).astype(np.float32),
        token_versions=tv,
        start_version=int(tv.min()) if tv.size else start,
        finish_reason=FinishReason.EOS,
        reward=float(reward),
        reward_info={"math": float(reward)},
        response_text=f"r{pid}.{idx}",
        response_mask=None if mask is None else np.asarray(mask, np.float32),
    )


def make_group(pid: int, rewards, *, start: int = 0, prompt=None, length: int = 3):
    """G samples of one prompt with the given rewards (sample_index 0..G-1)."""
    return [
        make_sample(pid, i, start=start, reward=r, prompt=prompt, length=length)
        for i, r in enumerate(rewards)
    ]
