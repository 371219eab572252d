"""GRPO on Llama-3.1-8B with 32k-token samples, sized for 64 v5p chips (a v5p-128's worth).

The 8B preset a user starts from on TPU v5p (95 GB HBM per chip): asynchronous
(alpha = 2) on disjoint slices, bf16 compute over fp32 master weights, splash
attention with full remat in the learner, a paged KV cache in the engines.

Size it first, without a TPU (``pip install -e '.[tpu]'``; 4.4 min of compile on 2
busy CPU cores, 4.4 GB of RAM), then read the per-chip table and the simulator's forecast:

    python launch/tpu_pod.py --config configs/tpu_llama3p1_8b_v5p.py --dry_run --topology v5p-128

The 256 x 8,192-token learner target (samples, and the engine's slots, up to 8,192
positions) is one override:

    python launch/tpu_pod.py --config configs/tpu_llama3p1_8b_v5p.py --dry_run --topology v5p-128 \
        --config.rollout.max_new_tokens=7168

Run it as five JAX programs (docs/MULTIHOST.md; the learner and each engine are
their own multi-controller program, the layout of
``configs/tpu_llama3p1_8b_v5p.topology.json``: a v5p-64 learner slice and four v5p-16
generation slices, each engine one program over its slice's 2 hosts). On every
worker of each generation slice:

    python launch/gcloud.py --topology configs/tpu_llama3p1_8b_v5p.topology.json \
        --zone us-east5-a -- .venv/bin/python launch/tpu_pod.py \
        --config configs/tpu_llama3p1_8b_v5p.py --port 8500

(the learner's line of that fan-out is replaced by the next command), then on every
worker of the learner slice, with the address of worker 0 of each generation slice:

    python launch/gcloud.py --tpu rl-learner-v5p-64 --zone us-east5-a -- \
        .venv/bin/python launch/tpu_pod.py --config configs/tpu_llama3p1_8b_v5p.py \
        --workdir gs://my-bucket/l8 \
        --config.mesh.generation_addresses=G0:8500,G1:8500,G2:8500,G3:8500 \
        --config.model.source=hf --config.model.path=/path/to/Llama-3.1-8B-Instruct \
        --config.data.task=math_file --config.data.path=/path/to/dapo_math.jsonl

Shapes (what the dry run compiles; docs/TPU.md "Presets a user starts from"):

- learner: fsdp=32 on chips 0-31 (a v5p-64's worth), a train step of 256 samples
  (32 prompts x 8) of up to 1,024 prompt + 31,744 response = 32,768 tokens: the
  worst case of a 256 x 8,192-token budget with long tails (``learner.packing``: the
  step trains the real tokens in rows of 32,768), micro-batches of 32 (one row per
  chip), ``model.remat_policy="full"``.
- generation: chips 32-63 as 4 engines of tensor=8 (8 v5p chips each: two 4-chip hosts,
  so each engine is one generation program over 2 hosts, ``mesh.generation_hosts``),
  each 256 slots
  of up to 32,768 positions and a page pool of 65,536 pages x 32 = 2,097,152 tokens
  (a quarter of its slots' dense reservation), split over the 8 KV heads (32 GiB a
  chip); attention is the TPU kernel ``ragged_paged_attention`` (``paged_attention=
  auto``), in two calls of 128 slots per layer (a call's page table must fit SMEM);
  the engine holds its matmul weights in bf16 (2.27 GB a chip with the fp32 embedding
  and LM head).

``--config.mesh.num_generation_slices=1`` is the v5p-64 + one 8-chip engine layout
(24 chips idle: the forecast under the dry-run table shows what each split buys).

Cost (measured by the commands above): every program leaves >= 50 % of HBM free per
chip (GiB of 95.74: train step 42.1, decode block 34.4, install 5.3 + 34.1 held,
prefill_1024 3.1 + 32.0 held, publish 11.7 + 1.9); at 256 x 8,192 the train step
needs 16.1. A decode step reads 3.35 GB per chip from HBM (the compiled program's HBM
walk: 2.27 GB of weights, about 1.1 GB of 256 rows' activations) + 17.18 GB of in-use
pages at a half-full pool (on paper: the kernel's reads), 1.06x weights + in-use KV.
Forecast (model figures, assumed lengths): 7.26 trained samples/s async at learner 16
+ 6 engines (4.49 sync colocated, 3.49 sync on the config's split), decode 1.21 ms a
step + 48 us per live slot; at 256 x 8,192: 56.0 async (23.6 sync colocated).
"""

import ml_collections

from configs import rlvr_smollm2_arith


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = rlvr_smollm2_arith.get_config()
    c.total_steps = 200

    # Placement: learner chips first, then the generation slices (runtime.placement.carve).
    c.mesh.colocated = False
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 32, "tensor": 1})
    c.mesh.generation = ml_collections.ConfigDict({"tensor": 8})  # 8 KV heads: 8-way pool
    c.mesh.num_generation_slices = 4  # chips 32-63
    # Each engine its own JAX program over its slice's 2 hosts (4 v5p chips a host):
    # process 0 serves the controller, the other follows (runtime.fleet.gen_hosts).
    c.mesh.generation_processes = True
    c.mesh.generation_hosts = 2

    c.model.source = "random"  # hf + model.path for a real checkpoint (see above)
    c.model.preset = "llama3p1_8b"
    c.model.compute_dtype = "bfloat16"  # fp32 master weights, bf16 matmuls
    c.model.remat_policy = "full"  # only each layer's input is saved
    c.model.logits_chunk = 256  # 128,256-token vocabulary: one [256, V] fp32 chunk

    c.data.max_prompt_tokens = 1024  # longest prompt, chat template included
    c.data.eval_size = 0  # no held-out evaluation on the arithmetic default

    c.rollout.prompts_per_step = 32  # B
    c.rollout.group_size = 8  # G: 256 samples per learner step
    c.rollout.max_new_tokens = 31744  # 1024 + 31744 = 32768 positions per sample
    c.rollout.num_slots = 256  # per engine
    c.rollout.decode_block = 8
    c.rollout.kv_cache = "paged"  # attention by ragged_paged_attention on TPU (auto)
    c.rollout.page_size = 32
    c.rollout.num_pages = 65536  # per engine: 2,097,152 tokens, a quarter of 256 x 32768
    c.rollout.async_ratio = 2
    c.reward.num_workers = 16

    c.learner.lr = 1e-6
    c.learner.micro_batch_size = 32  # one 32k-token sequence per chip per micro-step
    # Sequences end to end in rows of T with segment ids: the step trains the real tokens
    # (long-tailed lengths: padding one per row is most of a batch; docs/TPU.md).
    c.learner.packing = True
    return c
