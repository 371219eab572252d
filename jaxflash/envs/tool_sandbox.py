"""Running a tool call in the bubblewrap sandbox of model-written code.

Each call runs in a fresh sandbox (``jaxflash.rewards.sandbox``: own user, PID and
network namespaces, a read-only view of the interpreter only, a private tmpfs, an
empty environment, CPU / memory / process / output / wall-clock limits; nothing it
starts outlives the call). Inside it, the tool code still runs with a restricted set
of builtins, which keeps an honest model's code to computation; the sandbox is the
security boundary (the object graph reaches ``os`` through any builtin, and that
gets it nothing outside the sandbox).

Tools:
- ``python``: ``{"code": str}``; runs the code with restricted builtins (no
  ``open``, ``exec``, ``eval``, ``input``; ``import`` only of pure-computation
  modules such as ``math``, ``fractions``, ``itertools``); returns what it printed.
- ``calculator``: ``{"expression": str}``; evaluates an arithmetic expression
  (numbers, + - * / // % **, parentheses, ``math`` functions) from its syntax tree.

How a call ended is a ``ToolStatus`` (shown to the policy) and the sandbox's
``Outcome`` (``ToolResult.outcome``, counted by the environment). A sandbox per call
is the one place where ``envs`` starts a process: it is synchronous (the step waits
for it) and leaves nothing running.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging

from jaxflash.rewards.sandbox import Outcome, Sandbox
from jaxflash.rewards.sandbox import SandboxLimits as CodeLimits

log = logging.getLogger(__name__)

TOOL_NAMES = ("python", "calculator")

_RUNNER = r"""
import ast, json, math, sys
req = json.loads(sys.stdin.read())
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
# The tool's output goes straight to stdout (the sandbox bounds it); the result line
# goes to stderr, after everything the tool printed.
try:
    if req["tool"] == "python":
        exec(compile(req["args"]["code"], "<tool>", "exec"), {"__builtins__": SAFE})
    else:
        print(calc(ast.parse(req["args"]["expression"], mode="eval")))
    res = {"ok": True}
except BaseException as e:
    res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
