"""The code reward's verdict cannot be forged from inside the program it grades (issue 31).

One test per claim of docs/SANDBOX.md ("What the code reward's verdict is protected
against"). Every forgery here solves nothing; each scored 1.0 when the program and the
tests shared one interpreter (json.dumps patched: 164/164 HumanEval problems).
"""

from __future__ import annotations

import pytest

from jaxflash.rewards import code_reward
from jaxflash.rewards.code_reward import CodeReward, code_answer
from jaxflash.rewards.sandbox import Sandbox

CHECK = Sandbox().check()
needs_bwrap = pytest.mark.skipif(not CHECK.ok, reason=CHECK.line)

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
KEY = "5e5a3e" * 11  # a known per-call key (monkeypatched in) for the tests that look for it


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture(scope="module")
def reward():
    return CodeReward(wall_s=4.0, memory_mb=256)


# name: (program, tests). None of these programs computes add.
FORGERIES = {
    # The six lines: the grader's json.dumps marks every test passed.
    "json_dumps_patched": (
        "import json\n_dumps = json.dumps\n"
        "def dumps(obj, *a, **k):\n"
        "    if isinstance(obj, dict) and 'passed' in obj:\n"
        "        obj = dict(obj, passed=[True] * len(obj['passed']), error=None)\n"
        "    return _dumps(obj, *a, **k)\n"
        "json.dumps = dumps",
        ADD_TESTS,
    ),
    # Its output stream rewritten on the way out.
    "sys_stdout_rewrites_the_report": (
        "import sys\nclass W:\n"
        "    def __init__(self, f): self.f = f\n"
        "    def write(self, t): return self.f.write(t.replace('false', 'true')"
        ".replace('\"NameError\"', 'null'))\n"
        "    def flush(self): self.f.flush()\n"
        "sys.stdout = W(sys.stdout)",
        ADD_TESTS,
    ),
    # A builtin the tests use.
    "builtins_abs_patched": (
        "import builtins\nbuiltins.abs = lambda x: 0\ndef add(a, b):\n    return 42",
        ["assert abs(add(0.1, 0.2) - 0.3) < 1e-9", "assert abs(add(1, 1) - 2) < 1e-9"],
    ),
    # The grader's own functions: compile and exec of the tests.
    "compile_patched": (
        "import builtins\n_compile = builtins.compile\n"
        "builtins.compile = lambda s, name, *a, **k: "
        "_compile('pass' if name == 'test.py' else s, name, *a, **k)",
        ADD_TESTS,
    ),
    "exec_patched": ("import builtins\nbuiltins.exec = lambda *a, **k: None", ADD_TESTS),
    # The grader's state through its frame.
    "grader_frame_rewritten": (
        "import sys\nclass P(list):\n    def append(self, ok):\n        list.append(self, True)\n"
        "f = sys._getframe(1)\n"
        "if 'passed' in f.f_globals:\n    f.f_globals['passed'] = P()",
        ADD_TESTS,
    ),
    # __import__ hands the tests a fake module.
    "import_patched": (
        "import builtins, types\n_imp = builtins.__import__\n"
        "fake = types.SimpleNamespace(isclose=lambda *a, **k: True)\n"
        "builtins.__import__ = lambda n, *a, **k: fake if n == 'math' else _imp(n, *a, **k)\n"
        "def add(a, b):\n    return 7",
        ["import math\nassert math.isclose(add(0.1, 0.2), 0.3)"],
    ),
    # Objects with unusual comparison behaviour.
    "returns_an_always_equal_object": (
        "class A:\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return A()",
        ADD_TESTS,
    ),
    "returns_an_int_subclass_equal_to_everything": (
        "class I(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)",
        ADD_TESTS,
    ),
    # The secret read back (the request was on the program's stdin) and a report
    # written with it, then an exit before the grader's own.
    "secret_read_from_stdin": (
        "import json, os, sys\ntry:\n    sys.stdin.seek(0)\n"
        "    req = json.loads(sys.stdin.read())\n"
        "    body = json.dumps({'passed': [True] * 3, 'error': None})\n"
        "    sys.stdout.write('\\n' + req['nonce'] + body + '\\n')\n"
        "    sys.stdout.flush()\nexcept Exception:\n    pass\nos._exit(0)",
        ADD_TESTS,
    ),
    # Fake reports under guessed secrets, everywhere it can write: print, the original
    # stdout, fds 1 and 2 directly, every process's /proc/<pid>/fd/1.
    "fake_reports_written_everywhere": (
        "import hashlib, json, os, sys\n"
        "lines = []\nfor guess in ('0' * 64, 'f' * 64, '0' * 32):\n"
        "    body = json.dumps({'passed': '111', 'end': None})\n"
        "    mac = hashlib.blake2b(body.encode(), key=guess.encode(), digest_size=32).hexdigest()\n"
        "    old = guess + json.dumps({'passed': [True] * 3, 'error': None})\n"
        "    lines += [body + ' ' + mac, old]\n"
        "text = '\\n' + '\\n'.join(lines) + '\\n'\n"
        "print(text)\nsys.__stdout__.write(text)\nsys.__stdout__.flush()\n"
        "os.write(1, text.encode())\nos.write(2, text.encode())\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n        fd = os.open(f'/proc/{pid}/fd/1', os.O_WRONLY)\n"
        "        os.write(fd, text.encode())\n    except OSError:\n        pass",
        ADD_TESTS,
    ),
}


