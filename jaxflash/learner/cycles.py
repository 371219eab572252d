"""The policy-loss term of the learner step, per row's replay cycle, and per-cycle ratio stats.

ReFlow (arXiv 2610.21640) trains each learner batch on a fresh cycle (samples
from the generation servers) and a replay cycle (samples drawn again from a
buffer). ``TrainBatch.cycle_bt`` labels each row (0 fresh, 1 replayed). With
``LearnerConfig.replay_loss`` set, one jitted step applies ``learner.loss`` to
the fresh rows and ``replay_loss`` to the replayed rows (``algorithms.cycle_loss``:
each loss sees its rows only, the per-token losses add). The choice is made with
masks inside the jitted function, so a batch with any mix of fresh and replayed
rows runs the same compiled step: no Python branch per batch.

pi_old per cycle: each cycle's ``ratio_against`` picks, per row, the proximal
policy (the params the update starts from, ``stop_gradient(log pi)``; AReaL's
decoupled PPO, arXiv 2505.24298, and TIS weight it by pi_prox / mu) or the
stored behaviour logprobs mu (PPO clipped against mu as in RePO, arXiv
2506.09340; CISPO, arXiv 2506.13585; M2PO, arXiv 2510.01161). mu is always the
batch's ``behaviour_logp_bt``: for a replayed row, the logprobs stored with the
trajectory when it was generated, so its importance ratio is taken against the
policy that sampled it.

Importance-ratio statistics per cycle (w = pi_theta / mu under the params the
update starts from, ``algorithms.importance``) come from the step's own forward
pass: sums over each micro-batch (``importance_sums``), combined across
micro-batches by the step (sum, max, min, log-add-exp for the ``_lse`` keys) and
turned into the documented metrics by ``importance_metrics``. No extra forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from jaxflash.algorithms.cycle_loss import make_cycle_loss
from jaxflash.algorithms.importance import per_sample_ratio_stats
from jaxflash.algorithms.policy_loss import get_policy_loss
from jaxflash.learner.config import LearnerConfig

CYCLES = ("fresh", "replay")
# The per-cycle metrics importance_metrics makes (dropped for a cycle without tokens).
RATIO_METRICS = ("ratio_mean", "ratio_max", "ratio_min", "ess_token", "ess_seq")
# Per-cycle loss metrics that add up across micro-batches (the others are token means).
_SUMMED = ("num_tokens", "nonfinite_count", "m2_masked")
PolicyTerm = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def _old(ratio_against: str, logp_bt: jax.Array, mu_bt: jax.Array) -> jax.Array:
    return jax.lax.stop_gradient(logp_bt) if ratio_against == "proximal" else mu_bt


def make_policy_term(lc: LearnerConfig) -> PolicyTerm:
    """``term(logp_bt, mu_bt, adv_bt, mask_bt, cycle_bt) -> (pg_bt, metrics)``.

    Args (of the returned function; float32 [b, T] unless noted):
      logp_bt: log pi_theta of the targets (differentiated).
      mu_bt: the batch's behaviour logprobs (stored ones for replayed rows).
      adv_bt, mask_bt: advantages and loss mask.
      cycle_bt: int32 [b, T], 0 fresh / 1 replayed, constant along a row (may be
        None without ``lc.replay_loss``; required with it).

    Returns:
      pg_bt: the per-token policy loss (0 behind the mask); metrics: the loss's
      float32 scalars (ratio_mean, clip_frac, ..., num_tokens); with
      ``lc.replay_loss`` also each cycle's own, ``{fresh,replay}_pg_<name>``.
      Without ``lc.replay_loss`` ``cycle_bt`` is not read: one loss, as before.
    """
    if not lc.dual_cycle:
        loss = get_policy_loss(lc.loss, **dict(lc.loss_kwargs))

        def single(logp_bt, mu_bt, adv_bt, mask_bt, cycle_bt):
            old_bt = _old(lc.ratio_against, logp_bt, mu_bt)
            # Against mu itself the behaviour weight is 1: pass mu only with a proximal pi_old.
            behaviour = mu_bt if lc.ratio_against == "proximal" else None
            return loss(logp_bt, old_bt, adv_bt, mask_bt, behaviour_logp_bt=behaviour)

        return single

    loss = make_cycle_loss(
        lc.loss,
        lc.replay_loss,
        fresh_kwargs=lc.loss_kwargs,
        replay_kwargs=lc.replay_loss_kwargs,
    )

    def dual(logp_bt, mu_bt, adv_bt, mask_bt, cycle_bt):
        if cycle_bt is None:
            raise ValueError("a learner with replay_loss needs the batch's cycle_bt")
        replay_bt = cycle_bt != 0
        old_bt = jnp.where(
            replay_bt,
            _old(lc.replay_ratio_against, logp_bt, mu_bt),
            _old(lc.ratio_against, logp_bt, mu_bt),
        )
        # behaviour = mu for every row: where pi_old is mu this equals passing None.
        return loss(
            logp_bt,
            old_bt,
            adv_bt,
            mask_bt,
            replay_b=jnp.max(cycle_bt, axis=-1),
            behaviour_logp_bt=mu_bt,
        )

    return dual


def loss_aux(metrics: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The per-cycle loss metrics as micro-batch-summable entries (``{c}_pg_*``).

    Token means become token-weighted sums (``_wsum``), max / min stay (an empty
    cycle gives -inf / +inf, neutral for the step's max / min), counts stay sums.
    """
    out: dict[str, jax.Array] = {}
    for c in CYCLES:
        n = metrics[f"{c}_pg_num_tokens"]
        for key, v in metrics.items():
            if not key.startswith(f"{c}_pg_"):
                continue
            name = key.removeprefix(f"{c}_pg_")
            if name.endswith("_max"):
                out[key] = jnp.where(n > 0, v, -jnp.inf)
            elif name.endswith("_min"):
                out[key] = jnp.where(n > 0, v, jnp.inf)
            elif name in _SUMMED:
                out[key] = v
            else:
                out[f"{key}_wsum"] = v * n
    return out