sys.stdout.flush()
sys.stderr.write("\n" + json.dumps(res) + "\n")
"""


class ToolStatus(enum.StrEnum):
    """How one tool execution ended (all are shown to the policy, none is a crash)."""

    OK = "ok"
    ERROR = "error"  # the tool code raised (bad expression, ZeroDivisionError, ...)
    TIMEOUT = "timeout"  # killed after timeout_s wall seconds
    LIMIT = "limit"  # killed by a resource limit (CPU seconds, memory) or a signal


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolResult:
    """One tool execution: ``output`` is what it printed (cut to max_output_chars);
    ``outcome`` is how the sandboxed call ended (``Outcome``, counted)."""

    status: ToolStatus
    output: str
    error: str | None = None
    outcome: Outcome = Outcome.OK


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolLimits:
    """Limits of one tool execution.

    Attributes:
      timeout_s: wall-clock limit (> 0); CPU seconds are limited to ceil(timeout_s).
      memory_mb: address-space limit of the child in MiB (>= 64).
      max_output_chars: longer output is cut and marked (>= 16); output beyond
        ``OUTPUT_FACTOR`` times it (at least 64 KiB) stops the call (a flood).
      max_procs: processes the tool code may have (>= 1).
      allow_unsandboxed: run tools without isolation where bubblewrap cannot start
        (the code could then read files, use the network and signal processes).
    """

    timeout_s: float = 5.0
    memory_mb: int = 256
    max_output_chars: int = 2000
    max_procs: int = 8
    allow_unsandboxed: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"ToolLimits.timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise ValueError(f"ToolLimits.memory_mb must be >= 64, got {self.memory_mb}")
        if self.max_output_chars < 16:
            raise ValueError(
                f"ToolLimits.max_output_chars must be >= 16, got {self.max_output_chars}"
            )


OUTPUT_FACTOR = 8


def code_limits(limits: ToolLimits) -> CodeLimits:
    """The sandbox limits of one tool call."""
    return CodeLimits(
        wall_s=limits.timeout_s,
        memory_mb=limits.memory_mb,
        max_procs=limits.max_procs,
        max_output_bytes=max(1 << 16, OUTPUT_FACTOR * limits.max_output_chars),
        tmpfs_mb=1,
    )


@functools.cache
def tool_sandbox(allow_unsandboxed: bool = False) -> Sandbox:
    """The process's sandbox of tool calls (probed once; ``counts`` of all calls).

    With ``allow_unsandboxed`` and no working bubblewrap it warns once, in one line.
    """
    sandbox = Sandbox(allow_unsandboxed=allow_unsandboxed)
    if allow_unsandboxed and not sandbox.check().ok:
        log.warning("%s", sandbox.check().line)
    return sandbox


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [cut at {limit} chars]"


def run_tool(tool: str, args: dict[str, str], limits: ToolLimits) -> ToolResult:
    """Execute one tool call in a fresh sandbox (``tool_sandbox``).

    Args:
      tool: "python" (args {"code": str}) or "calculator" (args {"expression": str}).
      args: the validated arguments.
      limits: time, memory and output limits.

    Returns:
      ToolResult; the policy's mistakes (exceptions, endless loops, huge
      allocations) are statuses, not exceptions.

    Raises:
      ValueError: unknown tool or missing argument (callers validate first).
      OSError: the sandbox could not run (an infrastructure failure).
      RuntimeError: bubblewrap cannot start here and ``limits.allow_unsandboxed`` is
        False (``ToolUseEnv`` says so when it is built).
    """
    key = {"python": "code", "calculator": "expression"}.get(tool)
    if key is None:
        raise ValueError(f"run_tool: unknown tool {tool!r}; tools are {TOOL_NAMES}")
    if not isinstance(args.get(key), str):
        raise ValueError(f"run_tool: {tool} needs a string argument {key!r}, got {args!r}")
    request = json.dumps({"tool": tool, "args": {key: args[key]}})
    sandbox = tool_sandbox(limits.allow_unsandboxed)
    run = sandbox.run(_RUNNER, stdin=request, limits=code_limits(limits))
    output = _cut(run.stdout, limits.max_output_chars)
    if run.outcome == Outcome.SANDBOX_ERROR:
        raise OSError(f"tool sandbox failed: {run.detail} {run.stderr.strip()[-200:]}")
    if run.outcome == Outcome.TIMEOUT:
        return ToolResult(
            status=ToolStatus.TIMEOUT,
            output=output,
            error=f"timed out after {limits.timeout_s}s",
            outcome=run.outcome,
        )
    last = run.stderr.rstrip("\n").rsplit("\n", 1)[-1] if run.stderr else ""
    try:
        res = json.loads(last)
    except json.JSONDecodeError:
        res = None
    if run.outcome != Outcome.OK or not isinstance(res, dict):
        why = {
            Outcome.CPU_TIME: "CPU time limit",
            Outcome.MEMORY: f"memory limit: {limits.memory_mb} MiB",
            Outcome.OUTPUT_TOO_LONG: f"output limit: {code_limits(limits).max_output_bytes} bytes",
        }.get(run.outcome, f"{run.outcome.value}, {run.detail}")
        return ToolResult(
            status=ToolStatus.LIMIT, output=output, error=f"stopped ({why})", outcome=run.outcome
        )
    if res.get("ok"):
        return ToolResult(status=ToolStatus.OK, output=output, outcome=run.outcome)
    error = str(res.get("error", "error"))
    # The runner reports a MemoryError the tool code raised: the memory limit tripped.
    outcome = Outcome.MEMORY if error.startswith("MemoryError") else run.outcome
    return ToolResult(status=ToolStatus.ERROR, output=output, error=error, outcome=outcome)