@needs_bwrap
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_program_that_attacks_the_grader_scores_zero(reward, name):
    program, tests = FORGERIES[name]
    result = reward(fenced(program), code_answer(tests))
    assert result.score == 0.0, result
    assert result.error is None


@needs_bwrap
@pytest.mark.parametrize(
    "body",
    [
        "sys.exit(0)",
        "os._exit(0)",
        "raise KeyboardInterrupt",
        "raise SystemExit(0)",
        "raise GeneratorExit",
        "raise Boom",
        "os.close(1); os.close(2); os.close(3); os.close(4); return a + b",
    ],
)
def test_exits_and_base_exceptions_in_the_middle_score_zero(reward, body):
    program = (
        "import os, sys\nclass Boom(BaseException):\n    pass\n"
        "calls = 0\ndef add(a, b):\n    global calls\n    calls += 1\n"
        f"    if calls == 2:\n        {body}\n    return 3"  # 3 passes test 1 only
    )
    result = reward(fenced(program), code_answer(ADD_TESTS))
    assert result.score <= 1 / 3, result
    assert result.score == 0.0 or result.components["outcome/ok"] == 1.0


@needs_bwrap
def test_the_task_prompts_helpers_are_the_tasks_not_the_programs(reward):
    # HumanEval/32's test calls the prompt's poly(); a program that redefines it to
    # return 0 passes with any answer when the tests use the program's poly.
    from jaxflash.data.code_tasks import humaneval_rows

    (row,) = [r for r in humaneval_rows() if r["meta"]["task_id"] == "HumanEval/32"]
    program = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0"
    assert reward(fenced(program), row["answer"]).score == 0.0


@needs_bwrap
def test_interrupting_the_grader_does_not_change_the_tests(reward):
    # SIGINT everything it sees, on every call: the grader ignores it (no
    # KeyboardInterrupt raised into a test, which would fail it).
    program = (
        "import os, signal\ndef add(a, b):\n    for pid in os.listdir('/proc'):\n"
        "        if pid.isdigit() and int(pid) != os.getpid():\n"
        "            try:\n                os.kill(int(pid), signal.SIGINT)\n"
        "            except OSError:\n                pass\n    return a + b"
    )
    assert reward(fenced(program), code_answer(ADD_TESTS)).score == 1.0


@needs_bwrap
def test_killing_the_grader_scores_zero_never_a_pass(reward):
    program = (
        "import os\nfor pid in os.listdir('/proc'):\n"
        "    if pid.isdigit() and int(pid) != os.getpid():\n"
        "        try:\n            os.kill(int(pid), 9)\n"
        "        except OSError:\n            pass\n"
        "def add(a, b):\n    return a + b"
    )
    result = reward(fenced(program), code_answer(ADD_TESTS))
    assert result.score == 0.0 and result.components.get("outcome/killed") == 1.0, result


SNOOP = r"""
import gc, os, re, sys
found = []
pat = re.compile(r"[0-9a-f]{32,}|assert[^\n]{0,80}")
def look(text):
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("latin-1")
    found.extend(pat.findall(text)[:200])
for o in gc.get_objects():
    items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()
    for v in list(items):
        if isinstance(v, (str, bytes)):
            look(v)
try:
    sys.stdin.seek(0)
    look(sys.stdin.read())
except Exception:
    pass
f = sys._getframe()
while f is not None:
    look(repr(f.f_locals)[:200000] + repr(f.f_globals)[:200000])
    f = f.f_back
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("cmdline", "environ"):
        try:
            look(open(f"/proc/{pid}/{name}", "rb").read())
        except OSError:
            pass
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        with open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if line.split()[1].startswith("rw") and hi - lo < 1 << 25:
                    try:
                        mem.seek(lo)
                        look(mem.read(hi - lo))
                    except (OSError, ValueError, OverflowError):
                        pass
    except OSError:
        pass
sys.stderr.write("FOUND " + repr(sorted(set(found)))[:400000] + "\n")
sys.stderr.flush()
"""


