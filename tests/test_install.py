"""What `make run` installs and what the real job writes to disk (issue 31: a 5.5 GB venv
for a CPU run, a 1.4 GB checkpoint every step)."""

from __future__ import annotations

import math
import os
import re
import tomllib

import jax

from configs import rlvr_smollm2_arith, smoke

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
        return f.read()


def test_the_run_install_leaves_out_jetstream_libtpu_and_torch():
    project = tomllib.loads(_read("pyproject.toml"))["project"]
    assert not [d for d in project["dependencies"] if re.match(r"google-jetstream|libtpu|torch", d)]
    assert project["optional-dependencies"]["serve"] == ["google-jetstream==0.2.2"]
    # Only serving imports JetStream (the RL runtime's imports: test_startup_imports.py).
    importing = set()
    for root, _, files in os.walk(os.path.join(REPO, "jaxflash")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                if re.search(r"^\s*(from|import) jetstream\b", _read(path), re.M):
                    importing.add(os.path.relpath(path, REPO))
    assert importing == {
        "jaxflash/generation/jetstream/adapter.py",
        "jaxflash/generation/jetstream/compat.py",
        "jaxflash/generation/jetstream/serving.py",
    }
    make = _read("Makefile")
    run_install = make[make.index("$(VENV)/.run-installed:") : make.index("$(VENV)/.installed:")]
    assert "pip install -q -e .\n" in run_install and "[" not in run_install.split("-e .")[1]
    assert re.search(r"^run: \$\(VENV\)/\.run-installed$", make, re.M)
    assert re.search(r"^test: env$", make, re.M)  # the tests get every extra
    assert "-e '.[test,tpu,serve]'" in make


def test_the_real_job_checkpoints_every_5_steps_keeps_one_and_the_docs_say_its_size():
    from jaxflash.models.config.presets import get_preset  # noqa: PLC0415
    from jaxflash.models.decoder.transformer import abstract_params  # noqa: PLC0415

    c = rlvr_smollm2_arith.get_config()
    assert (c.checkpoint.every, c.checkpoint.max_to_keep) == (5, 1)
    s = smoke.get_config()  # the resume tests save every step
    assert (s.checkpoint.every, s.checkpoint.max_to_keep) == (1, 2)
    leaves = jax.tree.leaves(abstract_params(get_preset("smollm2_135m")))
    n = sum(math.prod(x.shape) for x in leaves)
    measured = 1_496_638_534  # bytes of one real-job checkpoint on disk (the docs' number)
    estimate = n * 4 * 3  # float32 params + Adam's two moments
    assert abs(estimate - measured) / measured < 0.1, (estimate, measured)
    for doc in (_read("README.md"), _read("docs", "RUNNING.md")):
        assert "1,496,638,534 bytes" in doc and "1.5 GB" in doc
