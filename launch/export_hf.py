"""Export a run's latest checkpoint as a Hugging Face directory (safetensors + config.json
+ tokenizer), readable by transformers and by ``--config.model.source=hf``.

    python launch/export_hf.py --config configs/rlvr_smollm2_arith.py \
        --workdir runs/rlvr_smollm2_arith --out exported/smollm2_rl

Use the same --config (and overrides) as the run: it names the model and learner
layout the checkpoint was saved with.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from launch.quiet import native_stderr_hidden, quiet_env, quiet_python_logs  # noqa: E402

quiet_env()  # before TensorFlow / JAX / Orbax are imported

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config of the run.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_OUT = flags.DEFINE_string("out", None, "Output directory for the HF checkpoint.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Show library INFO logs.")
flags.mark_flags_as_required(["config", "workdir", "out"])


def main(argv: list[str]) -> None:
    del argv
    if not _VERBOSE.value:
        quiet_python_logs()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    with native_stderr_hidden(not _VERBOSE.value):
        import jax

        from jaxflash.checkpoint.checkpointer import Checkpointer
        from jaxflash.learner.state import abstract_train_state
        from jaxflash.models.formats.weights_hf import save_hf
        from jaxflash.runtime.config.experiment import ExperimentConfig
        from jaxflash.runtime.model_setup import load_model, load_tokenizer
        from jaxflash.sharding.mesh import make_mesh
        from jaxflash.sharding.rules import LEARNER_RULES

        jax.devices()  # backend probing logs here

    exp = ExperimentConfig.from_config_dict(_CONFIG.value)
    tokenizer = load_tokenizer(exp.model)
    model_config, _ = load_model(exp.model, exp.rollout, tokenizer)
    mesh = make_mesh(jax.devices()[:1], {})
    abstract = abstract_train_state(model_config, exp.learner, mesh, LEARNER_RULES)
    ckpt_dir = os.path.join(_WORKDIR.value, "checkpoints")
    with Checkpointer(ckpt_dir) as checkpointer:
        restored = checkpointer.restore_latest(abstract)
    if restored is None:
        raise SystemExit(f"no complete checkpoint under {ckpt_dir}")
    state, meta = restored
    save_hf(_OUT.value, model_config, jax.device_get(state.params), tokenizer)
    print(f"exported step {meta.step} of {_WORKDIR.value} to {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
