"""No part of the rollout writes another object's fields (read from the source with ``ast``).

Every attribute assignment in ``jaxflash/runtime/rollout/`` (``x.a = ``, ``x.a += ``,
``x.a: T = ``, inside tuples too) must have ``self`` as its base and one level of
attribute: a part changes what it owns, and asks the owner of anything else through
a method (``admission.halt()``, ``assembler.reconfigure(...)``). ``self.x.a = `` is
refused too: ``x`` is another object. Messages that travel (``Sample``, ``Batch``)
are copied with ``dataclasses.replace`` instead of edited in place.
"""

from __future__ import annotations

import ast
import pathlib

from tests.paths import REPO

ROLLOUT = pathlib.Path(REPO) / "jaxflash" / "runtime" / "rollout"


def foreign_writes(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: target`` of every attribute assignment not of the form ``self.a``."""
    bad = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets += t.elts
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif isinstance(t, ast.Attribute):
                own = isinstance(t.value, ast.Name) and t.value.id == "self"
                if not own:
                    bad.append(f"{filename}:{t.lineno}: {ast.unparse(t)}")
    return bad


def test_no_rollout_module_writes_another_objects_fields():
    modules = sorted(ROLLOUT.glob("*.py"))
    assert len(modules) > 10  # the rollout room is where it was
    bad = [w for p in modules for w in foreign_writes(p.read_text(), p.name)]
    assert bad == []


def test_the_check_finds_planted_writes():
    planted = """
class Scheduler:
    def reconfigure(self, b, alpha):
        self.b = b  # its own: fine
        self.assembler.alpha = alpha
        admission.capacity += 1
        self.x, (sample.reward, y) = 1, (2, 3)
        run.call: int = 4
        items[0] = 5  # a subscript, not an attribute
"""
    assert foreign_writes(planted) == [
        "<string>:5: self.assembler.alpha",
        "<string>:6: admission.capacity",
        "<string>:7: sample.reward",
        "<string>:8: run.call",
    ]
