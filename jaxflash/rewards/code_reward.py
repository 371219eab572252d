"""Code correctness: the response's program run against the task's tests, in the sandbox.

The program is the content of the response's *last* fenced block opened with
```` ```python ```` (or ```` ```py ````; a block cut off before its closing fence runs to
the end of the response), else the whole response. A task that gives an
``entry_point`` and a ``prefix`` (HumanEval: the signature and docstring) treats a
program that does not define ``def <entry_point>`` as the *body* of that prefix
(completion style), so both "the whole function" and "just the body" work.

The answer string of a code row is JSON (``code_answer``)::

    {"tests": ["assert add(1, 2) == 3", ...] | "<python source>",
     "entry_point": "add", "prefix": "def add(a, b):\\n"}   # the last two optional

Tests as a list: each string is one test. Tests as source: each top-level statement
that contains an ``assert`` is one test and the others are set-up, run in order; a
source that defines ``check(candidate)`` (HumanEval) is read as its module-level
set-up, ``candidate = <entry_point>``, then the statements of ``check``'s body.
A test passes when it runs without raising; a set-up statement that raises fails
the tests after it.

Score = fraction of tests passed; components ``correct`` (1.0 iff every test
passed), ``tests_passed`` (the fraction), ``program_found`` (a fenced block was
found) and ``outcome/<outcome>`` = 1.0 for how the run ended: ``ok`` (the tests
ran), ``error`` (the program raised before the tests -- a syntax error, say -- or its
process exited before they were done), ``memory`` / ``cpu_time`` / ``killed`` (how
its process ended before they were done, score 0), or the sandbox's ``timeout``,
``cpu_time``, ``memory``, ``output_too_long``, ``killed``. All of those are the policy's
outcomes (score 0 when no test ran), not reward errors; ``error`` is set only for a
malformed answer string or a sandbox that could not run.

The tests run in the grader's interpreter, the program in another process of the same
sandbox; only plain data (and exception names) cross from it, and only a report with
the per-call key's MAC counts (``code_grader``; what is and is not protected:
docs/SANDBOX.md).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import json
import pathlib
import re
import secrets
from typing import Any

from jaxflash.rewards import code_grader
from jaxflash.rewards.base import RewardResult, register
from jaxflash.rewards.sandbox import Outcome, Sandbox, SandboxLimits

_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)

# The grader's program: code_grader.py's own text (it runs inside the sandbox).
_GRADER = pathlib.Path(code_grader.__file__).read_text()
# The program's process runs only the part above the grader's (less to compile there).
_SERVE = (
    _GRADER[: _GRADER.index("\ndef _undumpable")]
    + '\nif __name__ == "__main__":\n    serve(int(sys.argv[2]), int(sys.argv[3]))\n'
)


def extract_program(response_text: str) -> tuple[str, bool]:
    """(program, whether it came from a fenced block): the last ```python block, else all."""
    blocks = _FENCE.findall(response_text)
    if blocks:
        return blocks[-1], True
    return response_text, False


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def grading_steps(tests: str | list[str], entry_point: str = "") -> list[tuple[str, bool]]:
    """The grader's steps: (source, is_test) in order (module docstring).

    Raises:
      ValueError: tests that do not parse, or that hold no test.
    """
    if not isinstance(tests, str | list):
        raise ValueError(
            f"tests must be a non-empty list of strings or a source string, "
            f"got a {type(tests).__name__}"
        )
    if isinstance(tests, list):
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("tests must be a non-empty list of strings or a source string")
        for i, test in enumerate(tests):  # each is one test: it must parse and assert
            try:
                nodes = ast.parse(test).body
            except SyntaxError as e:
                raise ValueError(f"test {i} does not parse: {e}") from None
            if not any(_has_assert(n) for n in nodes):
                raise ValueError(f"test {i} holds no assert: {test[:60]!r}")
        return [(t, True) for t in tests]
    try:
        module = ast.parse(tests)
    except SyntaxError as e:
        raise ValueError(f"tests do not parse: {e}") from None
    steps: list[tuple[str, bool]] = []
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if checks and entry_point:
        steps += [(ast.unparse(n), False) for n in module.body if n is not checks[-1]]
        steps.append((f"candidate = {entry_point}", False))
        body = checks[-1].body
    else:
        body = module.body
    steps += [(ast.unparse(n), _has_assert(n)) for n in body]
    if not any(is_test for _, is_test in steps):
        raise ValueError("tests hold no assert")
    return steps


def test_names(steps: list[tuple[str, bool]], entry_point: str = "") -> list[str]:
    """The names the tests read that the program may define (sorted).

    Every name the tests load, less dunders and builtins (the tests' builtins are the
    grader's own), plus the entry point.
    """
    names = {
        node.id
        for source, _ in steps
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    names = {n for n in names if not n.startswith("__") and not hasattr(builtins, n)}
    return sorted(names | ({entry_point} if entry_point else set()))


def _binds(source: str) -> set[str]:
    """Top-level names a source binds (defs, classes, imports, assignments)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names.update(
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            )
    return names


def code_answer(tests: str | list[str], *, entry_point: str = "", prefix: str = "") -> str:
    """The answer string of a code row (checked: the tests parse and hold a test).

    Raises:
      ValueError: bad tests (``grading_steps``).
    """
    grading_steps(tests, entry_point)
    payload: dict[str, Any] = {"tests": tests}
    if entry_point:
        payload["entry_point"] = entry_point
    if prefix:
        payload["prefix"] = prefix
    return json.dumps(payload)


@functools.cache
def _sandbox(allow_unsandboxed: bool) -> Sandbox:
    return Sandbox(allow_unsandboxed=allow_unsandboxed)


def _result(score: float, found: bool, outcome: str, error: str | None = None) -> RewardResult:
    return RewardResult(
        score=score,
        components={
            "correct": float(score == 1.0),
            "tests_passed": score,
            "program_found": float(found),
            f"outcome/{outcome}": 1.0,
        },
        error=error,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeReward:
    """Fraction of the task's tests the response's program passes, run in the sandbox.

    A class so the limits are stated and picklable into reward workers; the
    registered "code" reward is ``CodeReward()``.

    Attributes:
      wall_s: wall-clock seconds of one run, program and tests together (> 0; keep
        it under ``reward.timeout_s`` so the sandbox, not the pool, stops it).
      memory_mb: address space in MiB (>= 64).
      max_procs: processes (>= 1).
      max_output_bytes: what the program may print (>= 64).
      allow_unsandboxed: where bubblewrap cannot start, run the program WITHOUT
        isolation (it could read files, use the network, signal processes).

    Returns (when called with ``(response_text, answer)``): see the module docstring.

    Raises:
      TypeError: response_text or answer is not a str.
      RuntimeError: bubblewrap cannot start and ``allow_unsandboxed`` is False.
    """

    wall_s: float = 5.0
    memory_mb: int = 512
    max_procs: int = 8
    max_output_bytes: int = 1 << 20
    allow_unsandboxed: bool = False

    def limits(self) -> SandboxLimits:
        return SandboxLimits(
            wall_s=self.wall_s,
            memory_mb=self.memory_mb,
            max_procs=self.max_procs,
            max_output_bytes=self.max_output_bytes,
        )

    def __post_init__(self) -> None:
        self.limits()  # raises ValueError naming a bad limit

    def sandbox(self) -> Sandbox:
        """The process's sandbox of this reward (probed once)."""
        return _sandbox(self.allow_unsandboxed)

    def __call__(self, response_text: str, answer: str) -> RewardResult:
        if not isinstance(response_text, str) or not isinstance(answer, str):
            raise TypeError("CodeReward takes (response_text: str, answer: str)")
        try:
            payload = json.loads(answer)
            entry_point = payload.get("entry_point", "")
            steps = grading_steps(payload["tests"], entry_point)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return _result(0.0, False, "error", f"answer is not a code payload ({e})")
        program, found = extract_program(response_text)
        if (
            entry_point
            and payload.get("prefix")
            and not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", program, re.MULTILINE)
        ):
            program = payload["prefix"] + program  # the response is the body
        key = secrets.token_hex(32)
        names = test_names(steps, entry_point)
        # The prompt's code runs in the grader only when the tests use a name it binds
        # (HumanEval/32's poly): its imports (typing) cost the grader ~3 ms otherwise.
        prefix = payload.get("prefix", "") if entry_point else ""
        if not (_binds(prefix) - {entry_point}) & set(names):
            prefix = ""
        request = json.dumps(
            {
                "key": key,
                "steps": steps,
                "program": program,
                "prefix": prefix,
                "entry_point": entry_point,
                "names": names,
                "serve": _SERVE,
            }
        )
        run = self.sandbox().run(_GRADER, stdin=request, limits=self.limits())
        if run.outcome == Outcome.SANDBOX_ERROR:
            return _result(0.0, found, run.outcome.value, f"sandbox failed: {run.detail}")
        if run.exit_code == code_grader.GRADER_BROKEN:
            return _result(0.0, found, Outcome.ERROR.value, _BROKEN)
        if run.outcome != Outcome.OK:
            return _result(0.0, found, run.outcome.value)
        n_tests = sum(is_test for _, is_test in steps)
        report = code_grader.read_verdict(run.stdout, key.encode(), n_tests)
        if report is None:
            return _result(0.0, found, Outcome.ERROR.value)
        if report["end"] is not None:  # the program's process ended before the tests did
            return _result(0.0, found, report["end"])
        return _result(sum(report["passed"]) / n_tests, found, Outcome.OK.value)


_BROKEN = "the grader could not make itself non-dumpable (prctl via ctypes) and gave no verdict"


code_reward = register("code")(CodeReward())
