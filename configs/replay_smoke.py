"""Replay smoke run: the smoke model with ReFlow's dual replay cycle (rho = 0.5).

    python launch/tpu_pod.py --config configs/replay_smoke.py --workdir runs/replay_smoke

Under a minute on 2 CPU cores (tiny random model, colocated, alpha = 0). Each
learner batch holds 4 groups' worth of rows: 2 fresh groups from the generation
server and 4 samples replayed from the buffer (uniform, age <= 2 versions, each
replayed at most twice). metrics.jsonl gets the replay cycle's metrics (fresh vs
replayed counts, age and reuse histograms, importance ratios and ESS per cycle)
and the fixed schedule's decisions (``ctl_*``). Add
``--config.controller.kind=adaptive --config.controller.replay_schedule=''`` for
the adaptive controller.
"""

import ml_collections

from configs import smoke


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = smoke.get_config()
    c.total_steps = 4
    c.data.eval_size = 0
    c.replay.ratio = 0.5
    c.replay.max_age = 2
    c.replay.max_reuse = 2
    # Random-model rewards are often equal within a group of 2: keep those groups
    # too, so the tiny buffer has something to replay from step 2 on.
    c.replay.drop_uniform_groups = False
    c.controller.kind = "fixed"
    c.controller.replay_schedule = "0:0.5"
    return c
