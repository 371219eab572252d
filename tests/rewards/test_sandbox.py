"""The sandbox of model-written code: escapes through the tool env and the code reward.

Each escape runs once through the tool environment's python tool and once as the
program of the code reward. Every one must be contained (its observation says so,
checked on the host for the tool and by the task's test for the reward), counted
with its outcome, and leave nothing running: host-side checks look for processes
carrying the call's token, for connections to a loopback listener, and that this
process is alive.
"""

import json
import os
import secrets
import socket

import pytest

from jaxflash.envs.tool_env import ToolUseConfig, ToolUseEnv
from jaxflash.rewards.code_reward import CodeReward, code_answer
from jaxflash.rewards.sandbox import Sandbox

CHECK = Sandbox().check()
pytestmark = pytest.mark.skipif(not CHECK.ok, reason=CHECK.line)

# os and the real builtins through the object graph: works under the tool's restricted
# builtins as well as in a plain program.
PRELUDE = """
G = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close"][0]
G = G.__init__.__globals__
os, sys, B = G["sys"].modules["os"], G["sys"], G["__builtins__"]
"""
# A sleeper that would outlive the call, found on the host by TOKEN in its argv.
SLEEPER = 'os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", TOKEN])'
ALLOWED_ROOT = {"dev", "lib", "lib64", "proc", "tmp", "usr"}


def escapes(secret_path, secret, port):
    """name -> (code that sets and prints OBS, assert on OBS, tool outcomes, reward outcomes)."""
    host_passwd = open("/etc/passwd").readline().strip()
    read = f"""
OBS = []
for path in ({secret_path!r}, "/etc/passwd"):
    try:
        OBS.append(B["open"](path).read())
    except Exception as e:
        OBS.append(e.__class__.__name__)
OBS = str(OBS)
"""
    return {
        "object_graph_reaches_os": (
            "OBS = str(sorted(os.listdir('/')))",
            f"assert set(eval(OBS)) <= {ALLOWED_ROOT!r}, OBS",
            {"ok"},
            {"ok"},
        ),
        "read_file_outside": (
            read,
            f"assert {secret!r} not in OBS and {host_passwd!r} not in OBS, OBS",
            {"ok"},
            {"ok"},
        ),
        "socket_to_loopback_listener": (
            f"""
s = B["__import__"]("socket").socket()
s.settimeout(1.0)
try:
    s.connect(("127.0.0.1", {port}))
    OBS = "connected"
except Exception as e:
    OBS = "refused " + e.__class__.__name__
""",
            "assert OBS.startswith('refused'), OBS",
            {"ok"},
            {"ok"},
        ),
        "forked_process_outlives_the_call": (
            f"""
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        {SLEEPER}
    os._exit(0)
OBS = "forked"
""",
            "assert OBS == 'forked'",
            {"ok"},
            {"ok"},
        ),
        "signal_the_parent": (
            """
sent = []
for pid in (os.getppid(), 1):
    try:
        os.kill(pid, 9)
        sent.append(pid)
    except Exception as e:
        sent.append(e.__class__.__name__)
OBS = "sent " + str(sent)
""",
            "assert OBS.startswith('sent')",
            {"ok"},
            {"ok"},
        ),
        "fork_bomb": (
            f"""
n = 0
try:
    while n < 10000:
        if os.fork() == 0:
            {SLEEPER}
        n += 1
except Exception as e:
    pass
OBS = "bounded at " + str(n)
""",
            "assert OBS.startswith('bounded at') and int(OBS.split()[-1]) < 16, OBS",
            {"ok"},
            {"ok"},
        ),
        "memory_exhaustion": ("x = [0] * (1 << 33)\nOBS = 'allocated'", "", {"memory"}, {"memory"}),
        "endless_loop": (
            "while True:\n    pass",
            "",
            {"timeout", "cpu_time"},
            {"timeout", "cpu_time"},
        ),
        "output_flood": (
            "while True:\n    print('x' * 4096)",
            "",
            {"output_too_long"},
            {"output_too_long"},
        ),
    }


