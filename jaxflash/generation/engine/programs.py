"""The engine's jitted programs: ``engine.kernels`` bound to one engine's static
configuration and shardings, with their compilations counted from outside.

``Programs`` owns the ``jax.jit`` wrappers and a counter of traces per program and
input shape (a trace is a compilation). ``LlamaEngine`` builds one and calls it;
host-side preparation (padding, grouping, transfers) stays in the engine.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding

from jaxflash.generation.engine import kernels
from jaxflash.generation.engine.state import (
    DecodeState,
    EngineConfig,
    PrefillBatch,
    empty_decode_state,
)
from jaxflash.models.caches.kv_cache import LayerKVCache
from jaxflash.models.caches.pool_layout import PoolLayout
from jaxflash.models.config.model_config import ModelConfig


class Programs:
    """Jitted device programs of one engine (see ``engine.kernels`` for each).

    Args:
      model_config, engine_config: static configuration bound into every program.
      state_shardings: DecodeState of NamedShardings (``state_shardings``).
      prefill_cache_shardings: LayerKVCache of NamedShardings for prefill caches.
      replicated: NamedSharding for everything replicated.
      layout: a paged pool's split over the mesh (``models.caches.pool_layout.pool_layout``).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        state_shardings: DecodeState,
        prefill_cache_shardings: LayerKVCache,
        replicated: NamedSharding,
        layout: PoolLayout | None = None,
    ):
        self._mc, self._ec = model_config, engine_config
        self.traces: collections.Counter[str] = collections.Counter()
        rep, mc, ec = replicated, model_config, engine_config
        self.prefill = jax.jit(
            self._counted(
                lambda p, ids, n: f"prefill_{ids.shape[0]}x{ids.shape[1]}",
                functools.partial(
                    kernels.prefill,
                    model_config=mc,
                    dense_max=ec.prefill_dense_max,
                    mesh=replicated.mesh,
                ),
            ),
            out_shardings=PrefillBatch(
                cache=prefill_cache_shardings,
                true_length_n=rep,
                logits_nv=rep,
                routes_ntlk=rep if mc.is_moe else None,
            ),
        )

        self.start = jax.jit(
            self._counted(
                lambda st, b, row, *_: (
                    f"start_{row.shape[0]}_{b.logits_nv.shape[0]}x{b.cache.max_len}"
                ),
                functools.partial(kernels.start, model_config=mc, engine_config=ec),
            ),
            donate_argnums=(0,),
            out_shardings=(state_shardings, rep, rep),
        )
        self._block_out = (state_shardings, rep, rep, rep)
        self._blocks: dict[int, Callable] = {}
        self.init_state = jax.jit(
            lambda: empty_decode_state(mc, ec, layout), out_shardings=state_shardings
        )

    def generate_block(self, steps: int) -> Callable:
        """The ``generate_block`` program for ``steps`` (compiled on first use)."""
        if steps not in self._blocks:
            self._blocks[steps] = jax.jit(
                self._counted(
                    lambda *_: f"generate_block_{steps}",
                    functools.partial(
                        kernels.generate_block,
                        steps=steps,
                        model_config=self._mc,
                        engine_config=self._ec,
                    ),
                ),
                donate_argnums=(1,),
                out_shardings=self._block_out,
            )
        return self._blocks[steps]

    def _counted(self, name: Callable[..., str], fn: Callable) -> Callable:
        """``fn`` that adds one to ``traces[name(*args)]`` each time jax traces it."""

        def traced(*args, **kwargs):
            self.traces[name(*args, **kwargs)] += 1
            return fn(*args, **kwargs)

        return traced
