"""Named model shapes: the presets users train, and tiny test configs of each family.

``get_preset(name, **overrides)`` builds the ``ModelConfig`` of a preset; shapes are
those of the published checkpoints' config.json (HF), so a random-init preset has the
real architecture.
"""

from __future__ import annotations

from jaxflash.models.config.model_config import ModelConfig


def _gemma3_layers(n: int) -> tuple[str, ...]:
    """Gemma 3's layer pattern: 5 sliding-window layers, then 1 full, repeated."""
    return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n))


# Gemma 3 text fields shared by its sizes up to 1B (4B+ add linear RoPE scaling on
# the full layers, which ModelConfig does not represent).
_GEMMA3 = dict(
    rope_theta=1000000.0,
    rope_local_theta=10000.0,
    sliding_window=512,
    query_pre_attn_scalar=256.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    qk_norm=True,
    norm_offset=1.0,
    mlp_activation="gelu_tanh",
    sandwich_norm=True,
    scale_embeddings=True,
)

_PRESETS = {
    # SmolLM2-135M(-Instruct), HuggingFaceTB. rope_theta and rms_norm_eps checked
    # against the GGUF metadata (llama.rope.freq_base = 100000.0,
    # llama.attention.layer_norm_rms_epsilon = 1e-5). The GGUF says context 8192;
    # 2048 bounds our KV caches and is plenty for RL on this model.
    "smollm2_135m": dict(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        d_ff=1536,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
        max_seq_len=2048,
    ),
    # Qwen2.5-1.5B(-Instruct) shapes (its config.json): a 1.5B-parameter decoder of
    # the Llama family with q/k/v biases, for sizing runs (jaxflash.sizing.dry_run).
    "qwen2p5_1p5b": dict(
        vocab_size=151936,
        d_model=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        head_dim=128,
        d_ff=8960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
        max_seq_len=4096,
    ),
    # Qwen/Qwen2.5-7B(-Instruct) config.json: untied embeddings; context 131072 (32768 native).
    "qwen2p5_7b": dict(
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        head_dim=128,
        d_ff=18944,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=False,
        qkv_bias=True,
        max_seq_len=8192,
    ),
    # Shapes below are the families' published config.json files (Hugging Face hub).
    # max_seq_len bounds our KV caches (RL prompts + responses), not the published
    # context, which each comment gives.
    # Qwen/Qwen3-0.6B(-Base): context 40960 (32768 native).
    "qwen3_0p6b": dict(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=3072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=True,
        qk_norm=True,
        max_seq_len=8192,
    ),
    # Qwen/Qwen3-8B(-Base): the seeds' experiments' model; context 40960.
    "qwen3_8b": dict(
        vocab_size=151936,
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=12288,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        max_seq_len=8192,
    ),
    # meta-llama/Llama-3.1-8B(-Instruct): llama3 RoPE scaling; context 131072.
    "llama3p1_8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=False,
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
        max_seq_len=8192,
    ),
    # google/gemma-3-270m: equals load_gguf of the PyPI Q4_K_M file
    # (tests/models/test_gemma3_gguf.py) up to max_seq_len (context 32768).
    "gemma3_270m": dict(
        vocab_size=262144,
        d_model=640,
        n_layers=18,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        d_ff=2048,
        max_seq_len=4096,
        **_GEMMA3,
        layer_types=_gemma3_layers(18),
    ),
    # google/gemma-3-1b-pt / -it: context 32768.
    "gemma3_1b": dict(
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        d_ff=6912,
        max_seq_len=4096,
        **_GEMMA3,
        layer_types=_gemma3_layers(26),
    ),
    # Qwen/Qwen3-30B-A3B(-Base): 128 routed experts, 8 per token, no shared expert;
    # context 40960. intermediate_size 6144 is only for dense layers, which it has none of.
    "qwen3_30b_a3b": dict(
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        n_experts=128,
        n_experts_per_token=8,
        moe_d_ff=768,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        max_seq_len=8192,
    ),
    # Same architecture at toy size, for tests.
    "tiny": dict(
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
        max_seq_len=128,
        logits_chunk=16,
    ),
    # Qwen3-MoE at toy size, for tests: 8 experts, top-2, renormalised.
    "tiny_moe": dict(
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        n_experts=8,
        n_experts_per_token=2,
        moe_d_ff=32,
        norm_topk_prob=True,
        max_seq_len=128,
        logits_chunk=16,
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A named configuration, optionally with fields overridden.

    Args:
      name: "smollm2_135m", "qwen2p5_1p5b", "qwen2p5_7b", "qwen3_0p6b", "qwen3_8b",
        "qwen3_30b_a3b", "llama3p1_8b", "gemma3_270m", "gemma3_1b", "tiny" or "tiny_moe".
      **overrides: ModelConfig fields to change (e.g. compute_dtype="bfloat16").

    Raises:
      ValueError: unknown preset name (lists the known ones).
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(_PRESETS)}")
    return ModelConfig(**{**_PRESETS[name], **overrides})
