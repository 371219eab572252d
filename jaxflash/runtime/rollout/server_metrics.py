"""Generation servers' per-step metrics, from their cumulative ``stats()``.

Each server (``GenerationServer``, a generation program's ``RemoteGenerationServer``, a
simulated one) reports counters that only grow over its life (``CUMULATIVE_STATS``) and
a few gauges; ``server_metrics`` turns the stats at a step's two ends into the step's
``gen*`` metrics (docs/METRICS.md): occupancy, version lag, idle share, tokens and,
for a paged KV cache, the pool's usage and the slot loop's page counters
(``generation.slot_types.SlotStats``). Host-side, thread-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PAGE_COUNTERS = ("preempted", "page_waits", "shared_pages", "copied_pages")
"""A paged engine's cumulative counters in ``GenerationServer.stats`` (``SlotStats``)."""
CUMULATIVE_STATS = (
    "live_slot_steps", "slot_steps", "busy_s", "idle_s", "generated_tokens", *PAGE_COUNTERS,
)  # fmt: skip
"""Server stats that only grow over a server's life: ``server_metrics`` differences them
per step (``RemoteGenerationServer`` carries them over a program's restarts)."""
_PAGE_NAMES = {
    "preempted": "gen_preemptions",
    "page_waits": "gen_kv_page_waits",
    "shared_pages": "gen_prefix_cache_hit_pages",
    "copied_pages": "gen_prefix_cache_copied_pages",
}


def server_metrics(
    before: Sequence[dict[str, Any]], now: Sequence[dict[str, Any]], version: int
) -> dict[str, Any]:
    """Generation over one step, from each server's cumulative ``stats()`` at its ends.

    Returns:
      gen{i}_occupancy (fraction of server i's decode slots live during its decode
      steps this step), gen{i}_version_lag (learner version - the version server i
      generated with), gen_slot_occupancy (the same over all servers),
      gen_idle_frac (server idle time / (busy + idle) this step), gen_tokens
      (tokens generated this step, including ones later dropped) and
      gen_tokens_per_s (gen_tokens / busy seconds). With a paged KV cache (servers
      reporting ``kv_pages_total``) also the page metrics of ``_page_metrics``. Dead
      and retired servers are left out; a server added during the step (elastic
      pool) counts from 0.
    """
    out: dict[str, Any] = {}
    live = slots = busy = idle = tokens = 0.0
    lags = []
    pages = dict.fromkeys(PAGE_COUNTERS, 0.0)
    if len(before) > len(now):
        raise ValueError(f"server_metrics: {len(before)} servers before, {len(now)} now")
    for i, n in enumerate(now):
        b = before[i] if i < len(before) else {}
        if not n:
            continue
        d = {k: float(n.get(k, 0)) - float(b.get(k, 0)) for k in CUMULATIVE_STATS}
        out[f"gen{i}_occupancy"] = (
            d["live_slot_steps"] / d["slot_steps"] if d["slot_steps"] else 0.0
        )
        out[f"gen{i}_version_lag"] = int(version - n["version"])
        lags.append(out[f"gen{i}_version_lag"])
        live, slots = live + d["live_slot_steps"], slots + d["slot_steps"]
        busy, idle, tokens = busy + d["busy_s"], idle + d["idle_s"], tokens + d["generated_tokens"]
        for key in PAGE_COUNTERS:
            pages[key] += d[key]
    out["gen_slot_occupancy"] = live / slots if slots else 0.0
    out["gen_idle_frac"] = idle / (busy + idle) if busy + idle > 0 else 0.0
    out["gen_version_lag_max"] = max(lags) if lags else 0
    out["gen_tokens"] = int(tokens)
    out["gen_tokens_per_s"] = tokens / busy if busy > 0 else 0.0
    out.update(_page_metrics([n for n in now if n and "kv_pages_total" in n], pages))
    return out


def _page_metrics(paged: Sequence[dict[str, Any]], counts: dict[str, float]) -> dict[str, Any]:
    """The paged KV cache over the servers ``paged`` (their stats at the step's end):
    gen_kv_pages_in_use (pages mapped, all servers), gen_kv_cache_usage (their share
    of the servers' pools), gen_kv_cache_usage_peak (the largest share one server had
    in use at once since it started), and this step's ``counts`` of ``PAGE_COUNTERS``
    as gen_preemptions, gen_kv_page_waits, gen_prefix_cache_hit_pages and
    gen_prefix_cache_copied_pages. Empty when no server is paged."""
    if not paged:
        return {}
    in_use = sum(int(n["kv_pages_in_use"]) for n in paged)
    total = sum(int(n["kv_pages_total"]) for n in paged)
    out: dict[str, Any] = {
        "gen_kv_pages_in_use": in_use,
        "gen_kv_cache_usage": in_use / total,
        "gen_kv_cache_usage_peak": max(
            int(n["kv_pages_peak"]) / int(n["kv_pages_total"]) for n in paged
        ),
    }
    out.update({name: int(counts[key]) for key, name in _PAGE_NAMES.items()})
    return out
