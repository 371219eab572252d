"""Building the pieces a run needs from its config sections: tokenizer, model, reward,
engine (the task: ``runtime.workloads.task_setup``)."""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from jax.sharding import Mesh

from jaxflash.models.config.model_config import ModelConfig, reconcile_vocab
from jaxflash.models.config.presets import get_preset
from jaxflash.models.formats.hf_config import config_from_hf_dict
from jaxflash.models.formats.weights_gguf import load_gguf, smollm2_gguf_path
from jaxflash.models.formats.weights_hf import load_hf
from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.rewards.base import REWARD_FNS, combined
from jaxflash.rewards.code_reward import CodeReward
from jaxflash.runtime.config.experiment import (
    ConfigError,
    ModelSpec,
    RewardSpec,
)
from jaxflash.runtime.config.rollout_spec import RolloutSpec


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """The model's tokenizer, with its chat template and stop set (``tokenizer.stop_ids``).

    A random-init model uses SmolLM2's tokenizer (from the GGUF), so smoke runs
    render real prompts. ``spec.chat_template`` (when set) replaces the files' template;
    ``spec.chat_template_kwargs`` go to every render.
    """
    if spec.source == "hf":
        tokenizer = Tokenizer.from_hf_dir(spec.path)
    else:
        tokenizer = Tokenizer.from_gguf(spec.path or smollm2_gguf_path())
    if spec.chat_template or spec.extra_stop_ids or spec.chat_template_kwargs:
        tokenizer = tokenizer.with_chat_template(
            spec.chat_template or tokenizer.chat_template,
            extra_stops=[("model.extra_stop_ids", spec.extra_stop_ids)],
            template_kwargs=spec.chat_template_kwargs,
        )
    return tokenizer


def model_context(spec: ModelSpec) -> int | None:
    """The model's context (``max_seq_len``) from its files' header, without its weights:
    the GGUF's ``<arch>.context_length``, config.json's (``config_from_hf_dict``).

    Returns:
      None for a random-init model (its context is sized to the run's limits in
      ``load_model``) or when the header cannot be read (``load_model`` then says why).
    """
    try:
        if spec.source == "gguf":
            import gguf  # noqa: PLC0415  (the GGUF reader maps the file; no tensor is read)

            fields = gguf.GGUFReader(spec.path or smollm2_gguf_path()).fields
            arch = fields["general.architecture"].contents()
            return int(fields[f"{arch}.context_length"].contents())
        if spec.source == "hf":
            with open(os.path.join(spec.path, "config.json"), encoding="utf-8") as f:
                return int(config_from_hf_dict(json.load(f)).max_seq_len)
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return None


def describe_source(spec: ModelSpec) -> str:
    """Where the weights come from, for the console: a path, the GGUF, or a preset."""
    what = spec.path or {"gguf": "SmolLM2-135M-Instruct GGUF"}.get(spec.source, "")
    return what or f"random-init preset {spec.preset}"


