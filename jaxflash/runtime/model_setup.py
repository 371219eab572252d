"""Building the pieces a run needs from its ExperimentConfig: model, data, reward, engine."""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from jax.sharding import Mesh

from jaxflash.data.prompts import PromptFailure, PromptSource
from jaxflash.data.tasks import make_task
from jaxflash.models.config import ModelConfig, get_preset, reconcile_vocab
from jaxflash.models.tokenizer import Tokenizer
from jaxflash.models.weights_gguf import load_gguf, smollm2_gguf_path
from jaxflash.models.weights_hf import load_hf
from jaxflash.rewards.base import REWARD_FNS, combined
from jaxflash.runtime.experiment import DataSpec, ExperimentConfig, ModelSpec, RolloutSpec
from jaxflash.types import Prompt


def load_model(
    spec: ModelSpec, rollout: RolloutSpec
) -> tuple[ModelConfig, dict[str, Any] | None, Tokenizer]:
    """(model config, imported params or None for random init, tokenizer).

    The tokenizer of a random-init model is SmolLM2's (from the GGUF), so smoke
    runs use real prompts; the model's vocabulary is sized to it. The tokenizer
    carries the stop set (``tokenizer.stop_ids``) and the config the valid
    vocabulary (``config.valid_vocab_size``, see ``reconcile_vocab``).
    """
    overrides = dict(
        compute_dtype=spec.compute_dtype, remat=spec.remat, logits_chunk=spec.logits_chunk
    )
    need_len = rollout.max_prefill_length + rollout.sampling.max_new_tokens
    if spec.source == "gguf":
        path = spec.path or smollm2_gguf_path()
        config, params = load_gguf(path)
        tokenizer = Tokenizer.from_gguf(path)
    elif spec.source == "hf":
        config, params = load_hf(spec.path)
        tokenizer = Tokenizer.from_hf_dir(spec.path)
    else:
        tokenizer = Tokenizer.from_gguf(spec.path or smollm2_gguf_path())
        config, params = get_preset(spec.preset, vocab_size=tokenizer.vocab_size), None
        overrides["max_seq_len"] = max(config.max_seq_len, need_len)
    # Padded embeddings: ids past the tokenizer are masked; a larger tokenizer is refused.
    config = reconcile_vocab(config.replace(**overrides), tokenizer.vocab_size)
    if need_len > config.max_seq_len:
        raise ValueError(
            f"rollout.max_prefill_length={rollout.max_prefill_length} + "
            f"rollout.max_new_tokens={rollout.sampling.max_new_tokens} = {need_len} exceeds "
            f"the model's max_seq_len={config.max_seq_len}"
        )
    return config, params, tokenizer


def check_workdir_model(workdir: str, config: ModelConfig) -> None:
    """Records the model's shape in ``<workdir>/model_config.json``, or checks it on resume.

    Raises:
      ValueError: the workdir holds a run of a different model (naming the fields
        that differ), instead of an Orbax shape mismatch deep in the restore.
    """
    path = os.path.join(workdir, "model_config.json")
    shape_fields = (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "d_ff",
        "tie_embeddings",
        "qkv_bias",
        "param_dtype",
    )
    current = {k: getattr(config, k) for k in shape_fields}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
        if diff:
            raise ValueError(
                f"workdir {workdir} holds a run of a different model "
                f"(field: saved vs now) {diff}; use a new --workdir"
            )
        return
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=1)


def make_datasets(exp: ExperimentConfig, tokenizer: Any) -> tuple[Any, list[Prompt]]:
    """(training rows: a sequence or index -> row function, held-out eval prompts).

    Rows come from the task registry (``jaxflash.data.tasks.make_task``); file
    tasks are read in epochs shuffled with the run's seed.
    """
    d: DataSpec = exp.data
    if d.task == "arithmetic":
        options: dict[str, Any] = dict(
            min_operands=d.min_operands,
            max_operands=d.max_operands,
            min_digits=d.min_digits,
            max_digits=d.max_digits,
            ops=d.ops,
        )
    else:
        # on_error="fail": a malformed row becomes a prompt failed with its file:line
        # (counted by the ledger) instead of stopping the run.
        options = dict(
            path=d.path,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            answer_marker=d.answer_marker or None,
            on_error="skip" if d.on_error == "fail" else "raise",
        )
    task = make_task(d.task, seed=exp.seed, eval_size=d.eval_size, **options)
    eval_source = PromptSource(task.eval_rows, tokenizer, max_prompt_tokens=d.max_prompt_tokens)
    eval_prompts = [p for p in eval_source if not isinstance(p, PromptFailure)]
    return task.train, eval_prompts


def make_reward(spec: Any) -> Any:
    """Weighted Math-Verify answer reward (+ optional format reward), or ``spec.fn``.

    ``spec.fn`` is "math", another registered name (``REWARD_FNS``) or a
    "package.module:attr" path to a picklable reward
    callable ``(response_text, answer) -> RewardResult`` (it runs in worker processes).

    Raises:
      ValueError: a malformed path; ImportError / AttributeError: it does not resolve.
    """
    if spec.fn in REWARD_FNS and spec.fn != "math":
        return spec.fn  # a registered name; workers resolve it from the registry
    if spec.fn != "math":
        module_name, sep, attr = spec.fn.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(
                f"reward.fn must be a registered name {sorted(REWARD_FNS)} or "
                f"'module:attr', got {spec.fn!r}"
            )
        return getattr(importlib.import_module(module_name), attr)
    weights = {"math": spec.answer_weight}
    if spec.format_weight:
        weights["format_any"] = spec.format_weight
    return combined(weights)


def make_engine(exp: ExperimentConfig, model_config: ModelConfig, mesh: Mesh, tokenizer: Any):
    """The rollout engine of one generation mesh (sampling static per engine).

    Returns:
      (LlamaEngine, generator param shardings on ``mesh`` for ``sync.publish``).
    """
    from jaxflash.generation.engine import EngineConfig, LlamaEngine
    from jaxflash.models.llama import abstract_params, logical_axes
    from jaxflash.sharding.rules import GENERATOR_RULES, logical_to_shardings

    sampling = exp.rollout.sampling
    engine = LlamaEngine(
        model_config,
        EngineConfig(
            max_concurrent_decodes=exp.rollout.num_slots,
            max_prefill_length=exp.rollout.max_prefill_length,
            max_target_length=exp.rollout.max_prefill_length + sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        ),
        mesh=mesh,
        rules=GENERATOR_RULES,  # shards the KV cache like the params (tensor parallel)
        tokenizer=tokenizer,
    )
    shardings = logical_to_shardings(
        logical_axes(model_config), mesh, GENERATOR_RULES, shapes=abstract_params(model_config)
    )
    return engine, shardings


def prompt_by_id(rows: Any, source: PromptSource, prompt_id: int) -> Prompt | PromptFailure:
    """Re-render prompt ``prompt_id`` (a resumed run regenerates prompts in flight).

    ``rows`` is what ``make_datasets`` returned (a sequence, read in epochs, or an
    index -> row function); ``source`` renders it without moving its cursor.
    """
    row = rows(prompt_id) if callable(rows) else rows[prompt_id % len(rows)]
    return source.render(prompt_id, row)
