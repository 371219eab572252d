"""Print (default) or run the command that starts jaxflash on every worker of a TPU slice.

    python launch/gcloud.py --tpu my-v5p-16 --zone us-east5-a -- \
        python launch/tpu_pod.py --config configs/rlvr_smollm2_arith.py --workdir gs://b/run1
    python launch/gcloud.py --topology topology.json --zone us-east5-a --run -- \
        python launch/tpu_pod.py --config ... --workdir ...

For each TPU slice it builds
``gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=all --command='cd DIR && ENV cmd'``:
the same command on every worker, with ``JAXFLASH_DISTRIBUTED=tpu`` so that
``jaxflash.sharding.distributed.initialize_from_env`` calls
``jax.distributed.initialize()`` without arguments (the slice's metadata names
the workers). With ``--topology`` (a ``jaxflash.sharding.roles.Topology`` JSON
file) there is one fan-out per TPU program, each also told its program name and
role (``JAXFLASH_PROGRAM``, ``JAXFLASH_ROLE``); hosts programs (CUDA) are printed
as the environment each host needs, to start with your own launcher.
``--run`` starts every fan-out and waits for all of them. Nothing else is
installed or copied: the repository must already be at ``--remote_dir`` on
every worker (see docs/MULTIHOST.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fanout_command(
    tpu: str,
    zone: str,
    command: list[str],
    *,
    project: str | None = None,
    env: dict[str, str] | None = None,
    remote_dir: str = "~/jaxflash",
) -> list[str]:
    """The gcloud argv that runs ``command`` on every worker of TPU ``tpu``.

    Raises:
      ValueError: an empty TPU name, zone or command.
    """
    if not tpu or not zone or not command:
        raise ValueError(f"need a TPU name, a zone and a command; got {tpu!r}, {zone!r}, {command}")
    env = {"JAXFLASH_DISTRIBUTED": "tpu", **(env or {})}
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    # ~ must stay unquoted so the remote shell expands it.
    cd = (
        remote_dir
        if remote_dir.startswith("~") and " " not in remote_dir
        else shlex.quote(remote_dir)
    )
    remote = f"cd {cd} && {assignments} {shlex.join(command)}"
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}"]
    if project:
        argv.append(f"--project={project}")
    return [*argv, "--worker=all", f"--command={remote}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--tpu", help="TPU slice name (one program)")
    which.add_argument("--topology", help="roles JSON (jaxflash.sharding.roles.Topology)")
    ap.add_argument("--zone", required=True)
    ap.add_argument("--project")
    ap.add_argument("--remote_dir", default="~/jaxflash", help="the repository on the workers")
    ap.add_argument("--run", action="store_true", help="run the fan-out(s) instead of printing")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the per-worker command")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the per-worker command after --")
    common = dict(project=args.project, remote_dir=args.remote_dir)
    fanouts: list[list[str]] = []
    if args.tpu:
        fanouts.append(fanout_command(args.tpu, args.zone, command, **common))
    else:
        from jaxflash.sharding.roles import Topology

        with open(args.topology) as f:
            topology = Topology.from_json(json.load(f))
        for p in topology.programs:
            if p.tpu is not None:
                env = topology.process_env(p.name)
                fanouts.append(fanout_command(p.tpu, args.zone, command, env=env, **common))
                continue
            for i, host in enumerate(p.hosts):
                env = topology.process_env(p.name, i)
                line = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
                print(f"# on {host}: {line} {shlex.join(command)}")
    for argv in fanouts:
        print(shlex.join(argv))
    if args.run:
        procs = [subprocess.Popen(argv) for argv in fanouts]
        sys.exit(max((p.wait() for p in procs), default=0))


if __name__ == "__main__":
    main()