def load_model(
    spec: ModelSpec, rollout: RolloutSpec, tokenizer: Tokenizer
) -> tuple[ModelConfig, dict[str, Any] | None]:
    """(model config, imported params or None for random init).

    The vocabulary is reconciled with ``tokenizer`` (``reconcile_vocab``: padded
    embedding rows are masked, ``config.valid_vocab_size``); a random-init model
    is sized to it.

    Raises:
      ConfigError: the weight importer refuses the files (naming model.path), or
        ``rollout.max_prefill_length + rollout.max_new_tokens`` exceeds the
        model's context (naming the fields).
      ValueError: the tokenizer is larger than the model.
    """
    overrides = dict(
        compute_dtype=spec.compute_dtype, remat=spec.remat, logits_chunk=spec.logits_chunk,
        attention=spec.attention, remat_policy=spec.remat_policy,
        exact_numerics=spec.exact_numerics,
    )  # fmt: skip
    need_len = rollout.max_prefill_length + rollout.sampling.max_new_tokens
    try:  # a file the importers refuse (unknown RoPE type, activation, tensor) is input
        if spec.source == "gguf":
            config, params = load_gguf(spec.path or smollm2_gguf_path())
        elif spec.source == "hf":
            config, params = load_hf(spec.path)
    except ValueError as e:
        raise ConfigError(f"model.path={spec.path!r} (model.source={spec.source}): {e}") from None
    if spec.source not in ("gguf", "hf"):
        config, params = get_preset(spec.preset, vocab_size=tokenizer.vocab_size), None
        overrides["max_seq_len"] = max(config.max_seq_len, need_len)
    # Padded embeddings: ids past the tokenizer are masked; a larger tokenizer is refused.
    config = reconcile_vocab(config.replace(**overrides), tokenizer.vocab_size)
    if need_len > config.max_seq_len:
        raise ConfigError(
            f"rollout.max_prefill_length={rollout.max_prefill_length} + "
            f"rollout.max_new_tokens={rollout.sampling.max_new_tokens} = {need_len} exceeds "
            f"the model's max_seq_len={config.max_seq_len}: lower rollout.max_new_tokens, "
            "or set data.max_prompt_tokens (the prompt limit: longer rows fail as "
            "prompt_too_long; the start-up warning names them)"
        )
    return config, params


def check_workdir_model(workdir: str, config: ModelConfig) -> None:
    """Records the model's shape in ``<workdir>/model_config.json``, or checks it on resume.

    Raises:
      ConfigError: the workdir holds a run of a different model (naming the fields
        that differ), instead of an Orbax shape mismatch deep in the restore; the
        launcher prints it as one line.
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
        "qk_norm",  # these two add parameters (q/k norms, Gemma's post-norms)
        "sandwich_norm",
        "n_experts",  # mixture of experts: the expert stacks replace the dense MLP
        "moe_d_ff",
    )
    current = {k: getattr(config, k) for k in shape_fields}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        # Workdirs written before a field existed hold its default (False).
        saved = {"qk_norm": False, "sandwich_norm": False, "n_experts": 0, "moe_d_ff": 0, **saved}
        diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
        if diff:
            raise ConfigError(
                f"workdir {workdir} holds a run of a different model "
                f"(field: saved vs now) {diff}; use a new --workdir"
            )
        return
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=1)


def make_reward(spec: RewardSpec) -> Any:
    """Weighted Math-Verify answer reward (+ optional format reward), or ``spec.fn``.

    ``spec.fn`` is "math", another registered name (``REWARD_FNS``) or a
    "package.module:attr" path to a picklable reward
    callable ``(response_text, answer) -> RewardResult`` (it runs in worker processes).

    Raises:
      ConfigError: the path does not import or has no such attribute (names reward.fn).
    """
    if spec.fn == "code":  # the sandbox's limits; it must start here (one line if not)
        reward = CodeReward(
            wall_s=spec.code_wall_s,
            memory_mb=spec.code_memory_mb,
            allow_unsandboxed=spec.allow_unsandboxed,
        )
        check = reward.sandbox().check()
        if not check.ok and not spec.allow_unsandboxed:
            raise ConfigError(f"reward.fn='code': {check.line} (reward.allow_unsandboxed)")
        return reward  # TaskWorkload.build prints check.line
    if spec.fn in REWARD_FNS and spec.fn != "math":
        return spec.fn  # a registered name; workers resolve it from the registry
    if spec.fn != "math":
        module_name, _, attr = spec.fn.partition(":")  # the form is checked by RewardSpec
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"reward.fn={spec.fn!r} does not resolve: {e}") from None
    weights = {"math": spec.answer_weight}
    if spec.format_weight:
        weights["format_any"] = spec.format_weight
    return combined(weights)


def make_engine(
    model_config: ModelConfig, mesh: Mesh, tokenizer: Any, *, rollout: Any, env: Any, lora: Any
):
    """The rollout engine of one generation mesh (sampling static per engine).

    Args:
      rollout, env: the experiment's sections (``engine_config``).
      lora: ``learner.lora`` (None: the engine serves full params).

    ``tokenizer`` is not used: the engine takes none (only JetStream's serving adapter,
    ``generation.jetstream``, does); the parameter goes once ``fleet.fleets`` stops
    passing it.

    Returns:
      (LlamaEngine, generator param shardings on ``mesh`` for ``sync.publish``).
    """
    del tokenizer
    return build_engine(model_config, engine_config(rollout=rollout, env=env), mesh, lora=lora)


def lora_base_source(*, model: ModelSpec, seed: int) -> dict[str, Any]:
    """Where a LoRA run's frozen base comes from, as JSON: what a generation program
    needs to build the same base itself (``stored_lora_base``) instead of receiving it.
    ``model``, ``seed``: the experiment's ``model`` section and seed."""
    return {"source": model.source, "path": model.path, "seed": int(seed)}


