"""GRPO on SmolLM2-135M-Instruct with HumanEval (code RLVR, programs run in the sandbox).

Each response's program runs against its problem's tests in a bubblewrap sandbox
(``reward.fn=code``, docs/SANDBOX.md); reward = fraction of tests passed, accuracy =
all passed. 164 problems: 16 held out (eval_accuracy = mean@2 at each evaluation), the rest
trained on in shuffled epochs.

Launch (from the repo root):

    python launch/tpu_pod.py --config configs/rlvr_smollm2_humaneval.py --workdir runs/humaneval

Cost on 2 CPU cores: several minutes per step, not measured (4 prompts x 4 samples
of up to 320 new tokens; the sandboxed scoring overlaps generation, each program
within the default reward.code_wall_s = 5 s: HumanEval's tests take milliseconds,
only loops reach it). A 135M model solves very few HumanEval problems (base pass@1
4.3 % +- 1.6 % at T=0.2, mean fraction of tests passed 0.196; docs/SANDBOX.md): this
is a demonstration of the loop, not a recipe. On a GPU/TPU, use a larger model
(model.source=hf) and raise prompts_per_step, num_slots and max_new_tokens.
"""

import ml_collections

from configs import rlvr_smollm2_arith


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = rlvr_smollm2_arith.get_config()
    c.total_steps = 10
    c.data.task = "humaneval"  # reward "code" follows from the task
    c.data.eval_size = 16  # held-out problems (fixed split, at most half of 164)
    c.rollout.prompts_per_step = 4
    c.rollout.max_new_tokens = 320  # a whole function in a fenced block
    c.rollout.num_slots = 16
    c.learner.lr = 2e-6
    c.learner.micro_batch_size = 4
    return c
