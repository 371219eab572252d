"""Process start-up: the RL runtime does not import TensorFlow (JetStream's engine_api).

The engine core is pure JAX; only ``generation.jetstream_engine`` (JetStream's
Driver and gRPC server, ``launch/serve.py``) imports JetStream, whose
``engine_api`` pulls TensorFlow through seqio. A fresh interpreter is needed: the
test process itself imports the serving modules.
"""

import json
import subprocess
import sys

HEAVY = ("tensorflow", "seqio", "jetstream")

_PROBE = """
import json, sys
import jaxflash.runtime.loop, jaxflash.runtime.fleet.gen_program, jaxflash.generation.slot_loop
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
