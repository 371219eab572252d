"""Pack multi-turn episode Samples: ``pack_batch`` plus per-token advantages.

A multi-turn Sample (``envs.training.trajectory_to_sample``) carries
``response_mask`` [T_resp]: 1 on the tokens the policy sampled, 0 on the chat glue,
observations and tool output between turns. ``pack_batch`` lays the sequences out
(``types.TrainBatch``: target t of row b is response token j at t = P - 1 + j)
and applies the masks; with this module's per-token advantages, each row's
response span reads

    loss_mask_bt      = response_mask (1 everywhere when it is None)
    advantages_bt     = per-token advantage * response_mask
    behaviour_logp_bt = 0 where the mask is 0
    token_versions_bt = -1 where the mask is 0

so inserted tokens add nothing to the loss, its normalisers or the
version metrics, while still being attended to as context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxflash.learner.batching import pack_batch
from jaxflash.types import Sample, TrainBatch


def pack_episode_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float | np.ndarray],
    **pack_kwargs,
) -> TrainBatch:
    """``pack_batch`` for samples with response masks and per-token advantages.

    Args:
      samples: Samples; ``response_mask`` float [T_resp] of 0/1 or None (all 1).
      advantages: per sample, a scalar (broadcast over its response) or float32
        [T_resp] per-token advantages (``envs.training.group_token_advantages``).
      **pack_kwargs: ``pack_batch``'s keyword arguments (pad_id, length_multiple,
        power_of_two, max_len, num_sequences).

    Returns:
      TrainBatch of numpy arrays [B, T] (see the module docstring).

    Raises:
      ValueError: as ``pack_batch``; a mask or advantage array of the wrong length,
        a mask value other than 0/1, or non-finite advantages (names the sample).
    """
    if len(advantages) != len(samples):
        raise ValueError(
            f"pack_episode_batch: {len(advantages)} advantages for {len(samples)} samples"
        )
    # pack_batch applies each response_mask (loss mask, behaviour logprobs, versions).
    batch = pack_batch(samples, np.zeros(len(samples), np.float32), **pack_kwargs)
    for b, (s, adv) in enumerate(zip(samples, advantages, strict=True)):
        tag = f"sample (prompt_id={s.prompt_id}, sample_index={s.sample_index})"
        P, R = len(s.prompt_tokens), len(s.response_tokens)
        adv_t = (
            np.broadcast_to(np.asarray(adv, np.float32), (R,))
            if np.ndim(adv) == 0
            else (np.asarray(adv, np.float32).reshape(-1))
        )
        if adv_t.shape != (R,) or not np.all(np.isfinite(adv_t)):
            raise ValueError(
                f"pack_episode_batch: {tag} advantages must be {R} finite values, got "
                f"shape {adv_t.shape}"
            )
        span = slice(P - 1, P + R - 1)
        batch.advantages_bt[b, span] = np.where(batch.loss_mask_bt[b, span] > 0, adv_t, 0.0)
    return batch
