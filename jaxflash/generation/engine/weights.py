"""Weights of one ``LlamaEngine``: the accepted layouts, placement and LoRA adapters.

``EngineWeights`` holds what a weight update needs: the engine's param shardings
(``engine.params.engine_shardings``), the leaf signatures of the trees it accepts
(the model's, layers stacked or not) and, for a LoRA engine, the jitted adapter
unstacking (built once). ``LlamaEngine`` exposes its methods under the same names.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflash.generation.engine.params import as_engine_dtypes, engine_shardings, place
from jaxflash.models.adapters import lora as lora_lib
from jaxflash.models.adapters.lora import LoraConfig
from jaxflash.models.config.model_config import ModelConfig
from jaxflash.models.decoder.transformer import abstract_params, lora_model_layout, unstack_layers
from jaxflash.sharding.leaves import LayoutMismatchError, check_same_leaves, leaf_signatures
from jaxflash.sharding.rules import Rules


class EngineWeights:
    """Param layout and placement of one engine (see the module docstring).

    Args:
      model_config: the decoder's ``ModelConfig``.
      mesh: the engine's mesh.
      rules: logical-axis rules for the params (None replicates them).
      lora: serve a LoRA model (stored base + adapters, ``models.adapters.lora``).

    Attributes:
      shardings: NamedShardings of the unstacked params (``engine_shardings``).
    """

    def __init__(
        self, model_config: ModelConfig, mesh: Mesh, rules: Rules | None, lora: LoraConfig | None
    ):
        self._mesh = mesh
        self._model_config = model_config
        self.lora = lora
        self._unstack_adapters: Any = None  # with_adapters' jitted unstacking, built once
        self.shardings = engine_shardings(model_config, mesh, rules, lora)
        if lora is None:
            stacked = abstract_params(model_config)
        else:  # the stored base with adapters beside their weights (models.adapters.lora)
            stacked = lora_model_layout(model_config, lora)[0]
        one_layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
        unstacked = {**stacked, "layers": (one_layer["layers"],) * model_config.n_layers}
        # What set_params / load_params accept: the model's tree, layers stacked or not,
        # or the engine's own (placed: matmul weights maybe in the compute dtype), or the
        # model's stacked tree already in the engine's dtypes (a delta publish's copy).
        self._signatures = {
            "stacked": leaf_signatures(stacked),
            "stacked_engine": leaf_signatures(as_engine_dtypes(stacked, model_config, lora)),
            "unstacked": leaf_signatures(unstacked),
            "engine": leaf_signatures(as_engine_dtypes(unstacked, model_config, lora)),
        }

    def place_params(self, params: Any) -> Any:
        """Params in the engine's layout (layers unstacked) on the engine's mesh.

        Takes stacked (learner / sync / checkpoint) or unstacked params, host or
        device; see ``engine.params.place`` (with bfloat16 compute over float32
        weights, the matmul weights are stored in bfloat16: ``engine_dtypes``). Every
        program also accepts stacked params, but then slices each layer out of the
        stack (and casts it) at every call.
        """
        self.check_params(params)
        return place(params, self.shardings, self._mesh, self._model_config, self.lora)

    def place_base(self, base: Any) -> Any:
        """The frozen base of a LoRA engine, placed once (layers unstacked).

        Args:
          base: the stored base (``lora.split(params)[1]``; learner ``TrainState.base``).
        """
        _, base_sh = lora_lib.split(self.shardings)
        return place(base, base_sh, self._mesh)

    def with_adapters(self, base: Any, adapters: Any) -> Any:
        """Params of a LoRA engine: ``base`` from ``place_base`` (kept, not copied) with
        ``adapters`` (stacked or unstacked, any device) placed beside their weights.

        Raises:
          ValueError: the engine was built without ``lora``; LayoutMismatchError: the
            adapters' tree, shapes or dtypes differ from the engine's.
        """
        if self.lora is None:
            raise ValueError("LlamaEngine.with_adapters: the engine was built without lora")
        if self._unstack_adapters is None:
            # Built once: a jit per call would recompile the unstacking at every update
            # (about 20 s for SmolLM2's rank-16 adapters on this CPU).
            adapter_sh, _ = lora_lib.split(self.shardings)
            stack_sh = jax.tree.map(
                lambda sh: NamedSharding(self._mesh, PartitionSpec(None, *sh.spec)),
                adapter_sh["layers"][0],
            )
            unstack = jax.jit(
                lambda layers: unstack_layers({"layers": layers})["layers"],
                out_shardings=adapter_sh["layers"],
            )
            self._unstack_adapters = (adapter_sh, stack_sh, unstack)
        adapter_sh, stack_sh, unstack = self._unstack_adapters
        if isinstance(adapters["layers"], tuple | list):
            placed = place(adapters, adapter_sh, self._mesh)
        else:
            layers = unstack(jax.device_put(adapters["layers"], stack_sh))  # no-op if there
            rest = {k: v for k, v in adapters.items() if k != "layers"}
            placed = {"layers": layers, **jax.device_put(rest, {k: adapter_sh[k] for k in rest})}
        params = lora_lib.merge(base, placed)
        self.check_params(params)
        return params

    def check_params(self, params: Any) -> None:
        """Refuse params whose tree, shapes or dtypes differ from the engine's model.

        Cheap (reads ``.shape`` / ``.dtype`` of each leaf, no device sync); the same
        leaf check as the cross-process transfer (``sharding.leaves``). Called by
        ``place_params`` and so by every ``set_params`` and server weight update.

        Args:
          params: nested dict, layers stacked ([L, ...] leaves) or unstacked (a
            tuple of per-layer dicts), as ``place_params`` takes.

        Raises:
          LayoutMismatchError (a ValueError): a missing or extra leaf, or a leaf
            whose shape or dtype differs, e.g. a float32 tree for a bfloat16 model
            (which would recompile every program) or an lm_head of another
            vocabulary (which would sample ids outside it); names the leaf.
        """
        if not isinstance(params, dict) or "layers" not in params:
            raise LayoutMismatchError(
                "", f"LlamaEngine: params must be a dict with 'layers', got {type(params).__name__}"
            )
        kind = "unstacked" if isinstance(params["layers"], tuple | list) else "stacked"
        offered = leaf_signatures(params)
        if kind == "unstacked" and offered == self._signatures["engine"]:
            return  # already in the engine's layout (placed)
        if kind == "stacked" and offered == self._signatures["stacked_engine"]:
            return  # stacked, already in the engine's dtypes (``sync.delta_publish``)
        check_same_leaves(
            offered, self._signatures[kind], sender="new params", receiver="engine's model"
        )