NAMES = [
    "object_graph_reaches_os",
    "read_file_outside",
    "socket_to_loopback_listener",
    "forked_process_outlives_the_call",
    "signal_the_parent",
    "fork_bomb",
    "memory_exhaustion",
    "endless_loop",
    "output_flood",
]


@pytest.fixture(scope="module")
def host():
    """A secret file in the project directory and a loopback listener, for all escapes."""
    secret = secrets.token_hex(8)
    path = os.path.abspath(f".sandbox_secret_{secret}")
    with open(path, "w") as f:
        f.write(secret)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    env = ToolUseEnv(ToolUseConfig(tool_timeout_s=2.0, step_timeout_s=30.0))
    reward = CodeReward(wall_s=2.0, memory_mb=256)
    yield {
        "cases": escapes(path, secret, listener.getsockname()[1]),
        "listener": listener,
        "env": env,
        "reward": reward,
    }
    listener.close()
    os.remove(path)


def processes_with(token):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def assert_host_untouched(host, token):
    assert processes_with(token) == []  # nothing the call started is alive
    with pytest.raises(BlockingIOError):  # the listener saw no connection
        host["listener"].accept()


def call(code):
    body = json.dumps({"name": "python", "arguments": {"code": code}})
    return f"<tool_call>{body}</tool_call>"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("channel", ["tool_env", "code_reward"])
def test_escape_is_contained_counted_and_leaves_nothing(host, channel, name):
    code, check, tool_outcomes, reward_outcomes = host["cases"][name]
    token = f"jaxflash-escape-{secrets.token_hex(6)}"
    program = f"TOKEN = {token!r}\n{PRELUDE}\n{code}\nprint(OBS)\n"
    if channel == "tool_env":
        env = host["env"]
        before = sum(env.outcomes.values())
        env.reset(0)
        result = env.step(call(program))
        (outcome,) = result.info["tool_outcomes"]
        assert outcome in tool_outcomes, result.observation
        assert sum(env.outcomes.values()) == before + 1  # counted
        assert not result.terminated  # the episode goes on
        if check:
            obs = result.observation.split("output:\n", 1)[1]
            scope = {"OBS": obs}
            exec(check, scope)  # the same assertion as the reward's test  # noqa: S102
    else:
        answer = code_answer([check or "assert False"])
        result = host["reward"](f"```python\n{program}```", answer)
        outcome = next(k for k in result.components if k.startswith("outcome/"))
        assert outcome.removeprefix("outcome/") in reward_outcomes, result
        assert result.error is None  # the policy's outcome, not a reward failure
        assert result.score == (1.0 if check else 0.0), result
    assert_host_untouched(host, token)


def test_sandbox_counts_and_limits_are_distinct_outcomes():
    sb = Sandbox()
    assert sb.run("print(input())", stdin="hi").stdout == "hi\n"
    assert sb.run("raise SystemExit(3)").exit_code == 3
    assert sb.run("import os; os.kill(os.getpid(), 9)").outcome == "killed"
    # A program cannot pass for a sandbox that failed to start (a reward error).
    fake = "import sys; sys.stderr.write('bwrap: setting up uid map: Permission denied'); exit(1)"
    assert sb.run(fake).outcome == "error"
    assert dict(sb.counts) == {"ok": 1, "error": 2, "killed": 1}
    failed = sb._run(["/bin/false"], "pass", "", sb.limits, user=False)
    assert failed.outcome == "sandbox_error" and "did not start" in failed.detail


def test_no_bwrap_refuses_unless_unsandboxed_is_allowed():
    bad = Sandbox(python="/nonexistent/python3")
    check = bad.check()
    assert not check.ok and "refusing to run model code" in check.line
    with pytest.raises(RuntimeError, match="allow_unsandboxed"):
        bad.run("print(1)")
    risky = Sandbox(python="/nonexistent/python3", allow_unsandboxed=True)
    assert "UNSANDBOXED" in risky.check().line
    assert risky.run("print(6 * 7)").stdout == "42\n"  # runs, with limits, unisolated