def loss_metrics(aux: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """``loss_aux`` entries combined over micro-batches -> ``{c}_pg_*`` metrics."""
    out: dict[str, jax.Array] = {}
    for c in CYCLES:
        n = aux[f"{c}_pg_num_tokens"]
        for key, v in aux.items():
            if not key.startswith(f"{c}_pg_"):
                continue
            if key.endswith("_wsum"):
                out[key.removesuffix("_wsum")] = v / jnp.maximum(n, 1.0)
            elif key.endswith(("_max", "_min")):
                out[key] = jnp.where(n > 0, v, 0.0)
            else:
                out[key] = v
    return out


def importance_sums(
    logp_bt: jax.Array, mu_bt: jax.Array, mask_bt: jax.Array, cycle_bt: jax.Array
) -> dict[str, jax.Array]:
    """Per-cycle sufficient statistics of w = pi_theta / mu over one micro-batch.

    Args:
      logp_bt: float32 [b, T] log pi_theta (not differentiated through).
      mu_bt: float32 [b, T] behaviour logprobs (stored ones for replayed rows).
      mask_bt: float32 [b, T], > 0 on tokens with loss.
      cycle_bt: int32 [b, T] row labels.

    Returns:
      float32 scalars per cycle c: ``{c}_is_tokens``, ``{c}_is_rows`` (rows with
      tokens), ``{c}_is_w`` (sum w), ``{c}_is_w2`` (sum w^2), ``{c}_is_w_max``,
      ``{c}_is_w_min``, ``{c}_is_seq_lse`` / ``{c}_is_seq2_lse`` (log sum over rows
      of W_b and W_b^2, W_b = prod_t w_bt: Kish's sequence ESS in log space).
      Combine micro-batches by sum / max / min / logaddexp (the key's suffix).
    """
    s = per_sample_ratio_stats(jax.lax.stop_gradient(logp_bt) - mu_bt, mask_bt)
    cycle_b = jnp.max(cycle_bt, axis=-1)
    out: dict[str, jax.Array] = {}
    for label, c in enumerate(CYCLES):
        rows = (cycle_b == label) & (s["tokens"] > 0)
        seq = jnp.where(rows, s["seq_log_w"], -jnp.inf)
        out.update(
            {
                f"{c}_is_tokens": jnp.sum(jnp.where(rows, s["tokens"], 0.0)),
                f"{c}_is_rows": jnp.sum(rows).astype(jnp.float32),
                f"{c}_is_w": jnp.sum(jnp.where(rows, s["sum_w"], 0.0)),
                f"{c}_is_w2": jnp.sum(jnp.where(rows, s["sum_w2"], 0.0)),
                f"{c}_is_w_max": jnp.max(jnp.where(rows, s["max_w"], -jnp.inf)),
                f"{c}_is_w_min": jnp.min(jnp.where(rows, s["min_w"], jnp.inf)),
                f"{c}_is_seq_lse": _logsumexp(seq),
                f"{c}_is_seq2_lse": _logsumexp(2.0 * seq),
            }
        )
    return out


def _logsumexp(x: jax.Array) -> jax.Array:
    """log sum exp over all entries; -inf (not NaN) when every entry is -inf."""
    m = jnp.max(x)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return safe + jnp.log(jnp.sum(jnp.exp(x - safe)))


def importance_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The combined ``importance_sums`` -> the documented per-cycle metrics.

    Returns (float32 scalars, c in fresh / replay): ``{c}_ratio_mean`` (token mean
    of w), ``{c}_ratio_max``, ``{c}_ratio_min``, ``{c}_ess_token`` = (sum w)^2 /
    (N sum w^2), ``{c}_ess_seq`` = (sum W)^2 / (R sum W^2), ``{c}_ratio_tokens`` (N),
    ``{c}_sequences`` (R). A cycle with no tokens gives 0 for the statistics
    (``drop_empty_cycles`` removes them on the host). As
    ``importance.ratio_metrics_by_cycle``.
    """
    out: dict[str, jax.Array] = {}
    for c in CYCLES:
        n, rows = sums[f"{c}_is_tokens"], sums[f"{c}_is_rows"]
        w, w2 = sums[f"{c}_is_w"], sums[f"{c}_is_w2"]
        some = n > 0
        log_ess_seq = (
            2.0 * sums[f"{c}_is_seq_lse"] - sums[f"{c}_is_seq2_lse"] - jnp.log(jnp.maximum(rows, 1))
        )
        out.update(
            {
                f"{c}_ratio_mean": w / jnp.maximum(n, 1.0),
                f"{c}_ratio_max": jnp.where(some, sums[f"{c}_is_w_max"], 0.0),
                f"{c}_ratio_min": jnp.where(some, sums[f"{c}_is_w_min"], 0.0),
                f"{c}_ess_token": jnp.where(some, w * w / jnp.maximum(n * w2, 1e-30), 0.0),
                f"{c}_ess_seq": jnp.where(some, jnp.exp(jnp.where(some, log_ess_seq, 0.0)), 0.0),
                f"{c}_ratio_tokens": n,
                f"{c}_sequences": rows,
            }
        )
    return out


def drop_empty_cycles(metrics: dict[str, float]) -> dict[str, float]:
    """Host side: remove a cycle's ratio statistics when it had no tokens this step
    (its token and row counts stay), so no 0 reads as a measured ratio."""
    out = dict(metrics)
    for c in CYCLES:
        if out.get(f"{c}_ratio_tokens", 1.0) == 0:
            for name in RATIO_METRICS:
                out.pop(f"{c}_{name}", None)
    return out
