"""The code reward's grader: the program under test and its tests in separate processes.

This file's text is the program the code reward runs in the sandbox (standard library
only), in two roles:

- **the grader** (``grade``, the sandbox's main process) reads the request (the tests,
  the program, the per-call key), makes itself non-dumpable, starts the program's
  process, runs the tests in its own interpreter against stand-ins for the program's
  names, and writes the verdict with a MAC (keyed BLAKE2b) under the per-call key;
- **the program's process** (``serve``, a fresh interpreter: exec'd, so it holds none
  of the grader's memory -- no key, no tests) runs the program, then answers calls:
  a name and arguments in, the function's return value or the name of the exception
  it raised out.

Why: a program in the tests' interpreter can change what they compute (patch
``json.dumps``, builtins, the grader's functions; return an object equal to
everything; ctypes). Here nothing crosses from the program's process to the grader but
**plain data** -- None, bool, int, float, complex, str, bytes, bytearray and lists,
tuples, dicts, sets, frozensets of them -- decoded by the grader into builtin objects
whose ``==`` is the builtin one, plus exception *names*. The program cannot reach the
grader: non-dumpable, so no ``ptrace``, ``/proc/<pid>/mem`` or ``/proc/<pid>/fd``; its
stdout and stderr are the sandbox's stderr, never the verdict's stdout; and a line on
stdout counts only with the key's MAC. What it can still do: kill or stall the grader
(score 0: no verdict, or the wall-clock limit).

The program's process is a grandchild of the grader through a small reaper (its
``os.getppid()``), which reports how it ended (``memory``, ``cpu_time``, ``killed``,
``error``) and kills it when the grader closes its pipe or dies.
"""

from __future__ import annotations

import builtins
import json
import os
import select
import signal
import sys

MEMORY_EXIT = 86  # the program's process after a MemoryError (the sandbox's value)
GRADER_BROKEN = 87  # the grader could not make itself non-dumpable: no verdict
MAX_FRAME = 1 << 22  # bytes of one message between the processes (4 MiB)
MAX_DEPTH = 100  # nesting of one plain value
_PR_SET_DUMPABLE = 4


class CandidateError(Exception):
    """A call of the program's function that gave no plain value (in the tests)."""


# ------------------------------------------------------------------ plain data


def encode(value, depth=0):
    """A plain value as JSON-able tagged data (exact builtin types only).

    Raises:
      TypeError: a value that is not plain data (or nested deeper than MAX_DEPTH).
    """
    t = type(value)
    if value is None or t is bool:
        return value
    if depth > MAX_DEPTH:
        raise TypeError("nested too deep")
    if t is int:
        return ["i", hex(value)]
    if t is float:
        return ["f", value.hex()]
    if t is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if t is str:
        return ["s", value]
    if t is bytes or t is bytearray:
        return ["b" if t is bytes else "B", value.hex()]
    if t is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}.get(t)
    if tag is None:
        raise TypeError(f"a {t.__name__} is not plain data")
    return [tag, [encode(v, depth + 1) for v in value]]


_ATOMS = {
    "i": lambda s: int(s, 16),
    "f": float.fromhex,
    "s": lambda s: s,
    "b": bytes.fromhex,
    "B": lambda s: bytearray(bytes.fromhex(s)),
}
_SEQS = {"l": list, "t": tuple, "S": set, "F": frozenset}


def _bad():
    raise ValueError("malformed plain value")


def decode(data, depth=0):
    """Builtin objects from ``encode``'s data (the only way a value enters the grader).

    Raises:
      ValueError, TypeError (and the like): data ``encode`` does not produce.
    """
    if data is None or data is True or data is False:
        return data
    if type(data) is not list or not data or type(data[0]) is not str or depth > MAX_DEPTH:
        _bad()
    tag = data[0]
    if tag in _ATOMS and len(data) == 2 and type(data[1]) is str:
        return _ATOMS[tag](data[1])
    if tag == "c" and len(data) == 3 and type(data[1]) is str and type(data[2]) is str:
        return complex(float.fromhex(data[1]), float.fromhex(data[2]))
    if len(data) != 2 or type(data[1]) is not list:
        _bad()
    if tag == "d":
        pairs = [p if type(p) is list and len(p) == 2 else _bad() for p in data[1]]
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in pairs}
    if tag in _SEQS:
        return _SEQS[tag](decode(v, depth + 1) for v in data[1])
    return _bad()


# -------------------------------------------------------------------- messages


