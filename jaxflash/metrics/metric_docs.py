"""What each per-step metric means: the one table of their meanings, by section.

``jaxflash.metrics.reference`` checks runs against it and renders docs/METRICS.md from
it (``python -m jaxflash.metrics.reference --write docs/METRICS.md``). A metric's name
is written in backticks; per-server or per-reason families use the placeholders of
``reference.PLACEHOLDERS`` (``gen{i}_occupancy``, ``samples_dropped_<reason>``).

The rows are written in one module per group of row sections (``metrics.tracker.SECTIONS``);
edit the module that holds the metric's section:

- ``batch_metric_docs``: ``batch``, ``learner`` (and the sampling consistency)
- ``rollout_metric_docs``: ``staleness``, ``generation``, ``time``, ``version``,
  ``rollout``, ``outcomes``
- ``episode_metric_docs``: evaluation, ``episodes`` (agent sessions, environment calls)
- ``control_metric_docs``: ``replay``, ``control``, ``elastic``

The rollouts.jsonl fields are ``rollout_field_docs``.
"""

from __future__ import annotations

from jaxflash.metrics.batch_metric_docs import BATCH_METRICS
from jaxflash.metrics.control_metric_docs import CONTROL_METRICS
from jaxflash.metrics.episode_metric_docs import EPISODE_METRICS
from jaxflash.metrics.rollout_metric_docs import ROLLOUT_METRICS

__all__ = ["METRICS"]

METRICS: tuple[tuple[str, str], ...] = (
    *BATCH_METRICS,
    *ROLLOUT_METRICS,
    *EPISODE_METRICS,
    *CONTROL_METRICS,
)
"""(names, meaning) rows of metrics.jsonl, one per concept, in the order a reader needs them."""
