"""Which hosts run which JAX program: a learner and one or more generation programs.

A multi-controller JAX program needs every host of its devices inside it, so the
hosts of one TPU slice cannot be split between a learner and generators without
Pathways (marin-community/marin #3947 tried three layouts on a v5p-16; all
failed). Each role is therefore its own program over whole units:

- on TPU, a program is one whole TPU slice (``tpu: NAME``); every worker of the
  slice runs the same command and ``jax.distributed.initialize()`` finds them;
- on CUDA / CPU hosts, a program is a list of hosts (``hosts: [...]``); process
  ``i`` of the program runs on ``hosts[i]`` with the coordinator on ``hosts[0]``.

``Topology.from_json`` validates a description such as::

    {"programs": [
        {"name": "learner", "role": "learner", "tpu": "rl-learner-v5p16"},
        {"name": "gen0", "role": "generation", "tpu": "rl-gen-v5e8-a"},
        {"name": "gen1", "role": "generation", "tpu": "rl-gen-v5e8-b"}]}

and ``process_env`` gives the environment each process starts with
(``sharding.distributed.initialize_from_env`` reads it; ``JAXFLASH_PROGRAM`` /
``JAXFLASH_ROLE`` tell the entry point what to run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROLES = ("learner", "generation")
DEFAULT_COORDINATOR_PORT = 8476


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramSpec:
    """One JAX program.

    Attributes:
      name: unique name (also in logs and ``JAXFLASH_PROGRAM``).
      role: "learner" or "generation".
      tpu: a GCP TPU slice name: the program is all of its workers. Exclusive
        with ``hosts``.
      hosts: host names / addresses in process-id order (CUDA or CPU hosts).
      coordinator_port: port of the program's ``jax.distributed`` coordinator
        on its first host (hosts programs only; TPU slices find their own).

    Raises:
      ValueError: unknown role, both or neither of tpu / hosts, a host listed
        twice, an empty name, or a port outside 1..65535 (names the program).
    """

    name: str
    role: str
    tpu: str | None = None
    hosts: tuple[str, ...] = ()
    coordinator_port: int = DEFAULT_COORDINATOR_PORT

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        where = f"program {self.name!r}"
        if not self.name:
            raise ValueError("a program needs a non-empty name")
        if self.role not in ROLES:
            raise ValueError(f"{where}: role {self.role!r} is not one of {ROLES}")
        if (self.tpu is None) == (not self.hosts):
            raise ValueError(f"{where}: give exactly one of 'tpu' (a slice) or 'hosts' (a list)")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"{where}: a host is listed twice in {list(self.hosts)}")
        if not 0 < int(self.coordinator_port) < 65536:
            raise ValueError(f"{where}: coordinator_port={self.coordinator_port} not in 1..65535")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """All programs of one run.

    Raises:
      ValueError: not exactly one learner, no generation program, duplicate
        names, or a host / TPU slice in two programs (names them).
    """

    programs: tuple[ProgramSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "programs", tuple(self.programs))
        names = [p.name for p in self.programs]
        if len(set(names)) != len(names):
            raise ValueError(f"program names must be unique, got {names}")
        learners = [p.name for p in self.programs if p.role == "learner"]
        if len(learners) != 1:
            raise ValueError(f"need exactly one learner program, got {learners}")
        if not any(p.role == "generation" for p in self.programs):
            raise ValueError("need at least one generation program")
        owner: dict[str, str] = {}
        for p in self.programs:
            for unit in [f"tpu {p.tpu}"] if p.tpu else [f"host {h}" for h in p.hosts]:
                if unit in owner:
                    raise ValueError(
                        f"{unit} is in programs {owner[unit]!r} and {p.name!r}: one JAX program "
                        "needs all of its hosts, so a slice or host cannot serve two programs "
                        "(give each role its own TPU slice or hosts)"
                    )
                owner[unit] = p.name

    @property
    def learner(self) -> ProgramSpec:
        return next(p for p in self.programs if p.role == "learner")

    @property
    def generation(self) -> tuple[ProgramSpec, ...]:
        return tuple(p for p in self.programs if p.role == "generation")

    def program(self, name: str) -> ProgramSpec:
        """The program called ``name``.

        Raises:
          KeyError: no such program (lists the names).
        """
        for p in self.programs:
            if p.name == name:
                return p
        raise KeyError(f"no program {name!r}; have {[p.name for p in self.programs]}")

    def locate(self, host: str) -> tuple[ProgramSpec, int]:
        """(program, process id) of ``host`` among the hosts programs.

        Raises:
          KeyError: the host is in no hosts program.
        """
        for p in self.programs:
            if host in p.hosts:
                return p, p.hosts.index(host)
        raise KeyError(f"host {host!r} is in no program's hosts")

    def process_env(self, name: str, process_id: int = 0) -> dict[str, str]:
        """Environment of process ``process_id`` of program ``name``.

        TPU slices get ``JAXFLASH_DISTRIBUTED=tpu`` (JAX reads the workers from
        the slice); hosts programs get the coordinator on their first host and
        their process count and id. Both get ``JAXFLASH_PROGRAM`` and ``JAXFLASH_ROLE``.

        Raises:
          KeyError: unknown program. ValueError: process_id out of range.
        """
        p = self.program(name)
        env = {"JAXFLASH_PROGRAM": p.name, "JAXFLASH_ROLE": p.role}
        if p.tpu is not None:
            return {**env, "JAXFLASH_DISTRIBUTED": "tpu"}
        if not 0 <= process_id < len(p.hosts):
            raise ValueError(
                f"program {name!r} has processes 0..{len(p.hosts) - 1}, not {process_id}"
            )
        return {
            **env,
            "JAXFLASH_DISTRIBUTED": "env",
            "JAX_COORDINATOR_ADDRESS": f"{p.hosts[0]}:{p.coordinator_port}",
            "JAX_NUM_PROCESSES": str(len(p.hosts)),
            "JAX_PROCESS_ID": str(process_id),
        }

    def to_json(self) -> dict[str, Any]:
        return {"programs": [_program_json(p) for p in self.programs]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Topology:
        """Parse and validate; unknown keys are refused by name (never ignored).

        Raises:
          ValueError: unknown or missing keys, or any check above.
        """
        if not isinstance(d, Mapping) or set(d) != {"programs"}:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"a topology is {{'programs': [...]}}, got keys {got}")
        fields = {f.name for f in dataclasses.fields(ProgramSpec)}
        programs = []
        for i, p in enumerate(d["programs"]):
            unknown = sorted(set(p) - fields) if isinstance(p, Mapping) else ["(not an object)"]
            if unknown:
                raise ValueError(f"programs[{i}]: unknown keys {unknown}; known {sorted(fields)}")
            missing = sorted({"name", "role"} - set(p))
            if missing:
                raise ValueError(f"programs[{i}]: missing keys {missing}")
            programs.append(ProgramSpec(**{**p, "hosts": tuple(p.get("hosts", ()))}))
        return cls(programs=tuple(programs))


def _program_json(p: ProgramSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": p.name, "role": p.role}
    if p.tpu is not None:
        out["tpu"] = p.tpu
    else:
        out["hosts"] = list(p.hosts)
        out["coordinator_port"] = p.coordinator_port
    return out
