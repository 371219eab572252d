"""A generation program's process: serve ``GenerationProgram`` over gRPC until told to stop.

    python -m jaxflash.runtime.fleet.gen_process --host 127.0.0.1 --port 0 [--parent_pid P]

prints one JSON line ``{"event": "listening", "address": "host:port", "pid": ...}``
and serves until ``Shutdown`` (or its parent process dies, with ``--parent_pid``).
Over several hosts (``JAX_COORDINATOR_ADDRESS`` & co. set, or ``launch/tpu_pod.py``
on a slice's workers) process 0 serves and the others follow it (``gen_hosts.follow``).
``gen_endpoint.LocalProgram`` starts this module as a child process;
``launch/tpu_pod.py`` calls ``run_process`` on a generation host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent import futures
from typing import Any

import grpc

from jaxflash.runtime.fleet import rpc_wire
from jaxflash.runtime.fleet.gen_hosts import ProgramHosts, follow
from jaxflash.runtime.fleet.gen_program import GenerationProgram


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    parent_pid: int | None = None,
    out: Any = None,
    hosts: bool = False,
) -> int:
    """Run a generation program until ``Shutdown`` (or its parent dies); returns 0.

    Args:
      host: interface to listen on (loopback by default; a pod host's address
        reachable from the controller).
      port: gRPC port (0 picks one; the "listening" line says which).
      parent_pid: exit when this process is no longer the parent (a controller
        that was killed leaves no generation process behind).
      out: where the "listening" JSON line goes (default stdout).
      hosts: this is process 0 of a program over several hosts (``jax.distributed``
        is up): wait for the others to connect (``gen_hosts.ProgramHosts``) first.
    """
    program = GenerationProgram(host=host)
    others = ProgramHosts(host=host, on_lost=program.host_lost) if hosts else None
    if others is not None:
        program.attach(others)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=rpc_wire.GRPC_OPTIONS)
    server.add_generic_rpc_handlers([program.handler()])
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    line = {"event": "listening", "address": f"{host}:{bound}", "pid": os.getpid()}
    print(json.dumps(line), file=out or sys.stdout, flush=True)
    while not program.stopped.wait(0.5):
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(3)  # orphaned: the controller is gone (SIGKILL leaves no clean-up)
    server.stop(grace=2).wait()
    if others is not None:
        others.close()
    return 0


def run_process(
    *, host: str = "127.0.0.1", port: int = 0, parent_pid: int | None = None, hosts: bool = False
) -> int:
    """This process's part of a generation program: all of it (``serve``),
    or with ``hosts`` (``jax.distributed`` is up) process 0's ``serve`` or another
    host's ``follow``, then leave at once: JAX's exit-time barrier would wait for
    hosts that are gone. Returns the exit code (one process only)."""
    if not hosts:
        return serve(host=host, port=port, parent_pid=parent_pid)
    import jax  # noqa: PLC0415

    if jax.process_index() == 0:
        code = serve(host=host, port=port, parent_pid=parent_pid, hosts=True)
    else:
        code = follow(host=host)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    ap = argparse.ArgumentParser(description="jaxflash generation program (gRPC)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--parent_pid", type=int, default=None)
    args = ap.parse_args()
    from jaxflash.sharding.distributed import DistributedKind, initialize_from_env  # noqa: PLC0415

    hosts = initialize_from_env().kind is not DistributedKind.SINGLE  # several hosts
    sys.exit(run_process(host=args.host, port=args.port, parent_pid=args.parent_pid, hosts=hosts))


if __name__ == "__main__":
    main()
