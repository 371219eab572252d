"""One policy loss for a dual-cycle batch: one named loss per cycle, chosen per row.

The fresh cycle keeps the usual (alpha-bounded) loss; the replay cycle gets an
off-policy correction chosen by name from ``POLICY_LOSSES`` -- "decoupled_ppo"
(against the proximal policy, AReaL arXiv 2505.24298), "tis", "cispo" (arXiv
2506.13585), "m2po" (arXiv 2510.01161) or plain "ppo" clipped against the stored
behaviour logprobs (RePO, arXiv 2506.09340). Each loss sees the whole batch with
the other cycle's rows masked out, so batch-level statistics (M2PO's second
moment) are taken over that cycle's tokens only, and since every loss is 0
behind its mask the two per-token losses simply add.

The result has the registered-loss signature plus ``replay_b``; its metrics are
the combined ones a learner reads (token-weighted means, max / min, sums) plus
every per-cycle metric prefixed ``fresh_pg_`` / ``replay_pg_`` ("pg": the policy
loss's own statistics, e.g. the ratio it clipped; the importance ratios against
the behaviour policy are ``algorithms.importance``'s, named ``fresh_ratio_*``).
The learner step (``learner.cycles``) calls it with a per-row ``old_logp_bt``
already chosen per cycle (the proximal policy or the stored behaviour logprobs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxflash.algorithms.policy_loss import get_policy_loss

CycleLossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
_MEAN_KEYS = ("ratio_mean", "clip_frac", "clip_frac_low", "clip_frac_high", "masked_frac")


def make_cycle_loss(
    fresh: str,
    replay: str,
    *,
    fresh_kwargs: Mapping[str, Any] | None = None,
    replay_kwargs: Mapping[str, Any] | None = None,
) -> CycleLossFn:
    """Build ``loss(logp_bt, old_logp_bt, adv_bt, mask_bt, *, replay_b, behaviour_logp_bt)``.

    Args:
      fresh, replay: ``POLICY_LOSSES`` names for the fresh and the replay cycle.
      fresh_kwargs, replay_kwargs: their hyper-parameters.

    Returns:
      A function taking the registered-loss arguments (float32 [B, T]) plus
      ``replay_b`` ([B], nonzero for replayed rows) and returning (loss_bt,
      metrics): loss_bt = fresh loss on fresh rows + replay loss on replayed rows;
      metrics as the registered losses' plus ``{fresh,replay}_pg_<name>`` per cycle.

    Raises:
      ValueError: unknown loss names (from ``get_policy_loss``).
    """
    fresh_fn = get_policy_loss(fresh, **dict(fresh_kwargs or {}))
    replay_fn = get_policy_loss(replay, **dict(replay_kwargs or {}))

    def loss(logp_bt, old_logp_bt, adv_bt, mask_bt, *, replay_b, behaviour_logp_bt=None):
        mask_bt = jnp.asarray(mask_bt)
        replay_b = jnp.asarray(replay_b)
        if replay_b.shape != mask_bt.shape[:1]:
            raise ValueError(f"replay_b shape {replay_b.shape} must be [B] = {mask_bt.shape[:1]}")
        is_replay = (replay_b != 0)[:, None]
        parts = {}
        total = jnp.zeros(mask_bt.shape, jnp.float32)
        for name, fn, rows in (("fresh", fresh_fn, ~is_replay), ("replay", replay_fn, is_replay)):
            m_bt = jnp.where(rows, mask_bt, 0.0)
            l_bt, metrics = fn(
                logp_bt, old_logp_bt, adv_bt, m_bt, behaviour_logp_bt=behaviour_logp_bt
            )
            total = total + l_bt
            parts[name] = metrics
        f, r = parts["fresh"], parts["replay"]
        n = f["num_tokens"] + r["num_tokens"]
        combined = {
            "num_tokens": n,
            "nonfinite_count": f["nonfinite_count"] + r["nonfinite_count"],
            "ratio_max": jnp.maximum(
                jnp.where(f["num_tokens"] > 0, f["ratio_max"], -jnp.inf),
                jnp.where(r["num_tokens"] > 0, r["ratio_max"], -jnp.inf),
            ),
            "ratio_min": jnp.minimum(
                jnp.where(f["num_tokens"] > 0, f["ratio_min"], jnp.inf),
                jnp.where(r["num_tokens"] > 0, r["ratio_min"], jnp.inf),
            ),
        }
        combined["ratio_max"] = jnp.where(n > 0, combined["ratio_max"], 0.0)
        combined["ratio_min"] = jnp.where(n > 0, combined["ratio_min"], 0.0)
        for k in _MEAN_KEYS:
            weighted = f.get(k, 0.0) * f["num_tokens"] + r.get(k, 0.0) * r["num_tokens"]
            combined[k] = weighted / jnp.maximum(n, 1.0)
        for name, m in parts.items():
            combined.update({f"{name}_pg_{k}": v for k, v in m.items()})
        return total, combined

    return loss
