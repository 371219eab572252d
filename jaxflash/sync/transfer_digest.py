"""A content digest of a param tree: to check bit for bit that two programs hold equal weights.

``tree_digest`` hashes, leaf by leaf in tree order, the leaf's path, dtype, shape
and raw bytes (SHA-256). Two trees with the same paths and bit-identical values
get the same digest whatever their sharding or device; any flipped bit, a
different dtype (float32 vs bfloat16 of the same numbers) or a renamed leaf
changes it. It copies each leaf to the host, one at a time (a generation program
calls it after an install only when asked to: it costs one host copy of the
weights).
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np


def tree_digest(tree: Any) -> str:
    """SHA-256 hex digest of ``tree``'s paths, dtypes, shapes and bytes.

    Args:
      tree: pytree of fully addressable jax.Arrays or numpy arrays.

    Raises:
      ValueError: a leaf that is not fully addressable from this process (in a
        multi-process program, gather it first).
    """
    h = hashlib.sha256()
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise ValueError(f"tree_digest: leaf {jax.tree_util.keystr(kp)} spans other processes")
        a = np.ascontiguousarray(jax.device_get(x))
        h.update(f"{jax.tree_util.keystr(kp)}|{a.dtype.name}|{list(a.shape)}|".encode())
        h.update(a.reshape(-1).view(np.uint8).tobytes())
    return h.hexdigest()
