"""One owner for each thing (issue 27), read from the source with ``ast``.

* The ConfigDict stops at the wiring: at most 5 runtime modules (outside
  ``runtime/config/``) read the whole ``ExperimentConfig``; the rest take sections.
* The fleet tells the rollout what changed in one call: ``runtime/fleet/`` imports
  nothing of the rollout but the server pool's messages and its metric names.
* The faces are small: ``Workload``, ``Rollout`` and ``Dispatch`` have at most 8
  members, and the dispatchers offer no other public methods.
"""

from __future__ import annotations

import ast
import pathlib

from jaxflash.runtime.rollout.dispatch import Dispatcher
from jaxflash.runtime.rollout.episode_dispatch import EpisodeDispatcher
from jaxflash.runtime.rollout.scheduler import Rollout
from jaxflash.runtime.rollout.settings import Dispatch
from jaxflash.runtime.workloads.workload import Workload
from tests.paths import REPO

RUNTIME = pathlib.Path(REPO) / "jaxflash" / "runtime"
WIRING = {"loop.py", "fleet/fleets.py", "fleet/learner_setup.py", "workloads/workload.py"}
WIRING |= {"dry_run_plan.py"}


def _reads_whole_config(tree: ast.Module) -> bool:
    """Names ``ExperimentConfig``, or a function reads a parameter ``exp``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "ExperimentConfig":
            return True
        if isinstance(node, ast.alias) and node.name == "ExperimentConfig":
            return True
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if {a.arg for a in args} & {"exp", "experiment"}:
                return True
        if isinstance(node, ast.Attribute) and node.attr in {"exp", "_exp"}:
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return True  # the whole config kept on an object
    return False


def whole_config_readers() -> set[str]:
    out = set()
    for path in RUNTIME.rglob("*.py"):
        rel = path.relative_to(RUNTIME).as_posix()
        if not rel.startswith("config/") and _reads_whole_config(ast.parse(path.read_text())):
            out.add(rel)
    return out


def test_only_the_wiring_reads_the_whole_experiment():
    readers = whole_config_readers()
    assert readers <= WIRING and len(readers) <= 5, sorted(readers - WIRING)


def test_the_reader_count_can_fail():
    """A section builder that took the whole experiment would be found."""
    tree = ast.parse("def make_thing(exp):\n    return exp.rollout\n")
    assert _reads_whole_config(tree)
    assert not _reads_whole_config(ast.parse("def make_thing(*, rollout):\n    return rollout\n"))
    assert not _reads_whole_config(ast.parse("import math\nx = math.exp(1.0)\n"))


def test_the_fleet_reaches_the_rollout_only_through_the_pool_messages():
    allowed = {"jaxflash.runtime.rollout.server_pool", "jaxflash.runtime.rollout.server_metrics"}
    for path in (RUNTIME / "fleet").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "jaxflash.runtime.rollout"
            ):
                assert node.module in allowed, (path.name, node.module)


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n in vars(protocol) if not n.startswith("_")}
    return names


def test_the_loops_faces_are_small():
    assert len(_members(Workload)) <= 8, sorted(_members(Workload))
    assert len(_members(Rollout)) <= 8, sorted(_members(Rollout))


def test_the_dispatch_face_is_small_and_the_dispatchers_keep_to_it():
    face = _members(Dispatch)
    assert len(face) <= 8, sorted(face)
    for impl in (Dispatcher, EpisodeDispatcher):
        public = {n for n, v in vars(impl).items() if not n.startswith("_") and callable(v)}
        assert public <= face, (impl.__name__, sorted(public - face))
