"""Leaf-by-leaf tree checks shared by every weight hand-over (no device sync).

A weight update must have exactly the receiver's tree: the same leaf paths, and
per leaf the same shape and dtype. The cross-process path
(``sync.transfer_layout.check_receivable``) checks that plus the sharding; the
in-process path (``generation.engine.llama_engine.LlamaEngine.check_params``, called by every
``set_params`` and generation-server weight update) checks only this, because
placing on the engine's mesh fixes the sharding. A float32 tree sent into a
bfloat16 engine would otherwise recompile every program, and an ``lm_head`` of the
wrong vocabulary would sample ids outside the tokenizer.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class LayoutMismatchError(ValueError):
    """A leaf that cannot be transferred as laid out (names the leaf and both layouts).

    Attributes:
      path: the leaf's tree path (``jax.tree_util.keystr``), or "" for whole-tree faults.
    """

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


LeafSignature = tuple[tuple[int, ...], str]  # (shape, numpy dtype name)


def leaf_signatures(tree: Any) -> dict[str, LeafSignature]:
    """(shape, dtype name) per leaf path of a pytree of arrays or ShapeDtypeStructs.

    Reads only ``.shape`` and ``.dtype`` (no device sync, no copy): cheap enough
    to run on every weight update.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        jax.tree_util.keystr(kp): (tuple(int(n) for n in np.shape(x)), np.dtype(x.dtype).name)
        for kp, x in flat
    }


def check_same_leaves(
    offered: dict[str, LeafSignature],
    wanted: dict[str, LeafSignature],
    *,
    sender: str = "sender",
    receiver: str = "receiver",
) -> None:
    """Refuse unless both sides have the same leaf paths, shapes and dtypes.

    The tree part of ``check_receivable``, also used for in-process weight
    updates (``LlamaEngine.check_params``), where no mesh layout is exchanged.

    Args:
      offered, wanted: ``leaf_signatures`` of what is offered / what is expected.
      sender, receiver: how the two sides are named in the message.

    Raises:
      LayoutMismatchError: leaves missing on either side, or a leaf whose shape or
        dtype differs (names the leaf and both shapes/dtypes).
    """
    missing = sorted(set(wanted) - set(offered))
    extra = sorted(set(offered) - set(wanted))
    if missing or extra:
        raise LayoutMismatchError(
            (missing or extra)[0],
            f"trees differ: {receiver} leaves missing on the {sender} {missing}; "
            f"{sender} leaves the {receiver} lacks {extra}",
        )
    for path, (w_shape, w_dtype) in wanted.items():
        o_shape, o_dtype = offered[path]
        if tuple(o_shape) != tuple(w_shape) or o_dtype != w_dtype:
            raise LayoutMismatchError(
                path,
                f"leaf {path}: {sender} has {o_dtype}{list(o_shape)}, "
                f"{receiver} expects {w_dtype}{list(w_shape)}",
            )