def stored_lora_base(model_config: ModelConfig, source: dict[str, Any], lora: Any) -> Any:
    """The frozen base a LoRA learner stores (``learner.state``'s ``_lora_build``): the
    model file's weights, or ``init_params(model_config, seed)`` for random init, cast
    or quantized per ``lora.base_dtype`` by the same jitted ops (so bit for bit the
    learner's; callers compare ``tree_digest``s).

    Args:
      source: ``lora_base_source(model=exp.model, seed=exp.seed)``.
      lora: the run's ``LoraConfig``.
    """
    import jax

    from jaxflash.models.adapters.lora import quantize_base
    from jaxflash.models.decoder.transformer import init_params

    if source["source"] == "gguf":
        _, params = load_gguf(source["path"] or smollm2_gguf_path())
    elif source["source"] == "hf":
        _, params = load_hf(source["path"])
    else:
        return jax.jit(lambda: quantize_base(init_params(model_config, source["seed"]), lora))()
    return jax.jit(lambda p: quantize_base(p, lora))(params)


def engine_config(*, rollout: RolloutSpec, env: Any):
    """The ``EngineConfig`` of every rollout engine of a run (a generation program in
    another process builds its engine from this, sent as JSON).

    Args:
      rollout, env: the experiment's ``rollout`` and ``env`` sections (an environment's
        ``max_context_tokens`` bounds every turn).
    """
    from jaxflash.generation.engine.state import EngineConfig

    sampling = rollout.sampling
    target = rollout.max_prefill_length + sampling.max_new_tokens
    if env.name:  # a turn's prompt + its budget never exceed the episode's context
        target = env.max_context_tokens
    return EngineConfig(
        max_concurrent_decodes=rollout.num_slots,
        max_prefill_length=rollout.max_prefill_length,
        max_target_length=target,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        decode_block=rollout.decode_block,
        kv_cache=rollout.kv_cache,
        page_size=rollout.page_size,
        num_pages=rollout.num_pages,
    )


def build_engine(model_config: ModelConfig, config: Any, mesh: Mesh, *, lora: Any = None):
    """A ``LlamaEngine`` on ``mesh`` with GENERATOR_RULES.

    Args:
      lora: a ``LoraConfig``: the engine serves base + adapters (``models.adapters.lora``).

    Returns:
      (engine, generator param shardings on ``mesh``: of the adapters under LoRA,
      stacked, what each publish moves).
    """
    from jaxflash.generation.engine.llama_engine import LlamaEngine
    from jaxflash.models.decoder.transformer import abstract_params, logical_axes
    from jaxflash.sharding.rules import GENERATOR_RULES, logical_to_shardings

    engine = LlamaEngine(
        model_config,
        config,
        mesh=mesh,
        rules=GENERATOR_RULES,  # shards the KV cache like the params (tensor parallel)
        lora=lora,
    )
    if lora is not None:
        from jaxflash.models.adapters import lora as lora_lib

        a_shapes, a_axes = lora_lib.adapter_layout(model_config, lora)
        return engine, lora_lib.layout_shardings(a_axes, a_shapes, mesh, GENERATOR_RULES)
    shardings = logical_to_shardings(
        logical_axes(model_config), mesh, GENERATOR_RULES, shapes=abstract_params(model_config)
    )
    return engine, shardings
