"""Token sampling with per-sample RNG and the behaviour logprob of each draw.

The engine samples from the *processed* distribution
``q = processed_log_softmax(logits, temperature, top_k, top_p)`` and records
``log q(token)`` — the same quantity the learner recomputes with
``jaxflash.models.decoder.logprobs.target_logprobs`` — so the importance ratio of an
unchanged policy is exactly 1 up to float rounding.

RNG is keyed by the sample's identity, never by slot or batch position:
    key = fold_in(fold_in(fold_in(PRNGKey(seed), prompt_id), sample_index), token_index)
so a sample draws the same tokens whichever slot, server or batch it lands in,
and a retried request reproduces its tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.algorithms.distributions import NEG_INF, processed_log_softmax


def sample_key(
    seed: jax.Array | int,
    prompt_id: jax.Array | int,
    sample_index: jax.Array | int,
    token_index: jax.Array | int,
) -> jax.Array:
    """RNG key of one token of one sample.

    Args:
      seed: int32 scalar, run-level seed.
      prompt_id: int32 scalar, ``Prompt.prompt_id``.
      sample_index: int32 scalar, index of the sample within its prompt's group.
      token_index: int32 scalar, 0 for the first response token.

    Returns:
      uint32 [2] raw PRNG key
      ``fold_in(fold_in(fold_in(PRNGKey(seed), prompt_id), sample_index), token_index)``.
    """
    key = jax.random.PRNGKey(seed)
    key = jax.random.fold_in(key, prompt_id)
    key = jax.random.fold_in(key, sample_index)
    return jax.random.fold_in(key, token_index)


def sample_tokens(
    logits_bv: jax.Array,
    keys_b2: jax.Array,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    greedy: bool,
    valid_vocab_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return it with its processed log-probability.

    Each row is drawn with its own key (Gumbel-max over log q via
    ``jax.random.categorical``), so row b's token depends only on
    ``logits_bv[b]`` and ``keys_b2[b]``.

    Args:
      logits_bv: float [B, V] raw logits.
      keys_b2: uint32 [B, 2] one raw PRNG key per row (see ``sample_key``);
        ignored when greedy.
      temperature: static T > 0.
      top_k: static int, 0 disables.
      top_p: static float in (0, 1], 1.0 disables.
      greedy: static; take argmax of the raw logits (over valid ids) instead
        of sampling. The returned logprob is still log q(argmax) under (T,
        top_k, top_p), which is what the learner scores for that token.
      valid_vocab_size: static; ids >= it are padded embedding rows, never drawn
        (``ModelConfig.valid_vocab_size``; None: every id is valid).

    Returns:
      (token_b int32 [B], logp_b float32 [B]) with logp_b = log q(token_b).

    Raises:
      ValueError: if temperature <= 0 or logits_bv is not 2-D (top_k / top_p
        are checked by ``processed_log_softmax``).
    """
    if not temperature > 0:
        raise ValueError(f"sample_tokens: temperature must be > 0, got {temperature}")
    if logits_bv.ndim != 2:
        raise ValueError(f"sample_tokens: logits_bv must be [B, V], got {logits_bv.shape}")
    logq_bv = processed_log_softmax(
        logits_bv,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        valid_vocab_size=valid_vocab_size,
    )
    return draw_tokens(logq_bv, keys_b2, greedy=greedy, logits_bv=logits_bv)


def draw_tokens(
    logq_bv: jax.Array, keys_b2: jax.Array, *, greedy: bool, logits_bv: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """One token per row from log q [B, V] (``processed_log_softmax``'s output).

    Args:
      logq_bv: float32 [B, V] log q, NEG_INF outside the kept set.
      keys_b2: uint32 [B, 2] one raw PRNG key per row; ignored when greedy.
      greedy: static; the argmax of ``logits_bv`` (else of log q) over the kept ids.
      logits_bv: float [B, V] raw logits (greedy's order), or None.

    Returns:
      (token_b int32 [B], logp_b float32 [B]) with logp_b = log q(token_b).
    """
    if greedy:
        # argmax of the raw logits over the kept (hence valid) ids; the max is always
        # kept, and argmax_first takes the first index among equal maxima like jnp.argmax.
        order_bv = logq_bv if logits_bv is None else logits_bv
        kept_bv = jnp.where(logq_bv > NEG_INF / 2, order_bv.astype(jnp.float32), -jnp.inf)
        token_b = argmax_first(kept_bv)
    else:
        # Exactly ``jax.random.categorical(key_b, logq_bv[b])`` per row (Gumbel-max:
        # argmax of gumbel(key_b, [V]) + log q), written out so that the noise is
        # materialised once and the argmax is two plain reductions: XLA on CPU runs
        # the fused variadic argmax over [B, V] several times slower.
        vocab = logq_bv.shape[-1]
        noise_bv = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), logq_bv.dtype))(keys_b2)
        token_b = argmax_first(noise_bv + logq_bv)
    logp_b = jnp.take_along_axis(logq_bv, token_b[:, None], axis=-1)[:, 0]
    return token_b, logp_b


def argmax_first(x_bv: jax.Array) -> jax.Array:
    """``jnp.argmax(x_bv, axis=-1)`` for non-NaN inputs, as max + first index of it.

    Same result (the first index among equal maxima) as two single-output
    reductions, which XLA on CPU vectorises; a row containing NaN gives index V - 1
    instead of the NaN's index (NaN logits are a bug upstream either way).

    Args:
      x_bv: float [B, V].

    Returns:
      int32 [B].
    """
    vocab = x_bv.shape[-1]
    max_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
    index_v = jnp.arange(vocab, dtype=jnp.int32)
    first_b = jnp.min(jnp.where(x_bv == max_b1, index_v, vocab), axis=-1)
    return jnp.minimum(first_b, vocab - 1)
