"""jaxflash entry point: parse the experiment config, set up devices, run.

    python launch/tpu_pod.py --config configs/rlvr_smollm2_arith.py --workdir runs/arith \
        [--config.learner.lr=1e-6 ...]
    python launch/tpu_pod.py --config ... --dry_run      # per-device memory plan, then exit
    python launch/tpu_pod.py --config ... --dry_run --topology v5e-16   # for a TPU slice
    JAXFLASH_ROLE=generation python launch/tpu_pod.py --config ... --port 8500

The same command runs on every host of a program (``docs/MULTIHOST.md``).
``jaxflash.sharding.distributed.initialize_from_env()`` joins this host's JAX
program first (TPU slice metadata, or ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``). ``JAXFLASH_ROLE`` says what it runs:
``learner`` (default): the RL loop, in process 0 of the learner program (the
controller), while its other processes follow process 0's learner commands;
``generation``: a generation program serving rollouts over gRPC
(``runtime.fleet.gen_program``, its process ``gen_process.run_process``) on ``--port``,
reached by a controller whose ``mesh.generation_addresses`` lists it.

On CPU the fake device count comes from `config.mesh.num_cpu_devices`, set here
before jax is imported. On a multi-host TPU/GPU slice (JAX_COORDINATOR_ADDRESS or
a TPU pod environment), `jax.distributed.initialize()` runs first. Restarting with
the same --workdir resumes from the last complete checkpoint (a finished run
says so and exits). A bad override or setting exits with status 2 and one line
naming the field (``launch/overrides.py``); long phases print a progress line
after ``--progress_every_s`` seconds of silence. One loop,
`runtime.loop.run`, serves both placements: `mesh.colocated=True` (one generation
server on the learner's devices, async_ratio 0: the synchronous baseline) and
disjoint slices (`--config.mesh.colocated=False`, e.g. `configs/smoke_async.py`).
"""

from __future__ import annotations

import glob
import importlib.util
import math
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
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Compile the learner step and the engine ahead of time for the config's meshes, print "
    "the memory plan per device, and exit (no weights, no workdir).",
)
_TOPOLOGY = flags.DEFINE_string(
    "topology",
    None,
    "With --dry_run: compile for this TPU slice without holding it (v5e-16, v6e-8, v5p-64, "
    "v4-32 as GCP names them, or v5e:4x4); needs the jaxflash[tpu] extra (libtpu).",
)
_PORT = flags.DEFINE_integer(
    "port", 0, "JAXFLASH_ROLE=generation: the gRPC port to serve on (0 picks one)."
)
flags.mark_flags_as_required(["config"])


def _set_cpu_device_count(n: int) -> None:
    """Fakes n CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("jax was imported before the CPU device count could be set")
    flag = f"--xla_force_host_platform_device_count={n}"
    existing = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in existing:
        os.environ["XLA_FLAGS"] = f"{existing} {flag}".strip()


def _tpu_attached() -> bool:
    """A TPU chip on this host's PCI bus (Google's vendor id), read without JAX."""
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path, encoding="ascii") as f:
                if f.read().strip() == "0x1ae0":
                    return True
        except OSError:
            continue
    return False


def _skip_absent_tpu() -> None:
    """With the tpu extra (libtpu) installed on a host without TPU chips, JAX would
    initialise libtpu at its first device query (and print its metadata warnings):
    run JAX on CPU instead, unless JAX_PLATFORMS is set or an NVIDIA GPU is visible."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    if not _tpu_attached() and not glob.glob("/dev/nvidia[0-9]*"):
        os.environ["JAX_PLATFORMS"] = "cpu"


