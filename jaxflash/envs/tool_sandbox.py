"""Running a tool call in a child process with time, memory and file-size limits.

Each call starts a fresh ``python -I -S`` child (isolated mode, no site packages,
an empty environment, a temporary working directory), which sets its own resource
limits before it reads the tool code: address space (``memory_mb``), CPU seconds,
written file size (1 MiB), no core dumps. The parent waits at most ``timeout_s``
wall seconds and kills the child after that. Limits are set inside the child, not
in a ``preexec_fn``, because the runtime calls environments from worker threads and
``preexec_fn`` is unsafe with threads.

Tools:
- ``python``: ``{"code": str}``; runs the code with a restricted set of builtins (no
  ``open``, ``exec``, ``eval``, ``input``; ``import`` only of pure-computation
  modules such as ``math``, ``fractions``, ``itertools``); returns what it printed.
- ``calculator``: ``{"expression": str}``; evaluates an arithmetic expression
  (numbers, + - * / // % **, parentheses, ``math`` functions) from its syntax tree.

This is a resource boundary for honest mistakes (an endless loop, a huge
allocation), not a security boundary against hostile code; the restricted builtins
only keep a model's code to computation.

A child process per call is the one place where ``envs`` starts a process: it is
synchronous (the step waits for it) and leaves nothing running.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import subprocess
import sys
import tempfile

TOOL_NAMES = ("python", "calculator")

_RUNNER = r"""
import ast, contextlib, io, json, math, resource, sys
req = json.loads(sys.stdin.read())
mem = req["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (req["cpu_s"], req["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
ALLOWED_MODULES = {"math", "cmath", "fractions", "decimal", "itertools", "functools",
                   "statistics", "operator", "collections", "string", "re", "json", "random"}
def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level != 0 or name.split(".")[0] not in ALLOWED_MODULES:
        raise ImportError(f"import of {name!r} is not allowed")
    return __import__(name, globals, locals, fromlist, level)
SAFE = {k: getattr(__builtins__, k) for k in (
    "abs all any bin bool chr complex dict divmod enumerate filter float format frozenset "
    "hex int isinstance issubclass iter len list map max min next oct ord pow print range "
    "repr reversed round set slice sorted str sum tuple zip ArithmeticError AssertionError "
    "Exception IndexError KeyError OverflowError StopIteration TypeError ValueError "
    "ZeroDivisionError").split()}
SAFE["__import__"] = _import
BIN = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b,
       ast.Mod: lambda a, b: a % b, ast.Pow: lambda a, b: a ** b}
FUNCS = {n: getattr(math, n) for n in ("sqrt log log10 log2 exp sin cos tan floor ceil "
                                      "factorial gcd").split()}
FUNCS.update(abs=abs, round=round, pi=math.pi, e=math.e)
def calc(node):
    if isinstance(node, ast.Expression):
        return calc(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in BIN:
        return BIN[type(node.op)](calc(node.left), calc(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in (ast.UAdd, ast.USub):
        v = calc(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.Name) and node.id in ("pi", "e"):
        return FUNCS[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in FUNCS and not node.keywords):
        return FUNCS[node.func.id](*[calc(a) for a in node.args])
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        if req["tool"] == "python":
            exec(compile(req["args"]["code"], "<tool>", "exec"), {"__builtins__": SAFE})
        else:
            print(calc(ast.parse(req["args"]["expression"], mode="eval")))
    res = {"ok": True, "output": out.getvalue()}
except BaseException as e:
    res = {"ok": False, "output": out.getvalue(), "error": f"{type(e).__name__}: {e}"}
sys.__stdout__.write("\n" + json.dumps(res))
"""


class ToolStatus(enum.StrEnum):
    """How one tool execution ended (all are shown to the policy, none is a crash)."""

    OK = "ok"
    ERROR = "error"  # the tool code raised (bad expression, ZeroDivisionError, ...)
    TIMEOUT = "timeout"  # killed after timeout_s wall seconds
    LIMIT = "limit"  # killed by a resource limit (CPU seconds, memory) or a signal


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolResult:
    """One tool execution: ``output`` is what it printed (cut to max_output_chars)."""

    status: ToolStatus
    output: str
    error: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits of one tool execution.

    Attributes:
      timeout_s: wall-clock limit (> 0); CPU seconds are limited to ceil(timeout_s).
      memory_mb: address-space limit of the child in MiB (>= 64).
      max_output_chars: longer output is cut and marked (>= 16).
    """

    timeout_s: float = 5.0
    memory_mb: int = 256
    max_output_chars: int = 2000

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"SandboxLimits.timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise ValueError(f"SandboxLimits.memory_mb must be >= 64, got {self.memory_mb}")
        if self.max_output_chars < 16:
            raise ValueError(
                f"SandboxLimits.max_output_chars must be >= 16, got {self.max_output_chars}"
            )


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [cut at {limit} chars]"


def run_tool(tool: str, args: dict[str, str], limits: SandboxLimits) -> ToolResult:
    """Execute one tool call in a fresh limited child process.

    Args:
      tool: "python" (args {"code": str}) or "calculator" (args {"expression": str}).
      args: the validated arguments.
      limits: time, memory and output limits.

    Returns:
      ToolResult; the policy's mistakes (exceptions, endless loops, huge
      allocations) are statuses, not exceptions.

    Raises:
      ValueError: unknown tool or missing argument (callers validate first).
      OSError: the child could not be started (an infrastructure failure).
    """
    key = {"python": "code", "calculator": "expression"}.get(tool)
    if key is None:
        raise ValueError(f"run_tool: unknown tool {tool!r}; tools are {TOOL_NAMES}")
    if not isinstance(args.get(key), str):
        raise ValueError(f"run_tool: {tool} needs a string argument {key!r}, got {args!r}")
    request = json.dumps(
        {
            "tool": tool,
            "args": {key: args[key]},
            "memory_mb": limits.memory_mb,
            "cpu_s": max(1, int(-(-limits.timeout_s // 1))),
        }
    )
    with tempfile.TemporaryDirectory(prefix="jaxflash_tool_") as cwd:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _RUNNER],
                input=request,
                capture_output=True,
                text=True,
                timeout=limits.timeout_s,
                cwd=cwd,
                env={},
                check=False,
            )
        except subprocess.TimeoutExpired:
            return ToolResult(
                status=ToolStatus.TIMEOUT, output="", error=f"timed out after {limits.timeout_s}s"
            )
    last = proc.stdout.rstrip("\n").rsplit("\n", 1)[-1] if proc.stdout else ""
    try:
        res = json.loads(last)
    except json.JSONDecodeError:
        res = None
    if proc.returncode != 0 or not isinstance(res, dict):
        why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else "crashed"
        return ToolResult(
            status=ToolStatus.LIMIT,
            output="",
            error=f"{why} (CPU or memory limit: {limits.memory_mb} MiB)",
        )
    output = _cut(res.get("output", ""), limits.max_output_chars)
    if res.get("ok"):
        return ToolResult(status=ToolStatus.OK, output=output)
    return ToolResult(status=ToolStatus.ERROR, output=output, error=res.get("error", "error"))
