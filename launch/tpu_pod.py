"""jaxflash entry point: parse the experiment config, set up devices, run.

    python launch/tpu_pod.py --config configs/rlvr_smollm2_arith.py --workdir runs/arith \
        [--config.learner.lr=1e-6 ...]

On CPU the fake device count comes from `config.mesh.num_cpu_devices`, set here
before jax is imported. On a multi-host TPU/GPU slice (JAX_COORDINATOR_ADDRESS or
a TPU pod environment), `jax.distributed.initialize()` runs first. Restarting with
the same --workdir resumes from the last complete checkpoint (a finished run
says so and exits). A bad override or setting exits with status 2 and one line
naming the field (``launch/overrides.py``); long phases print a progress line
after ``--progress_every_s`` seconds of silence. One loop,
`runtime.rlvr.run`, serves both placements: `mesh.colocated=True` (one generation
server on the learner's devices, async_ratio 0: the synchronous baseline) and
disjoint slices (`--config.mesh.colocated=False`, e.g. `configs/smoke_async.py`).
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # configs/ import each other as a package
    sys.path.insert(0, REPO_ROOT)

import logging as pylogging  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch.overrides import parse_flags  # noqa: E402
from launch.quiet import native_stderr_hidden  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics, checkpoints).")
_PROGRESS = flags.DEFINE_float(
    "progress_every_s", 5.0, "Seconds of console silence after which a long phase prints progress."
)
flags.mark_flags_as_required(["config", "workdir"])


def _set_cpu_device_count(n: int) -> None:
    """Fakes n CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("jax was imported before the CPU device count could be set")
    flag = f"--xla_force_host_platform_device_count={n}"
    existing = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in existing:
        os.environ["XLA_FLAGS"] = f"{existing} {flag}".strip()


def _maybe_init_distributed() -> None:
    import jax

    multi_host = "JAX_COORDINATOR_ADDRESS" in os.environ or os.environ.get(
        "TPU_WORKER_HOSTNAMES", ""
    ).count(",")
    if multi_host:
        jax.distributed.initialize()


def main(argv: list[str]) -> None:
    del argv
    config = _CONFIG.value
    # Orbax and JetStream log every save/step through absl at INFO: keep the console
    # to our lines (pass --verbosity=0 to see them again).
    verbose = flags.FLAGS["verbosity"].present
    if not verbose:
        logging.set_verbosity(logging.WARNING)
        # Our own warnings (a skipped step, prompts too long, a resume) as plain lines,
        # without absl's "W1130 17:10:51.760078 139719803816832 rlvr.py:136]" prefix.
        ours = pylogging.getLogger("jaxflash")
        handler = pylogging.StreamHandler(sys.stderr)
        handler.setFormatter(pylogging.Formatter("%(levelname)s: %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(pylogging.WARNING)
        ours.propagate = False
    # JetStream imports TensorFlow (through seqio) only for tokenizer utilities we do
    # not use; keep its C++ start-up chatter off the console.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    _set_cpu_device_count(int(config.mesh.num_cpu_devices))
    from jaxflash.runtime.console import Console
    from jaxflash.runtime.specs import ConfigError

    console = Console(sys.stdout, every_s=_PROGRESS.value)
    try:
        announce = "starting: importing JAX, JetStream and the verifiers ..."
        with console.phase("starting", announce=announce):
            _maybe_init_distributed()
            # Library code never sees the ConfigDict: it becomes validated dataclasses here.
            from jaxflash.runtime.experiment import ExperimentConfig

            exp = ExperimentConfig.from_config_dict(config)
            # TensorFlow writes its start-up lines (oneDNN, "no CUDA drivers") to fd 2
            # before any log level applies: hidden, unless --verbosity was given.
            with native_stderr_hidden(not verbose):
                from jaxflash.runtime.rlvr import run
        run(exp, workdir=_WORKDIR.value, console=console)
    except ConfigError as err:  # a bad or silently-ignored setting: one line, naming fields
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: run the same command again to resume {_WORKDIR.value} from its "
            "last complete checkpoint",
            file=sys.stderr,
        )
        sys.exit(130)
    finally:
        console.close()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
