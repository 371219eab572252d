"""GRPO on Qwen2.5-1.5B, sized for a v5e-16 slice: 8 learner chips + 8 generation chips.

The preset a user starts from on TPU v5e (16 GB HBM per chip): asynchronous
(alpha = 2) on disjoint slices, bf16 compute over fp32 master weights, splash
attention with full remat in the learner, and a paged KV cache in the engine.

Size it first, without a TPU (``pip install -e '.[tpu]'``; 4-7 min of compile on 2
busy CPU cores, 4.4 GB of RAM), then read the per-chip table and the simulator's forecast:

    python launch/tpu_pod.py --config configs/tpu_qwen2p5_1p5b_v5e.py --dry_run --topology v5e-16

The exact mode (``model.exact_numerics``, docs/CONSISTENCY.md) refuses this layout (a
sharded learner, a tensor-parallel engine); the layout it accepts, sized the same way:

    python launch/tpu_pod.py --config configs/tpu_qwen2p5_1p5b_v5e.py --dry_run --topology v5e-16 \
        --config.model.exact_numerics=True --config.mesh.learner.fsdp=1 \
        --config.learner.micro_batch_size=1 --config.learner.lora.rank=16 \
        --config.mesh.generation.data=8 --config.mesh.generation.tensor=1

Run it on a v5e-16 with the real weights (a local Hugging Face checkpoint) and a
file of math problems:

    python launch/tpu_pod.py --config configs/tpu_qwen2p5_1p5b_v5e.py --workdir runs/q15 \
        --config.model.source=hf --config.model.path=/path/to/Qwen2.5-1.5B-Instruct \
        --config.data.task=math_file --config.data.path=/path/to/dapo_math.jsonl

Shapes (what the dry run compiles; docs/TPU.md "Presets a user starts from"):

- learner: fsdp=8 on chips 0-7, a train step of 64 samples (8 prompts x 8) of up to
  1,024 prompt + 7,168 response = 8,192 tokens, micro-batches of 8 (one sequence
  per chip), ``model.remat_policy="full"`` (only each layer's input is saved),
  ``learner.packing`` (rows of 8,192 tokens with segment ids: the real tokens only).
- generation: one engine over chips 8-15 as data=4 x tensor=2: 128 slots of up to
  8,192 positions and a page pool of 16,384 pages x 32 = 524,288 tokens (half the
  slots' dense reservation). The 2 KV heads split over tensor, the pages and slots
  over data (4 slot groups of 32 slots and 4,096 pages), so each chip holds 1/8 of
  the pool (1.75 GiB); attention is the TPU kernel ``ragged_paged_attention`` on each
  chip's pages (``paged_attention=auto``). The engine holds its matmul weights in
  bf16 (1.78 GB per chip with the fp32 embedding). Why this layout (compiled
  deviceless, HBM bytes of a decode step per chip, docs/TPU.md): data=8 holds every
  weight on every chip (3.57 GB a step); tensor=8 cannot split 2 KV heads 8 ways
  and its compiled step copies whole pool buffers (1.53 GB a step on 0.71 GB of
  weights); data=4 x tensor=2 reads its weights once (1.78 GB a step).

Cost (measured by the command above): every program leaves >= 40 % of HBM free per
chip (GiB of 15.75: train step 9.45, publish 7.91 + 1.44 held, install 4.02 + 3.41,
decode block 3.45, prefill_1024 2.01 + 1.75 held). A decode step reads 1.78 GB per
chip from HBM (the compiled program's HBM walk; the weights once) + 0.94 GB of
in-use pages at a half-full pool (on paper: the kernel's reads): 1.00x weights +
in-use KV; XLA's own count is 5.86 GB (it adds each weight's staging through VMEM).
Forecast under the table (model figures from roofline costs, not measurements;
assumed lengths): 14.5 trained samples/s async (3.8 sync on the same split, 4.2
sync colocated), decode 2.17 ms a step + 9.8 us per live slot.
"""

import ml_collections

from configs import rlvr_smollm2_arith


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = rlvr_smollm2_arith.get_config()
    c.total_steps = 200

    # Placement: learner chips first, then the generation slices (runtime.placement.carve).
    c.mesh.colocated = False
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 8, "tensor": 1})
    # One engine over chips 8-15: the 2 KV heads over tensor=2, pages and slots over
    # data=4 (4 slot groups: each chip holds a quarter of its head's pages).
    c.mesh.generation = ml_collections.ConfigDict({"data": 4, "tensor": 2})
    c.mesh.num_generation_slices = 1

    c.model.source = "random"  # hf + model.path for a real checkpoint (see above)
    c.model.preset = "qwen2p5_1p5b"
    c.model.compute_dtype = "bfloat16"  # fp32 master weights, bf16 matmuls
    c.model.remat_policy = "full"  # 7.55 GiB/chip at 64 x 8192 (dots: 17.05, no headroom)
    c.model.logits_chunk = 256  # 151,936-token vocabulary: one [256, V] fp32 chunk

    c.data.max_prompt_tokens = 1024  # longest prompt, chat template included
    c.data.eval_size = 0  # no held-out evaluation on the arithmetic default

    c.rollout.prompts_per_step = 8  # keep: B, the dry run's HBM figures are sized with it
    c.rollout.group_size = 8  # G: 64 samples per learner step
    c.rollout.max_new_tokens = 7168  # 1024 + 7168 = 8192 positions per sample
    c.rollout.num_slots = 128  # 32 per slot group
    c.rollout.decode_block = 8  # 8 decode steps per dispatch
    c.rollout.kv_cache = "paged"  # attention by ragged_paged_attention on TPU (auto)
    c.rollout.page_size = 32
    c.rollout.num_pages = 16384  # 524,288 tokens, half of 128 x 8192; 4,096 pages a group
    c.rollout.async_ratio = 2  # alpha: samples up to 2 versions old
    c.reward.num_workers = 8

    c.learner.lr = 1e-6
    c.learner.micro_batch_size = 8  # keep: one 8192-token sequence per chip per micro-step
    # Sequences end to end in rows of T with segment ids: the step trains the real tokens
    # (long-tailed lengths: padding one per row is most of a batch; docs/TPU.md).
    c.learner.packing = True
    return c
