"""Async smoke run: the smoke model on disjoint slices, learner 6 + 2 x 1 generation, α = 2.

    python launch/tpu_pod.py --config configs/smoke_async.py --workdir runs/smoke_async

About a minute on 2 CPU cores. Same code path as every job
(`runtime.loop`): two generation servers on their own fake CPU device
each, queue scheduling, weights published while generation continues, and a
staleness bound of 2 policy versions.
"""

import ml_collections

from configs import smoke


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = smoke.get_config(arg)
    c.total_steps = 4
    c.mesh.num_cpu_devices = 8
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 3, "tensor": 2})  # 6 devices
    c.mesh.generation = ml_collections.ConfigDict({"tensor": 1})  # one device per slice
    c.mesh.num_generation_slices = 2
    c.mesh.colocated = False
    c.rollout.async_ratio = 2
    c.eval.every = 4
    return c