def _write_frame(fd, obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd):
    """The next message, or None at end of file. Raises ValueError on a malformed one."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > MAX_FRAME:
        raise ValueError(f"a message of {n} bytes")
    data = _read_exact(fd, n)
    return None if data is None else json.loads(data)


def _mac(key, body):
    """Keyed BLAKE2b (a MAC by design) of ``body`` under ``key`` (<= 64 bytes), hex."""
    try:
        from _blake2 import blake2b  # noqa: PLC0415  (not hashlib: its OpenSSL load costs ~2 ms)
    except ImportError:
        from hashlib import blake2b  # noqa: PLC0415
    return blake2b(body.encode(), key=key, digest_size=32).hexdigest()


def _same(a, b):
    import hmac  # noqa: PLC0415  (the training process's side only)

    return hmac.compare_digest(a.encode(), b.encode())


def verdict_line(key, passed, end):
    """The grader's report: JSON, a space, its MAC under ``key`` (bytes, <= 64)."""
    body = json.dumps({"passed": "".join("1" if p else "0" for p in passed), "end": end})
    return f"{body} {_mac(key, body)}"


def read_verdict(stdout, key, n_tests):
    """The last line of ``stdout`` that carries a valid MAC under ``key``, checked.

    Returns:
      ({"passed": [bool, ...], "end": None | str}) or None when no line verifies.
    """
    for line in reversed(stdout.splitlines()):
        body, _, mac = line.rpartition(" ")
        if len(mac) != 64 or not _same(mac, _mac(key, body)):
            continue
        report = json.loads(body)
        passed = report["passed"]
        if len(passed) > n_tests or set(passed) - {"0", "1"}:
            return None
        return {"passed": [c == "1" for c in passed], "end": report["end"]}
    return None


# ------------------------------------------------------- the program's process


def serve(req_fd, ans_fd):
    """The program's process: run the program, report the asked names, answer calls."""
    sys.argv = ["main.py"]
    msg = _read_frame(req_fd)
    g = {"__name__": "__main__"}
    try:
        exec(compile(msg["program"], "solution.py", "exec"), g)  # noqa: S102
    except MemoryError:
        os._exit(MEMORY_EXIT)
    except BaseException as e:  # noqa: BLE001  (a SystemExit too: it ended before the tests)
        _write_frame(ans_fd, {"error": type(e).__name__})
        os._exit(1)
    names = {}
    for name in msg["names"]:
        if name in g:
            if callable(g[name]):
                names[name] = "f"
            else:
                try:
                    names[name] = ["v", encode(g[name])]
                except TypeError:
                    pass
    _write_frame(ans_fd, {"names": names})
    while True:
        call = _read_frame(req_fd)
        if call is None:
            os._exit(0)
        try:
            args = [decode(a) for a in call["args"]]
            kwargs = {k: decode(v) for k, v in call["kwargs"]}
            result = g[call["name"]](*args, **kwargs)
        except MemoryError:
            os._exit(MEMORY_EXIT)
        except BaseException as e:  # noqa: BLE001  (reported by name; the tests decide)
            reply = {"raise": type(e).__name__}
        else:
            try:
                reply = {"value": encode(result)}
            except TypeError as e:
                reply = {"unplain": str(e)}
        _write_frame(ans_fd, reply)


# ------------------------------------------------------------------ the grader


def _undumpable():
    """PR_SET_DUMPABLE 0: no ptrace, /proc/<pid>/mem or /proc/<pid>/fd of this process
    for a process of the same user without CAP_SYS_PTRACE (the program's)."""
    try:
        import ctypes  # noqa: PLC0415

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (ImportError, OSError, AttributeError):
        return False


def _exception(name):
    """The builtin Exception class called ``name`` (an instance), else a CandidateError."""
    cls = getattr(builtins, name, None) if type(name) is str and name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(f"{name} raised by the program")
        except Exception:  # noqa: BLE001  (a class that needs more arguments)
            pass
    return CandidateError(f"the program raised {name!r}")


_ENDS = {MEMORY_EXIT: "memory", -signal.SIGXCPU: "cpu_time"}