def _role() -> str:
    role = os.environ.get("JAXFLASH_ROLE", "learner") or "learner"
    if role not in ("learner", "generation"):
        print(f"config error: JAXFLASH_ROLE={role!r} must be learner or generation",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    return role


def _devices(config, role: str) -> int:
    """Fake CPU devices of this process (ignored by TPU/GPU platforms)."""
    if role == "generation":  # this host's part of one generation slice's mesh
        hosts = int(config.mesh.get("generation_hosts", 1))
        return math.prod(int(v) for v in config.mesh.generation.values()) // max(hosts, 1)
    n = int(config.mesh.num_cpu_devices)
    if _DRY_RUN.value:  # the placement's devices (runtime.placement.carve)
        n_l, n_g = (math.prod(int(v) for v in m.values())
                    for m in (config.mesh.learner, config.mesh.generation))  # fmt: skip
        slices = 0 if config.mesh.colocated else max(1, int(config.mesh.num_generation_slices))
        n = max(n, n_l, n_g, n_l + slices * n_g)
    return n


def _serve_generation() -> None:
    """This host is a generation program: serve the controller over gRPC until told to stop."""
    import jax

    from jaxflash.runtime.fleet.gen_process import run_process
    from jaxflash.sharding.distributed import advertised_host

    # Over several hosts (a slice's workers): process 0 serves, the others follow it.
    hosts = jax.process_count() > 1
    sys.exit(run_process(host=advertised_host(), port=_PORT.value, hosts=hosts))


def _learner(exp, console) -> None:
    """Process 0 runs the RL loop (the controller); the others follow its learner calls."""
    import jax

    from jaxflash.runtime.fleet.learner_links import LeaderLinks
    from jaxflash.runtime.fleet.learner_setup import follow
    from jaxflash.runtime.loop import run
    from jaxflash.sharding.distributed import advertised_host

    if jax.process_count() == 1:
        run(exp, workdir=_WORKDIR.value, console=console)
    elif jax.process_index() == 0:
        with LeaderLinks(host=advertised_host()) as links:
            # run() first opens the checkpoint directory (a collective in Orbax): the
            # other processes must open it too, at the same point.
            links.post("finished_step")
            run(exp, workdir=_WORKDIR.value, console=console, learner_links=links)
    else:
        sys.exit(follow(exp, _WORKDIR.value, host=advertised_host()))


def main(argv: list[str]) -> None:
    del argv
    try:  # its import parses JAXFLASH_FAILPOINT (jax-free): a bad value is one line here
        from jaxflash import failpoints  # noqa: F401
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
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
    role = _role()
    if role == "learner" and not _DRY_RUN.value and not _WORKDIR.value:
        print("config error: --workdir is required (where the run is written)", file=sys.stderr)
        sys.exit(2)
    if _WORKDIR.value and os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
        print(
            f"config error: --workdir {_WORKDIR.value} is a file, not a directory", file=sys.stderr
        )
        sys.exit(2)
    if _TOPOLOGY.value is not None and not _TOPOLOGY.value.strip():
        print("config error: --topology is empty; name a slice (e.g. v5e-16)", file=sys.stderr)
        sys.exit(2)
    if _TOPOLOGY.value and not _DRY_RUN.value:
        print("config error: --topology needs --dry_run (it compiles, it does not run)",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    if _TOPOLOGY.value and importlib.util.find_spec("libtpu") is None:  # before slow imports
        print("config error: --topology compiles with libtpu, which is not installed: "
              "pip install 'jaxflash[tpu]'", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    if _TOPOLOGY.value:  # a deviceless TPU compile: JAX on CPU, libtpu only as the compiler
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (jaxflash.sizing.tpu sets the rest)
    _skip_absent_tpu()
    _set_cpu_device_count(_devices(config, role))
    from jaxflash.runtime.config.specs import ConfigError
    from jaxflash.runtime.console import Console
    from jaxflash.sharding.distributed import initialize_from_env
    from jaxflash.types import NothingTrainedError, RunStoppedError

    console = Console(sys.stdout, every_s=_PROGRESS.value)
    try:
        announce = "starting: importing JAX, Orbax and the verifiers ..."  # never JetStream
        with console.phase("starting", announce=announce):
            try:  # join this host's JAX program (a TPU slice, or JAX_COORDINATOR_ADDRESS)
                initialize_from_env()
            except ValueError as err:  # a malformed variable: named in the message
                raise ConfigError(str(err)) from err
            if role == "generation":
                console.close()
                _serve_generation()
            # Library code never sees the ConfigDict: it becomes validated dataclasses here.
            from jaxflash.runtime.config.experiment import ExperimentConfig

            exp = ExperimentConfig.from_config_dict(config)
            # TensorFlow writes its start-up lines (oneDNN, "no CUDA drivers") to fd 2
            # before any log level applies: hidden, unless --verbosity was given.
            with native_stderr_hidden(not verbose):
                from jaxflash.runtime import loop as rlvr  # noqa: F401  (the slow imports)
        if _DRY_RUN.value:
            from jaxflash.runtime.dry_run_plan import dry_run_report

            with console.phase("compiling the learner step and the engine ahead of time"):
                report = dry_run_report(exp, topology=_TOPOLOGY.value)
            console.line(report)
            return
        _learner(exp, console)
    except ConfigError as err:  # a bad or silently-ignored setting: one line, naming fields
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunStoppedError as err:  # e.g. every prompt failing step after step
        print(f"run stopped: {err}", file=sys.stderr)
        sys.exit(1)
    except NothingTrainedError as err:  # finished, but no update: not a success
        print(f"nothing trained: {err}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:
        from jaxflash.runtime.interrupt import interrupted_message

        # Read after the run's shutdown: a second Ctrl-C may have cut a checkpoint
        # write short, and the message says the step a resume really starts from.
        total = int(config.total_steps)  # a finished run: a rerun does not resume it
        line = interrupted_message(_WORKDIR.value, total) if _WORKDIR.value else "interrupted"
        print(f"\n{line}", file=sys.stderr)
        sys.exit(130)
    finally:
        console.close()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
