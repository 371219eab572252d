"""Convert between an NNX module and the nested dict of arrays the rest of jaxflash moves.

The learner, the engine, weight sync and checkpoints all handle plain pytrees
(``{"embed_vd": ..., "layers": {"w_q_ldnh": ..., ...}, ...}``); the module is only
the place where parameters are born and described (logical axes, init).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

Params = dict[str, Any]
"""Nested dict of arrays in the layout of docs/CONTRACTS.md (models section)."""


def get_params(model: nnx.Module) -> Params:
    """The module's parameters as a nested dict of arrays (no copy).

    Args:
      model: an NNX module (e.g. ``Llama``), possibly abstract (from nnx.eval_shape).

    Returns:
      Nested dict mirroring ``nnx.state(model, nnx.Param)``, leaves are the arrays
      (or ShapeDtypeStructs for an abstract module).
    """
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}/"))
        return out
    return {prefix.rstrip("/"): tree}


def check_params(expected: Params, params: Params, *, what: str = "params") -> None:
    """Raise if ``params`` differs from ``expected`` in keys, shapes or dtypes.

    Args:
      expected: nested dict of arrays / ShapeDtypeStructs (the reference layout).
      params: nested dict of arrays (numpy or jax) to check.
      what: name used in error messages.

    Raises:
      ValueError: naming every missing or unexpected path, or the first path whose
        shape or dtype differs (with both values).
    """
    want, got = _flatten(expected), _flatten(params)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"{what}: missing paths {missing}, unexpected paths {extra}")
    for path, ref in want.items():
        value = got[path]
        shape, dtype = tuple(np.shape(value)), np.dtype(getattr(value, "dtype", None))
        if shape != tuple(ref.shape):
            raise ValueError(f"{what}[{path!r}]: shape {shape}, expected {tuple(ref.shape)}")
        if dtype != np.dtype(ref.dtype):
            raise ValueError(f"{what}[{path!r}]: dtype {dtype}, expected {np.dtype(ref.dtype)}")


def set_params(model: nnx.Module, params: Params) -> None:
    """Replace the module's parameters in place with ``params``.

    Args:
      model: an NNX module whose parameters have the layout of ``params``.
      params: nested dict of arrays (numpy or jax); same keys, shapes and dtypes
        as ``get_params(model)``. Numpy arrays are moved to the default device.

    Raises:
      ValueError: a path is missing/unexpected, or a shape/dtype differs (the
        message names the path). Cast first, e.g. with ``jax.tree.map``.
    """
    state = nnx.state(model, nnx.Param)
    check_params(nnx.to_pure_dict(state), params)
    params = jax.tree.map(jax.numpy.asarray, params)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