class _Program:
    """The program's process, seen from the grader: start, load, call, end."""

    def __init__(self, source):
        sys.stdout.flush()
        sys.stderr.flush()
        req_r, self.req_w = os.pipe()
        self.ans_r, ans_w = os.pipe()
        st_r, st_w = os.pipe()
        kill_r, self.kill_w = os.pipe()
        reaper = os.fork()
        if reaper == 0:  # never returns
            self._reap(source, req_r, ans_w, st_w, kill_r)
        for fd in (req_r, ans_w, st_w, kill_r):
            os.close(fd)
        self.status = os.fdopen(st_r, "rb")
        self.end = None  # how the program's process ended, when it did before the tests

    def _reap(self, source, req_r, ans_w, st_w, kill_r):
        try:
            pid = os.fork()
            if pid == 0:
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                os.dup2(2, 1)  # its prints: the sandbox's stderr, never the verdict's stdout
                os.set_inheritable(req_r, True)
                os.set_inheritable(ans_w, True)
                exe = sys.executable
                os.execv(exe, [exe, "-I", "-S", "-c", source, "serve", str(req_r), str(ans_w)])
            for fd in (0, 1, 2, req_r, ans_w, self.req_w, self.ans_r, self.kill_w):
                os.close(fd)
            try:
                pidfd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pidfd = None
            watch = [kill_r] if pidfd is None else [kill_r, pidfd]
            while True:
                ready = select.select(watch, [], [], None if pidfd is not None else 0.05)[0]
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if kill_r in ready:  # the grader is done (or dead): not yet reaped, so safe
                    os.kill(pid, signal.SIGKILL)
                    status = os.waitpid(pid, 0)[1]
                    break
            os.write(st_w, b"%d\n" % os.waitstatus_to_exitcode(status))
        finally:
            os._exit(0)

    def _gone(self, protocol_error=False):
        """The process stopped answering: end it and say how it ended."""
        self.close()
        line = self.status.readline()
        code = int(line) if line.strip().lstrip(b"-").isdigit() else None
        if protocol_error or code is None:
            self.end = "error"
        else:
            self.end = _ENDS.get(code, "killed" if code < 0 else "error")

    def _ask(self, msg):
        if self.end is not None:
            return None
        try:
            _write_frame(self.req_w, msg)
            reply = _read_frame(self.ans_r)
        except OSError:
            reply = None
        except ValueError:
            self._gone(protocol_error=True)
            return None
        if reply is None:
            self._gone()
        elif type(reply) is not dict:
            self._gone(protocol_error=True)
            return None
        return reply

    def load(self, program, names):
        """Run the program; {name: callable stand-in or plain value} of ``names`` it defines."""
        reply = self._ask({"program": program, "names": names})
        if reply is None:
            return {}
        if "error" in reply or type(reply.get("names")) is not dict:
            self._gone(protocol_error=True)
            return {}
        found = {}
        for name, spec in reply["names"].items():
            if name not in names:
                continue
            if spec == "f":
                found[name] = _Remote(self, name)
            elif type(spec) is list and len(spec) == 2 and spec[0] == "v":
                try:
                    found[name] = decode(spec[1])
                except Exception:  # noqa: BLE001,S110  (not plain: the name stays undefined)
                    pass
        return found

    def call(self, name, args, kwargs):
        msg = {
            "name": name,
            "args": [encode(a) for a in args],  # TypeError: the test passed non-plain data
            "kwargs": [[k, encode(v)] for k, v in kwargs.items()],
        }
        reply = self._ask(msg)
        if reply is None:
            raise CandidateError("the program's process ended")
        if "value" in reply:
            try:
                return decode(reply["value"])
            except Exception:  # noqa: BLE001
                raise CandidateError("the program returned malformed data") from None
        if "raise" in reply:
            raise _exception(reply["raise"])
        raise CandidateError(f"the program returned {reply.get('unplain', 'no plain value')}")

    def close(self):
        for fd in (self.req_w, self.kill_w):
            try:
                os.close(fd)
            except OSError:
                pass


class _Remote:
    """A function of the program, as the tests see it: arguments out, a plain value in."""

    __slots__ = ("_name", "_program")

    def __init__(self, program, name):
        self._program = program
        self._name = name

    def __call__(self, *args, **kwargs):
        return self._program.call(self._name, args, kwargs)

    def __repr__(self):
        return f"<the program's {self._name}>"


def grade():
    """The grader: read the request on stdin, run the tests, write the verdict on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no KeyboardInterrupt sent into the tests
    if not _undumpable():
        sys.exit(GRADER_BROKEN)
    req = json.loads(sys.stdin.read())
    key = req["key"].encode()
    entry = req["entry_point"]
    ns = {"__name__": "__main__"}
    trusted = set()
    if req["prefix"]:  # the task's own code (HumanEval's helpers): the tests use these
        try:
            exec(compile(req["prefix"], "prefix.py", "exec"), ns)  # noqa: S102
            trusted = set(ns) - {"__name__", "__builtins__", entry}
            ns.pop(entry, None)
        except BaseException:  # noqa: BLE001
            ns = {"__name__": "__main__"}
    names = [
        n for n in req["names"] if n not in trusted and (n == entry or not hasattr(builtins, n))
    ]
    program = _Program(req["serve"])
    ns.update(program.load(req["program"], names))
    passed = []
    if program.end is None:
        for source, is_test in req["steps"]:
            try:
                exec(compile(source, "test.py", "exec"), ns)  # noqa: S102
                ok = True
            except BaseException:  # noqa: BLE001
                ok = False
            if is_test:
                passed.append(ok)
            elif not ok:
                break
    program.close()
    sys.stdout.flush()
    line = "\n" + verdict_line(key, passed, program.end) + "\n"
    view = memoryview(line.encode())
    while view:
        view = view[os.write(1, view) :]


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        grade()
