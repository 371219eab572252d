"""Elastic smoke run: devices change role live, learner 6 -> 7 -> 6 devices.

    python launch/tpu_pod.py --config configs/elastic_smoke.py --workdir runs/elastic_smoke

A few minutes on 2 CPU cores (tiny random model, alpha = 1). The learner starts on
devices 0-5 (fsdp 6: every learner size forms a mesh), generation slices [6] and [7].
A fixed schedule moves devices at step boundaries (``runtime.control.elastic``): after step 2
the learner takes slice [6] (its server stops, its requests are re-queued on [7]; the
state is resharded device to device onto 7 devices), after step 4 it gives [6] back (a
new server there gets the current weights first). metrics.jsonl shows
``learner_devices``, ``generation_slices`` and ``elastic_*`` per step. For the adaptive
controller instead: ``--config.controller.kind=adaptive
--config.controller.device_schedule=''``.
"""

import ml_collections

from configs import smoke


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = smoke.get_config("async")
    c.total_steps = 6
    c.data.eval_size = 0
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 6, "tensor": 1})  # devices 0-5
    c.rollout.async_ratio = 1
    c.controller.kind = "fixed"
    c.controller.elastic = True
    c.controller.device_schedule = "0:6,2:7,4:6"
    return c
