"""GRPO on Qwen2.5-1.5B, sized for a v5e-16 slice: 8 learner chips + 8 generation chips.

The preset a user starts from on TPU v5e (16 GB HBM per chip): asynchronous
(alpha = 2) on disjoint slices, bf16 compute over fp32 master weights, splash
attention with full remat in the learner, and a paged KV cache in the engine.

Size it first, without a TPU (``pip install -e '.[tpu]'``; about 7 min of compile
on 2 busy CPU cores), then read the per-chip table and the simulator's forecast:

    python launch/tpu_pod.py --config configs/tpu_qwen2p5_1p5b_v5e.py --dry_run --topology v5e-16

Run it on a v5e-16 with the real weights (a local Hugging Face checkpoint) and a
file of math problems:

    python launch/tpu_pod.py --config configs/tpu_qwen2p5_1p5b_v5e.py --workdir runs/q15 \
        --config.model.source=hf --config.model.path=/path/to/Qwen2.5-1.5B-Instruct \
        --config.data.task=math_file --config.data.path=/path/to/dapo_math.jsonl

Shapes (what the dry run compiles; docs/TPU.md "Presets x slices" has the numbers):

- learner: fsdp=8 on chips 0-7, a train step of 64 samples (8 prompts x 8) of up to
  1,024 prompt + 7,168 response = 8,192 tokens, micro-batches of 8 (one sequence
  per chip), ``model.remat_policy="full"`` (only each layer's input is saved),
  ``learner.packing`` (rows of 8,192 tokens with segment ids: the real tokens only).
- generation: chips 8-15 as 4 engines of tensor=2, each 32 slots of up to 8,192
  positions and a page pool of 4,096 pages x 32 = 131,072 tokens (half its slots'
  dense reservation): 128 slots and 524,288 pool tokens over the 8 chips. Main
  splits a pool by KV head only, and Qwen2.5-1.5B has 2, so one tensor=8 engine
  would hold its whole pool on every chip (14 GiB for 524,288 tokens: the decode
  block is refused). With a pool split by pages over the chips (another branch),
  one 8-chip engine of 128 slots is
  ``--config.mesh.generation.tensor=8 --config.mesh.num_generation_slices=1
  --config.rollout.num_slots=128 --config.rollout.num_pages=16384``.

Cost: every program fits with >= 40 % of HBM free per chip (train step 9.45 GiB,
install 9.51 of 15.75). The forecast under the table (model figures from roofline
costs, not measurements; assumed lengths): 0.71 trained samples/s async (0.16 sync)
with main's reference decode path (62 ms a step), 9.6 with the paged kernel over a
page-split pool.
"""

import ml_collections

from configs import rlvr_smollm2_arith


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = rlvr_smollm2_arith.get_config(arg)
    c.total_steps = 200

    # Placement: learner chips first, then the generation slices (runtime.placement.carve).
    c.mesh.colocated = False
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 8, "tensor": 1})
    # 2 chips per engine: the pool splits over the model's 2 KV heads, not further (main).
    c.mesh.generation = ml_collections.ConfigDict({"tensor": 2})
    c.mesh.num_generation_slices = 4  # chips 8-15

    c.model.source = "random"  # hf + model.path for a real checkpoint (see above)
    c.model.preset = "qwen2p5_1p5b"
    c.model.compute_dtype = "bfloat16"  # fp32 master weights, bf16 matmuls
    c.model.remat = True
    c.model.remat_policy = "full"  # 7.55 GiB/chip at 64 x 8192 (dots: 17.05, no headroom)
    c.model.attention = "auto"  # splash on TPU: O(T) memory
    c.model.logits_chunk = 256  # 151,936-token vocabulary: one [256, V] fp32 chunk

    c.data.max_prompt_tokens = 1024  # longest prompt, chat template included
    c.data.eval_size = 0  # no held-out evaluation on the arithmetic default

    c.rollout.prompts_per_step = 8  # B
    c.rollout.group_size = 8  # G: 64 samples per learner step
    c.rollout.max_new_tokens = 7168  # 1024 + 7168 = 8192 positions per sample
    c.rollout.num_slots = 32  # per engine: 128 over the 4
    c.rollout.decode_block = 8  # 8 decode steps per dispatch
    c.rollout.kv_cache = "paged"
    c.rollout.page_size = 32
    c.rollout.num_pages = 4096  # per engine: 131,072 tokens, half of 32 x 8192
    c.rollout.async_ratio = 2  # alpha: samples up to 2 versions old
    c.reward.num_workers = 8

    c.learner.lr = 1e-6
    c.learner.micro_batch_size = 8  # one 8192-token sequence per chip per micro-step
    # Sequences end to end in rows of T with segment ids: the step trains the real tokens
    # (long-tailed lengths: padding one per row is most of a batch; docs/TPU.md).
    c.learner.packing = True
    return c
