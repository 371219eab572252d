"""Compatibility between google-jetstream 0.2.2 and the JAX this project pins.

JetStream 0.2.2 was written against JAX 0.4.x and has two habits that bite here:

1. ``jetstream.core.orchestrator.delete_pytree`` — called by the Driver's
   generate thread after every ``insert`` — uses ``jax.tree_map``, which current
   JAX removed (the function moved to ``jax.tree.map``). Unpatched, the first
   request served through the Driver raises ``AttributeError`` inside a
   ``JetThread``, whose handler SIGKILLs the whole process.
2. Importing ``jetstream.core.orchestrator`` sets the root logger to DEBUG and
   attaches a stdout handler, so every library in the process (JAX's compile
   logs included) starts printing.

``ensure_jetstream_compat()`` installs ``jax.tree_map = jax.tree.map`` only when
the attribute is missing (it never replaces an existing one), and
``import_orchestrator()`` imports the orchestrator with the shim installed while
leaving the root logger's level and handlers as they were. Call them explicitly
before using JetStream's orchestrator or server (``jaxflash.generation.jetstream.serving``
does); nothing is patched at import time of this module.

``JetStreamTokenizer`` adapts jaxflash's tokenizer to the interface the Driver
tokenizes and detokenizes with.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import jax
import numpy as np
from jetstream.engine import tokenizer_api


def ensure_jetstream_compat() -> bool:
    """Make JAX expose what JetStream 0.2.2 calls (idempotent).

    Installs ``jax.tree_map`` as an alias of ``jax.tree.map`` if and only if JAX
    does not define it (same signature: ``tree_map(f, tree, *rest, is_leaf=None)``).

    Returns:
      True if the alias was installed by this call, False if ``jax.tree_map``
      already existed (from JAX itself or an earlier call).
    """
    if hasattr(jax, "tree_map"):
        return False
    jax.tree_map = jax.tree.map
    return True


def import_orchestrator() -> types.ModuleType:
    """Import ``jetstream.core.orchestrator`` safely.

    Runs ``ensure_jetstream_compat()`` and undoes the orchestrator's import-time
    change to the root logger (level DEBUG plus a stdout handler).

    Returns:
      The ``jetstream.core.orchestrator`` module.
    """
    ensure_jetstream_compat()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from jetstream.core import orchestrator  # noqa: PLC0415 (deliberately late)

    root.setLevel(level)
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    return orchestrator


class JetStreamTokenizer(tokenizer_api.Tokenizer):
    """jaxflash's tokenizer behind JetStream's ``tokenizer_api.Tokenizer``.

    JetStream's Driver tokenizes text requests with ``encode`` and streams
    ``decode([token])`` per generated token, stopping at ``stop_tokens``.

    Args:
      tokenizer: any object with ``encode(text) -> list[int]``,
        ``decode(ids) -> str``, ``eos_id`` and ``pad_id`` (e.g.
        ``jaxflash.models.text.tokenizer.Tokenizer``); ``bos_id`` is used if present.
      max_prefill_length: prompts longer than this keep their last
        ``max_prefill_length`` tokens (JetStream's own policy, with a warning):
        raising inside the Driver's prefill thread would SIGKILL the process.

    Limitations: text is decoded one token at a time, so a multi-byte UTF-8
    character split across byte-level BPE tokens streams as replacement
    characters; no BOS is added to text prompts (chat templates carry their own
    special tokens), while JetStream itself prepends ``bos_id`` to token-id
    requests.
    """

    def __init__(self, tokenizer: Any, *, max_prefill_length: int):
        for name in ("encode", "decode", "eos_id", "pad_id"):
            if not hasattr(tokenizer, name):
                raise ValueError(f"JetStreamTokenizer: tokenizer has no attribute {name!r}")
        self._tok = tokenizer
        self._max_prefill_length = max_prefill_length

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray | jax.Array, int]:
        """(int32 [P] tokens, P); kwargs as JetStream passes them (``jax_padding``)."""
        ids = np.asarray(self._tok.encode(s), np.int32).reshape(-1)
        if ids.shape[0] > self._max_prefill_length:
            logging.warning(
                "prompt of %d tokens exceeds max_prefill_length=%d: keeping the last %d",
                ids.shape[0],
                self._max_prefill_length,
                self._max_prefill_length,
            )
            ids = ids[-self._max_prefill_length :]
        if kwargs.get("jax_padding", True):
            return jax.numpy.asarray(ids), int(ids.shape[0])
        return ids, int(ids.shape[0])

    def decode(self, token_ids: list[int], **kwargs) -> str:
        del kwargs
        return self._tok.decode([int(t) for t in token_ids])

    @property
    def pad_id(self) -> int:
        return int(self._tok.pad_id)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_id)

    @property
    def bos_id(self) -> int:
        bos = getattr(self._tok, "bos_id", None)
        return int(self.pad_id if bos is None else bos)

    @property
    def stop_tokens(self) -> set[int]:
        """The tokenizer's stop set (``stop_ids``: eos, end-of-turn, ...), else EOS
        alone; never pad (it may be a real token in some vocabularies)."""
        return {int(i) for i in getattr(self._tok, "stop_ids", ())} | {self.eos_id}
