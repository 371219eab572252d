"""Every ``configs/*.py`` (each variant too): its keys are fields of the validated
dataclasses, it validates, and it sets only its choices. No JAX program is compiled.

"Only its choices": each ``c.<...> = value`` line of a ``get_config`` changes the
config it returns (with ``mesh.colocated`` as written and flipped, the documented
override): deleting the line and rebuilding must give a different ConfigDict under
some variant of the file. A line kept on purpose says why with ``# keep: <reason>``.
"""

import ast
import copy
import glob
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import default  # noqa: E402
from jaxflash.models.adapters.lora import LoraConfig  # noqa: E402
from jaxflash.runtime.config.experiment import (  # noqa: E402
    ConfigError,
    ExperimentConfig,
    config_keys,
)

NAMES = sorted(
    os.path.basename(p)[:-3]
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not p.endswith("__init__.py")
)


def _variants(name: str) -> tuple:
    return getattr(importlib.import_module(f"configs.{name}"), "VARIANTS", (None,))


CASES = [(name, arg) for name in NAMES for arg in _variants(name)]
TOP = ("seed", "total_steps")


VALUE_DICTS = ("mesh.learner", "mesh.generation", "learner.loss_kwargs", "replay.correction_kwargs")


def _leaves(d: dict, prefix: str = "") -> list[str]:
    """Every key's dotted path (a section's keys, not a mapping value's)."""
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        nested = isinstance(v, dict) and key not in VALUE_DICTS
        out += _leaves(v, f"{key}.") if nested else [key]
    return out


@pytest.mark.parametrize(("name", "arg"), CASES)
def test_every_key_is_a_validated_field(name, arg):
    c = importlib.import_module(f"configs.{name}").get_config(arg).to_dict()
    keys = config_keys()
    assert set(c) <= {*TOP, *keys}, set(c) - {*TOP, *keys}
    for section, known in keys.items():
        assert set(c.get(section, {})) <= set(known), (section, set(c[section]) - set(known))
    lora = c.get("learner", {}).get("lora", {})
    assert set(lora) <= {f for f in LoraConfig.__dataclass_fields__}, lora
    ExperimentConfig.from_config_dict(c)  # and it validates


def test_the_defaults_are_the_dataclasses_defaults():
    c = default.get_config()
    keys = config_keys()
    # Every field is a key (so any can be set from the command line), no key more.
    assert set(c) == {*TOP, *keys}
    for section, known in keys.items():
        assert sorted(c[section]) == sorted(known), section
    assert sorted(c.learner.lora) == sorted(LoraConfig.__dataclass_fields__)
    # ... and each key holds its field's default: the same run as no key set at all.
    assert ExperimentConfig.from_config_dict(c) == ExperimentConfig.from_config_dict({})


@pytest.mark.parametrize("key", _leaves(default.get_config().to_dict()))
def test_a_misspelt_key_is_refused_naming_it(key):
    c = default.get_config().to_dict()
    *parents, leaf = key.split(".")
    section = c
    for p in parents:
        section = section[p]
    section[leaf + "_x"] = section.pop(leaf)
    with pytest.raises(ConfigError, match=leaf + "_x"):
        ExperimentConfig.from_config_dict(c)


def _on_config(target: ast.expr) -> bool:
    """``c.<...> = `` or ``c[...] = ``: a line that sets a key."""
    if not isinstance(target, ast.Attribute | ast.Subscript):
        return False
    while isinstance(target, ast.Attribute | ast.Subscript):
        target = target.value
    return isinstance(target, ast.Name) and target.id == "c"


class _Drop(ast.NodeTransformer):
    def __init__(self, line: int):
        self.line = line

    def visit_Assign(self, node: ast.Assign) -> ast.stmt:
        return ast.copy_location(ast.Pass(), node) if node.lineno == self.line else node


def _built(get_config, arg) -> tuple:
    """The config as written and with ``mesh.colocated`` flipped (its references follow)."""
    c = get_config(arg)
    flipped = copy.deepcopy(c)
    flipped.mesh.colocated = not flipped.mesh.colocated
    return c.to_dict(), flipped.to_dict()


def _without(path: str, tree: ast.Module, line: int):
    probe = ast.fix_missing_locations(_Drop(line).visit(copy.deepcopy(tree)))
    namespace = {"__name__": "configs._probe", "__file__": path}
    exec(compile(probe, path, "exec"), namespace)  # noqa: S102 (our own config file)
    return namespace["get_config"]


@pytest.mark.parametrize("name", [n for n in NAMES if n != "default"])
def test_a_config_sets_only_its_choices(name):
    path = os.path.join(ROOT, "configs", f"{name}.py")
    source = open(path).read()
    lines = source.splitlines()
    tree = ast.parse(source)
    module = importlib.import_module(f"configs.{name}")
    variants = _variants(name)
    built = {arg: _built(module.get_config, arg) for arg in variants}
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_config"]
    restated = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and all(map(_on_config, node.targets))):
            continue
        text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if "# keep:" in text:
            continue
        get_config = _without(path, tree, node.lineno)
        try:
            same = all(_built(get_config, arg) == built[arg] for arg in variants)
        except (AttributeError, KeyError, TypeError, ValueError):
            same = False  # the line is needed by a later one
        if same:
            restated.append(f"configs/{name}.py:{node.lineno}: {text.strip()}")
    assert not restated, "lines that restate what the config already holds:\n" + "\n".join(restated)


@pytest.mark.parametrize("name", [n for n in NAMES if len(_variants(n)) > 1])
def test_an_unknown_variant_is_refused_naming_the_known_ones(name):
    module = importlib.import_module(f"configs.{name}")
    with pytest.raises(ValueError, match=repr(module.VARIANTS[-1])):
        module.get_config("nosuch")
