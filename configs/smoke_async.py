"""Async smoke run: the smoke model on disjoint slices, learner 6 + 2 x 1 generation, α = 2.

    python launch/tpu_pod.py --config configs/smoke_async.py --workdir runs/smoke_async

The variant ``async`` of ``configs/smoke.py`` (``--config configs/smoke.py:async``).
About a minute on 2 CPU cores. Same code path as every job
(`runtime.loop`): two generation servers on their own fake CPU device
each, queue scheduling, weights published while generation continues, and a
staleness bound of 2 policy versions.
"""

import ml_collections

from configs import smoke


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg  # one variant: this file names it
    return smoke.get_config("async")
