"""Process start-up: the RL runtime does not import TensorFlow (JetStream's engine_api).

The engine is pure JAX; only the JetStream adapter (``generation.jetstream``:
its Driver and gRPC server, ``launch/serve.py``) imports JetStream, whose
``engine_api`` pulls TensorFlow through seqio. A fresh interpreter is needed: the
test process itself imports the serving modules.
"""

import json
import subprocess
import sys

HEAVY = ("tensorflow", "seqio", "jetstream")

_PROBE = """
import json, sys
import jaxflash.runtime.loop, jaxflash.runtime.fleet.gen_process, jaxflash.generation.slot_loop
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))
"""


def _imported(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runtime_and_engine_import_without_tensorflow_or_jetstream():
    code = _PROBE.format(heavy=set(HEAVY))
    assert _imported(code) == []


_RLVR_PROBE = """
import json, sys, types
import jaxflash.runtime.loop
from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.runtime.rollout.inbox import Inbox
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.scheduler import RolloutScheduler
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings
from jaxflash.runtime.rollout.dispatch import prompt_dispatch
import jaxflash.runtime.workloads.task_workload
from jaxflash.types import SamplingParams

def envs():
    return sorted(m for m in sys.modules if m.split('.')[:2] == ['jaxflash', 'envs'])

books = RolloutBooks(source=None, ledger=PromptLedger(), buffer=GroupBuffer(2))
settings = RolloutSettings(
    batch_prompts=1, group_size=2, async_ratio=0, sampling=SamplingParams(), seed=0
)
dispatch = prompt_dispatch(object(), None)  # what TaskWorkload.rollout builds
RolloutScheduler([object()], Inbox(), books, settings, dispatch)
rlvr = envs()
import jaxflash.runtime.rollout.episode_dispatch  # the agentic side does load them
print(json.dumps([rlvr, envs()]))
"""


def test_an_rlvr_run_never_imports_the_environments():
    """runtime.loop and an RLVR scheduler (the task workload's dispatcher) leave
    ``jaxflash.envs`` unloaded; the environment manager loads it (the probe can fail)."""
    rlvr, agentic = _imported(_RLVR_PROBE)
    assert rlvr == []
    assert "jaxflash.envs.episode" in agentic
