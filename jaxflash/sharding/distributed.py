"""Start ``jax.distributed`` from the environment, the same way on TPU VMs, CUDA hosts and CPU.

One JAX program = one ``jax.distributed`` job: every process of the program calls
``initialize_from_env()`` before any other JAX call. Which kind of job this is
comes from the environment (``plan_distributed`` is the pure decision):

- ``JAXFLASH_DISTRIBUTED=tpu`` (set by ``launch/gcloud.py`` on every worker of
  a multi-host TPU slice), or ``TPU_WORKER_HOSTNAMES`` listing several hosts, or
  ``MEGASCALE_COORDINATOR_ADDRESS``: ``jax.distributed.initialize()`` without
  arguments; JAX reads the slice's workers from the TPU metadata. The program is
  the whole slice.
- ``JAX_COORDINATOR_ADDRESS=host:port`` with ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID`` (CUDA hosts, local multi-process tests on loopback, or a
  TPU program that is not a whole slice): explicit arguments. With neither of
  the two counts set, JAX's own cluster detection (Slurm, Open MPI) fills them.
  ``JAX_LOCAL_DEVICE_IDS`` (read by JAX) restricts a process to some GPUs.
- otherwise (or ``JAXFLASH_DISTRIBUTED=off``): a single process; nothing to do.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping


class DistributedKind(enum.Enum):
    SINGLE = "single"  # one process; jax.distributed is not started
    TPU = "tpu"  # initialize() without arguments (TPU slice metadata)
    EXPLICIT = "explicit"  # coordinator address, process count and id from the env


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedPlan:
    """What ``initialize_from_env`` will do (or did).

    Attributes:
      kind: DistributedKind.
      coordinator_address: "host:port" of process 0's coordinator (EXPLICIT only).
      num_processes: processes in this program (EXPLICIT; None = JAX detects).
      process_id: this process's id in [0, num_processes) (EXPLICIT; None = JAX detects).
      reason: which environment variable decided, for logs.
    """

    kind: DistributedKind
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    reason: str = ""


_MODES = ("auto", "tpu", "env", "off")


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


def _check_address(name: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={address!r} must be host:port with a port in 1..65535")


def plan_distributed(env: Mapping[str, str] | None = None) -> DistributedPlan:
    """Decide how this process joins its JAX program (pure: reads ``env`` only).

    Args:
      env: the environment (default ``os.environ``).

    Returns:
      DistributedPlan.

    Raises:
      ValueError: an unknown ``JAXFLASH_DISTRIBUTED``; a malformed
        ``JAX_COORDINATOR_ADDRESS``; only one of ``JAX_NUM_PROCESSES`` /
        ``JAX_PROCESS_ID``; a process id outside [0, count); a count < 1;
        ``JAXFLASH_DISTRIBUTED=env`` without ``JAX_COORDINATOR_ADDRESS``.
    """
    env = os.environ if env is None else env
    mode = env.get("JAXFLASH_DISTRIBUTED", "auto") or "auto"
    if mode not in _MODES:
        raise ValueError(f"JAXFLASH_DISTRIBUTED={mode!r}: use one of {_MODES}")
    if mode == "off":
        return DistributedPlan(kind=DistributedKind.SINGLE, reason="JAXFLASH_DISTRIBUTED=off")
    if mode == "tpu":
        return DistributedPlan(kind=DistributedKind.TPU, reason="JAXFLASH_DISTRIBUTED=tpu")
    address = env.get("JAX_COORDINATOR_ADDRESS", "")
    if address:
        _check_address("JAX_COORDINATOR_ADDRESS", address)
        n, i = _int_var(env, "JAX_NUM_PROCESSES"), _int_var(env, "JAX_PROCESS_ID")
        if (n is None) != (i is None):
            missing = "JAX_PROCESS_ID" if i is None else "JAX_NUM_PROCESSES"
            raise ValueError(
                f"JAX_COORDINATOR_ADDRESS={address} is set with only one of JAX_NUM_PROCESSES / "
                f"JAX_PROCESS_ID: set {missing} too (or neither, under Slurm / Open MPI)"
            )
        if n is not None and i is not None and (n < 1 or not 0 <= i < n):
            raise ValueError(
                f"JAX_PROCESS_ID={i} must be in [0, JAX_NUM_PROCESSES={n}) and the count >= 1"
            )
        return DistributedPlan(
            kind=DistributedKind.EXPLICIT,
            coordinator_address=address,
            num_processes=n,
            process_id=i,
            reason="JAX_COORDINATOR_ADDRESS",
        )
    if mode == "env":
        raise ValueError("JAXFLASH_DISTRIBUTED=env needs JAX_COORDINATOR_ADDRESS=host:port")
    if "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return DistributedPlan(kind=DistributedKind.TPU, reason="TPU_WORKER_HOSTNAMES")
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return DistributedPlan(kind=DistributedKind.TPU, reason="MEGASCALE_COORDINATOR_ADDRESS")
    return DistributedPlan(kind=DistributedKind.SINGLE, reason="no multi-process environment")


def initialize_from_env(
    env: Mapping[str, str] | None = None, *, initialization_timeout_s: int = 300
) -> DistributedPlan:
    """Join this process's JAX program as the environment says (``plan_distributed``).

    Call before any other JAX call that touches devices. On CPU, jax 0.10.2's
    default cross-process collectives (gloo) make sharded computations span the
    processes (checked: a psum over 2 processes x 2 fake devices).

    Args:
      env: the environment (default ``os.environ``).
      initialization_timeout_s: how long to wait for all processes to connect.

    Returns:
      The plan that was carried out.

    Raises:
      ValueError: as ``plan_distributed``.
      RuntimeError: ``jax.distributed`` did not come up (wraps JAX's error with
        the plan, so the message names the variables used).
    """
    plan = plan_distributed(env)
    if plan.kind is DistributedKind.SINGLE:
        return plan
    import jax  # noqa: PLC0415  (the plan itself must not import jax)

    kwargs = {"initialization_timeout": int(initialization_timeout_s)}
    if plan.kind is DistributedKind.EXPLICIT:
        kwargs.update(
            coordinator_address=plan.coordinator_address,
            num_processes=plan.num_processes,
            process_id=plan.process_id,
        )
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(f"jax.distributed.initialize failed for {plan}: {err}") from err
    return plan
