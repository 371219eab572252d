"""jaxflash's import graph has no circle (read from the source with ``ast``; nothing is imported).

Every ``import`` counts, including those inside functions: a circle hidden in a
function body is still two modules that cannot be read (or moved) one without
the other. ``from pkg import name`` is an arrow to ``pkg.name`` when that is a
module, else to ``pkg``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxflash"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, pathlib.Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """{module: modules it imports} over jaxflash, from the source text."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                resolved = _resolve(target, mods)
                if resolved is not None and resolved != mod:
                    graph[mod].add(resolved)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


LAYERS = {
    "types": 0,
    "failpoints": 0,
    "sharding": 1,
    "algorithms": 1,
    "rewards": 1,
    "metrics": 1,
    "report": 1,
    "models": 2,
    "data": 2,
    "envs": 2,
    "generation": 3,
    "learner": 3,
    "replay": 3,
    "sync": 3,
    "checkpoint": 3,
    "sizing": 4,
    "runtime": 5,
}
"""docs/CONTRACTS.md "Layers": a package imports only packages of a lower layer."""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Arrows between jaxflash packages that do not go down a layer (or name no layer)."""
    bad = []
    for module, targets in graph.items():
        package = module.split(".")[1] if "." in module else None
        for target in targets:
            other = target.split(".")[1] if "." in target else None
            if package is None or other is None or other == package:
                continue
            if package not in LAYERS or other not in LAYERS:
                bad.append(f"{module} -> {target}: package not in LAYERS")
            elif LAYERS[other] >= LAYERS[package]:
                bad.append(
                    f"{module} (layer {LAYERS[package]}) -> {target} (layer {LAYERS[other]})"
                )
    return sorted(bad)


def test_packages_import_only_lower_layers():
    assert layer_violations(import_graph()) == []
    planted = {"jaxflash.models.x": {"jaxflash.envs.y"}, "jaxflash.envs.y": set()}
    assert layer_violations(planted) == ["jaxflash.models.x (layer 2) -> jaxflash.envs.y (layer 2)"]


RUNTIME_FLOORS = {
    "clock": 0,
    "interrupt": 0,
    "console": 0,
    "config": 1,
    "rollout": 2,
    "model_setup": 3,
    "resume": 3,
    "agents": 3,
    "fleet": 4,
    "workloads": 4,
    "control": 5,
    "simulate": 5,
    "loop": 6,
    "dry_run_plan": 6,
}
"""runtime/'s rooms by floor (docs/LAYOUT.md): a room imports only rooms of lower floors."""


def runtime_floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Arrows between runtime rooms that do not go down a floor (or name no floor)."""
    bad = []
    prefix = "jaxflash.runtime."
    for module, targets in graph.items():
        if not module.startswith(prefix):
            continue
        room = module[len(prefix) :].split(".")[0]
        for target in targets:
            if not target.startswith(prefix):
                continue
            other = target[len(prefix) :].split(".")[0]
            if other == room:
                continue
            if room not in RUNTIME_FLOORS or other not in RUNTIME_FLOORS:
                bad.append(f"{module} -> {target}: room not in RUNTIME_FLOORS")
            elif RUNTIME_FLOORS[other] >= RUNTIME_FLOORS[room]:
                bad.append(
                    f"{module} (floor {RUNTIME_FLOORS[room]}) -> {target} "
                    f"(floor {RUNTIME_FLOORS[other]})"
                )
    return sorted(bad)


def test_runtime_rooms_import_only_lower_floors():
    assert runtime_floor_violations(import_graph()) == []
    entries = [p for p in (ROOT / "runtime").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 15, sorted(p.name for p in entries)
    assert {p.name.removesuffix(".py") for p in entries} - {"__init__"} == set(RUNTIME_FLOORS)


def test_jaxflash_has_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, f"import circles: {cycles}"


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_and_submodule_imports():
    graph = import_graph()
    # tokenizer.py imports tokenizer_files inside its classmethods: the arrow must be seen.
    assert "jaxflash.models.text.tokenizer_files" in graph["jaxflash.models.text.tokenizer"]
    # ``from jaxflash.learner import cycles`` is an arrow to the submodule, not the package.
    assert "jaxflash.learner.cycles" in graph["jaxflash.learner.step"]
    assert "jaxflash.learner" not in graph["jaxflash.learner.step"]


MODELS_ARROWS = {
    "config": set(),
    "text": set(),
    "caches": {"config"},
    "adapters": {"config"},
    "decoder": {"config", "caches", "adapters"},
    "formats": {"config", "adapters", "decoder"},
}
"""models/'s rooms (docs/LAYOUT.md) and the rooms each may import; every arrow goes down."""


def room_arrows(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """{room: rooms it imports} between the rooms (subpackages or modules) of ``package``."""
    prefix = f"{package}."
    arrows: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if not module.startswith(prefix):
            continue
        room = module[len(prefix) :].split(".")[0]
        arrows.setdefault(room, set())
        for target in targets:
            if target.startswith(prefix):
                other = target[len(prefix) :].split(".")[0]
                if other != room:
                    arrows[room].add(other)
    return arrows


def room_floors(arrows: dict[str, set[str]]) -> dict[str, int]:
    """Each room's floor: 0 with no arrow out, else one above the highest room it imports.

    Raises:
      ValueError: the rooms import each other in a circle (a back arrow).
    """
    floors: dict[str, int] = {}

    def floor(room: str, path: tuple[str, ...]) -> int:
        if room in path:
            raise ValueError(f"back arrow: {' -> '.join((*path, room))}")
        if room not in floors:
            below = [floor(other, (*path, room)) for other in sorted(arrows.get(room, ()))]
            floors[room] = 1 + max(below, default=-1)
        return floors[room]

    for room in sorted(arrows):
        floor(room, ())
    return floors


def test_models_rooms_import_only_their_allowed_rooms():
    arrows = room_arrows(import_graph(), "jaxflash.models")
    entries = {p.name for p in (ROOT / "models").iterdir() if p.name != "__pycache__"}
    assert entries - {"__init__.py"} == set(MODELS_ARROWS), sorted(entries)
    assert all((ROOT / "models" / room).is_dir() for room in MODELS_ARROWS)
    assert len(MODELS_ARROWS) <= 7
    extra = {room: sorted(arrows[room] - MODELS_ARROWS[room]) for room in MODELS_ARROWS}
    assert not any(extra.values()), f"arrows not in MODELS_ARROWS: {extra}"
    floors = room_floors(arrows)
    assert floors == {
        "config": 0,
        "text": 0,
        "caches": 1,
        "adapters": 1,
        "decoder": 2,
        "formats": 3,
    }
    assert max(floors.values()) + 1 <= 4
    # A back arrow (a room importing a room above it) is a circle between rooms.
    planted = {**MODELS_ARROWS, "config": {"decoder"}}
    with pytest.raises(ValueError, match="back arrow: .*config -> decoder"):
        room_floors(planted)