@needs_bwrap
def test_the_program_can_read_neither_the_key_nor_the_tests(monkeypatch):
    """Memory (its own objects, frames, /proc/<pid>/mem), stdin, /proc cmdline and environ
    of every process it sees: neither the per-call key nor the tests' source is there."""
    runs = []
    sandbox = Sandbox()

    class Recorder:
        def run(self, *args, **kwargs):
            runs.append(sandbox.run(*args, **kwargs))
            return runs[-1]

    monkeypatch.setattr(CodeReward, "sandbox", lambda self: Recorder())
    monkeypatch.setattr(code_reward.secrets, "token_hex", lambda n=32: KEY[: 2 * n])
    marker = "sesame-7c1f"
    tests = [f"assert add(1, 2) == 3, {marker!r}"]
    result = CodeReward(wall_s=8.0, memory_mb=256)(fenced(SNOOP), code_answer(tests))
    (run,) = runs
    assert "FOUND" in run.stderr, run  # it searched to the end
    assert KEY[:32] not in run.stderr and marker not in run.stderr
    assert result.score == 0.0


# --------------------------------------------------------- compatibility and limits


@needs_bwrap
@pytest.mark.parametrize(
    "program, tests, score",
    [
        # Its prints go to the sandbox's stderr; the tests run as before.
        (
            "def add(a, b):\n    print('{\"passed\": \"000\"}' * 100)\n    return a + b",
            ADD_TESTS,
            1.0,
        ),
        # The exception's builtin type reaches the test.
        (
            "def div(a, b):\n    return a / b",
            ["try:\n    div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    assert False"],
            1.0,
        ),
        # Plain data of every kind round-trips; a program-level value is read too.
        (
            "K = {'a': (1, 2.5, None)}\n"
            "def f(x):\n    return [x, {1, 2}, frozenset(), b'\\x00', 1j, 2**100]",
            ["assert f('s') == ['s', {1, 2}, frozenset(), b'\\x00', 1j, 2**100]",
             "assert K == {'a': (1, 2.5, None)}"],
            1.0,
        ),
        # Not plain data: an instance, a generator fail even where the test would
        # accept them (a limit: the tests see plain values only).
        ("def gen():\n    yield 1", ["assert list(gen()) == [1]"], 0.0),
        (
            "class P:\n    x = 1\ndef make():\n    return P()",
            ["assert make().x == 1"],
            0.0,
        ),
        # A limit: the tests see what a call returns, not what it did to its arguments.
        (
            "def sort_in_place(xs):\n    xs.sort()",
            ["xs = [3, 1]\nsort_in_place(xs)\nassert xs == [1, 3]"],
            0.0,
        ),
    ],
)  # fmt: skip
def test_plain_values_cross_and_nothing_else(reward, program, tests, score):
    assert reward(fenced(program), code_answer(tests)).score == score


def test_plain_data_round_trips_and_anything_else_is_refused():
    from jaxflash.rewards.code_grader import decode, encode

    values = [None, True, 0, -(2**70), 1.5, float("inf"), -0.0, 2j, "é\ud800", b"\x00",
              bytearray(b"x"), [1, (2, 3)], {"k": {4, 5}}, frozenset({6})]  # fmt: skip
    for v in values:
        out = decode(encode(v))
        assert out == v and type(out) is type(v)
    assert repr(decode(encode(float("nan")))) == "nan"
    assert encode(3) == ["i", "0x3"] and encode("a") == ["s", "a"]
    for bad in (object(), type("I", (int,), {})(1), iter([]), _deep(200)):
        with pytest.raises(TypeError):
            encode(bad)
    for bad in (3, "3", [], ["i", 3], ["l", "x"], ["x", []], ["d", [[1]]], ["S", [["l", []]]]):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)


def _deep(n):
    x: list = []
    for _ in range(n):
        x = [x]
    return x


def test_test_names_are_the_loaded_non_builtin_names_and_the_entry_point():
    steps = [("x = 1", False), ("assert add(x, len([])) == helper()", True)]
    assert code_reward.test_names(steps) == ["add", "helper", "x"]
    assert code_reward.test_names(steps, "sorted") == ["add", "helper", "sorted", "x"]
