"""Quiet console for the one-shot entry points (export_hf.py, serve.py).

They should print their result, not the INFO logs of the libraries they load:
TensorFlow's C++ start-up lines (JetStream imports it through seqio), gRPC's,
JAX's backend probing and JetStream's per-step orchestrator lines. Call
``quiet_env()`` before those libraries are imported (environment variables
are read at import), ``quiet_python_logs()`` once absl has parsed flags, and
import the heavy libraries inside ``native_stderr_hidden()`` (TensorFlow's C++
start-up lines ignore every log level). ``--verbose`` on each script keeps
everything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

# Read by TensorFlow / gRPC's C++ code at import: 3 = errors only (TF), ERROR (gRPC).
_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "GRPC_VERBOSITY": "ERROR"}


def quiet_env() -> None:
    """Set the C++ log levels unless the user set them (call before heavy imports)."""
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)


def quiet_python_logs() -> None:
    """Python logging (and absl's handler on it) at WARNING: results and problems only."""
    from absl import logging as absl_logging  # noqa: PLC0415

    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)


@contextlib.contextmanager
def native_stderr_hidden(enabled: bool = True) -> Iterator[None]:
    """Hide what C++ code writes to file descriptor 2 inside the block.

    TensorFlow (imported by JetStream through seqio) prints its start-up lines
    from static initialisers, before any log level can be set, so the only way
    to keep them off the console is to point fd 2 elsewhere while it loads.
    If the block raises, the hidden text is written back so nothing is lost.
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
