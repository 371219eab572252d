"""Child of test_distributed.py: one process of a jax.distributed learner (or the
single-process reference), training the tiny Llama for two steps on a 4-device
(fsdp=2, tensor=2) mesh. Prints one JSON line with the losses and a checksum of
the resulting params (gathered across processes).

    JAX_COORDINATOR_ADDRESS=127.0.0.1:P JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \
        python tests/distributed_child.py
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxflash.sharding.distributed import initialize_from_env  # noqa: E402

plan = initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxflash.learner.batching import pack_batch  # noqa: E402
from jaxflash.learner.config import LearnerConfig  # noqa: E402
from jaxflash.learner.state import create_train_state  # noqa: E402
from jaxflash.learner.step import make_train_step  # noqa: E402
from jaxflash.models.config.presets import get_preset  # noqa: E402
from jaxflash.sharding.mesh import make_mesh  # noqa: E402
from jaxflash.sharding.rules import LEARNER_RULES  # noqa: E402
from jaxflash.types import FinishReason, Sample  # noqa: E402


def _samples(rng: np.random.Generator) -> list[Sample]:
    out = []
    for i in range(8):
        n = int(rng.integers(4, 12))
        out.append(
            Sample(
                prompt_id=i, sample_index=0,
                prompt_tokens=rng.integers(1, 500, 6).astype(np.int32),
                response_tokens=rng.integers(1, 500, n).astype(np.int32),
                behaviour_logprobs=np.full(n, -6.0, np.float32),
                token_versions=np.zeros(n, np.int32),
                start_version=0, finish_reason=FinishReason.EOS,
            )
        )  # fmt: skip
    return out


def main() -> None:
    model = get_preset("tiny")
    learner = LearnerConfig(lr=1e-2, micro_batch_size=4)
    mesh = make_mesh(jax.devices(), {"fsdp": 2, "tensor": 2})
    state = create_train_state(model, learner, mesh, LEARNER_RULES, seed=0)
    step = make_train_step(model, learner, mesh, LEARNER_RULES)
    rng = np.random.default_rng(0)  # the same batches on every process
    losses = []
    for _ in range(2):
        samples = _samples(rng)
        batch = pack_batch(samples, rng.standard_normal(len(samples)), length_multiple=32)
        state, metrics = step(state, batch)
        losses.append(float(np.asarray(jax.device_get(metrics["loss"].addressable_data(0)))))
    leaves = [
        multihost_utils.process_allgather(x, tiled=True) for x in jax.tree.leaves(state.params)
    ]
    print(json.dumps({
        "plan": plan.kind.value, "process_index": jax.process_index(),
        "process_count": jax.process_count(), "devices": jax.device_count(),
        "local_devices": jax.local_device_count(), "losses": losses,
        "param_sums": [float(np.asarray(x, np.float64).sum()) for x in leaves],
        "step": int(np.asarray(jax.device_get(state.step.addressable_data(0)))),
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
