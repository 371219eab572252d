"""The metrics reference is the one definition: docs/METRICS.md is generated from it."""

from __future__ import annotations

import os

from jaxflash.metrics import reference
from jaxflash.runtime.rollout.rows import ROLLOUT_FIELDS
from tests.paths import REPO

DOC = os.path.join(REPO, "docs", "METRICS.md")


def test_docs_metrics_md_is_generated_from_the_reference():
    with open(DOC, encoding="utf-8") as f:
        assert f.read() == reference.render_markdown(), (
            "docs/METRICS.md is stale: python -m jaxflash.metrics.reference --write docs/METRICS.md"
        )
    assert reference.main(["--check", DOC]) == 0


def test_rollout_fields_are_documented_in_the_order_rows_are_written():
    documented = [
        name
        for names, _ in reference.ROLLOUT_FIELDS
        for name in sorted(
            reference.documented_names([(names,)]), key=lambda n: names.index(f"`{n}`")
        )
    ]
    assert documented == list(ROLLOUT_FIELDS)


def test_undocumented_maps_families_and_catches_a_new_key():
    rows = [
        {"step": 1, "reward_mean": 0.5, "gen3_occupancy": 0.2, "samples_dropped_stale": 1},
        {"fresh_pg_clip_frac": 0.1, "steps_skipped_all_failed": 2},
    ]
    assert reference.undocumented(rows) == set()
    assert reference.undocumented([{"reward_mean": 0.5, "my_new_metric": 1}]) == {"my_new_metric"}
    assert reference.canonical_name("gen12_version_lag") == "gen{i}_version_lag"
