"""The servers' per-step metrics (``runtime.rollout.server_metrics``): differences of
cumulative counters, and a paged pool's usage and page counters."""

from jaxflash.runtime.rollout.server_metrics import server_metrics


def test_server_metrics_are_per_step_differences():
    before = [
        {
            "version": 1,
            "live_slot_steps": 10,
            "slot_steps": 20,
            "busy_s": 1.0,
            "idle_s": 1.0,
            "generated_tokens": 100,
        },
        {
            "version": 1,
            "live_slot_steps": 0,
            "slot_steps": 0,
            "busy_s": 0.0,
            "idle_s": 0.0,
            "generated_tokens": 0,
        },
    ]
    now = [
        {
            "version": 2,
            "live_slot_steps": 40,
            "slot_steps": 60,
            "busy_s": 3.0,
            "idle_s": 1.0,
            "generated_tokens": 300,
        },
        {},  # dead
    ]
    m = server_metrics(before, now, version=3)
    assert m["gen0_occupancy"] == 0.75 and m["gen0_version_lag"] == 1
    assert "gen1_occupancy" not in m and m["gen_version_lag_max"] == 1
    assert m["gen_tokens"] == 200 and m["gen_tokens_per_s"] == 100.0
    assert m["gen_idle_frac"] == 0.0 and m["gen_slot_occupancy"] == 0.75


def test_server_metrics_carry_a_paged_pool_and_its_counters_per_step():
    def paged(in_use, peak, preempted, waits, shared, copied, total=100):
        return dict(
            version=1, live_slot_steps=0, slot_steps=0, busy_s=0.0, idle_s=0.0,
            generated_tokens=0, kv_pages_in_use=in_use, kv_pages_peak=peak,
            kv_pages_total=total, preempted=preempted, page_waits=waits,
            shared_pages=shared, copied_pages=copied,
        )  # fmt: skip

    before = [paged(10, 30, 1, 2, 5, 0), paged(0, 0, 0, 0, 0, 0, total=300)]
    now = [paged(50, 80, 4, 2, 9, 1), paged(30, 60, 0, 1, 0, 0, total=300)]
    m = server_metrics(before, now, version=1)
    assert m["gen_kv_pages_in_use"] == 80 and m["gen_kv_cache_usage"] == 80 / 400
    assert m["gen_kv_cache_usage_peak"] == 0.8  # server 0: 80 of its 100 pages at once
    assert m["gen_preemptions"] == 3 and m["gen_kv_page_waits"] == 1
    assert m["gen_prefix_cache_hit_pages"] == 4 and m["gen_prefix_cache_copied_pages"] == 1
    # A dense engine reports no pool: no page metrics.
    dense = {k: v for k, v in now[0].items() if "pages" not in k}
    assert not any("kv" in k or "prefix" in k for k in server_metrics([], [dense], 1))
