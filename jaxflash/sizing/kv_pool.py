"""The engine's KV cache per chip, and a decode step's HBM bytes counted on paper.

``KvPool.from_state`` reads the engine's abstract ``DecodeState`` (the one the
decode block is compiled against, with its shardings), so what the plan prints is
what the engine allocates: a dense cache (every slot reserves S positions) or a
paged pool (N pages of P positions per layer, ``models.caches.paged_kv_cache``), and how
many ways the generation mesh splits it (by KV head on main: a mesh wider than the
model's KV heads holds copies).

``decode_traffic`` sets XLA's count of a decode step's HBM bytes
(``cost_analysis()["bytes accessed"]``) beside what it must move on paper: the
weights one chip holds plus the K/V of the pages in use, at a given pool fill.
XLA's cost analysis does not see inside a Mosaic (Pallas TPU) kernel: on the
kernel path (``ragged_paged_attention``) its count stays flat as the pool grows
(measured: 0.92 MB while the pool went 16 -> 268 MB), so the KV reads there are
only the paper figure (pages in use x page bytes per chip). On the pure-JAX
reference path the gather reads every page-table entry of every slot (the whole
reservation, B x ceil(S / P) pages), and XLA counts it.

XLA's count also takes every weight 3-5 times on TPU: the compiler stages weights
into VMEM before a matmul reads them, and the count adds the staging copy and the
read from VMEM to the HBM read (``sizing.hbm_traffic``). The plan therefore also
walks the compiled decode block for its HBM bytes only (``DecodeTraffic.hbm``), and
the roofline uses that where the walk reproduces XLA's own count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

GIB = 1 << 30
ATTENTION_PATHS = ("dense", "reference", "tpu_kernel")


def _shard_bytes(x: Any) -> int:
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    return math.prod(shape) * np.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvPool:
    """One engine's KV cache as allocated (bytes, tokens).

    Attributes:
      kind: "dense" or "paged".
      attention: "dense" (dense cache), "reference" (paged, pure-JAX gather of every
        page of every slot) or "tpu_kernel" (paged, ``ragged_paged_attention``).
      slots: B, decode slots.
      positions: S, positions a slot can address.
      page_size: P (1 for a dense cache).
      pages: N, pages in the pool (dense: B x S one-position "pages").
      token_bytes: K and V of one token over all layers, whole (unsplit), bytes.
      chip_bytes: what one chip holds of the cache (from the compiled shardings).
    """

    kind: str
    attention: str
    slots: int
    positions: int
    page_size: int
    pages: int
    token_bytes: int
    chip_bytes: int

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"KvPool.attention must be one of {ATTENTION_PATHS}")

    @classmethod
    def from_state(cls, state: Any) -> KvPool:
        """From an abstract (or real) ``DecodeState`` with shardings: what its cache
        says it holds (``models.caches.cache_face.SlotCache.allocation``), and the
        bytes one chip holds of its buffers."""
        held = state.cache.allocation()
        return cls(
            kind=held.kind,
            attention=held.attention,
            slots=held.rows,
            positions=held.positions,
            page_size=held.page_size,
            pages=held.pages,
            token_bytes=held.token_bytes,
            chip_bytes=sum(_shard_bytes(x) for x in held.buffers),
        )

    @property
    def pool_tokens(self) -> int:
        """Tokens the cache holds at once (N x P)."""
        return self.pages * self.page_size

    @property
    def total_bytes(self) -> int:
        """The whole cache over all chips, unsplit."""
        return self.pool_tokens * self.token_bytes

    @property
    def split(self) -> float:
        """Ways the mesh splits the cache (total / per chip; 1 = every chip a copy)."""
        return self.total_bytes / self.chip_bytes if self.chip_bytes else 1.0

    @property
    def token_chip_bytes(self) -> float:
        """Bytes one token's K/V (all layers) takes on one chip."""
        return self.chip_bytes / self.pool_tokens

    @property
    def reserved_tokens(self) -> int:
        """Positions the slots' page tables address: B x ceil(S / P) x P."""
        return self.slots * -(-self.positions // self.page_size) * self.page_size

    def _split_words(self) -> str:
        return f"split {self.split:g} ways" if self.split > 1 else "not split: whole on a chip"

    def describe(self) -> str:
        """One line: what the engine allocates, per chip."""
        if self.kind == "dense":
            return (
                f"dense KV cache {self.slots} slots x {self.positions} positions = "
                f"{self.pool_tokens:,} tokens, {self.chip_bytes / GIB:.2f} GiB per chip "
                f"({self._split_words()})"
            )
        return (
            f"paged KV pool {self.pool_tokens:,} tokens ({self.pages:,} pages x "
            f"{self.page_size}), {self.slots} slots of up to {self.positions} positions "
            f"({self.pool_tokens / self.reserved_tokens:.2f} of the dense reservation), "
            f"{self.chip_bytes / GIB:.2f} GiB per chip ({self._split_words()}), "
            f"attention {self.attention}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeTraffic:
    """HBM bytes of one decode step on one chip (bytes).

    Attributes:
      xla: XLA's ``bytes accessed`` per step (the decode block's / its steps): every
        memory space, VMEM staging of the weights included.
      hbm: HBM bytes per step read from the compiled program (``sizing.hbm_traffic``:
        the block's / its steps); 0 where not computed.
      weights: the engine's weights one chip holds (read once a step).
      kv_in_use: K/V of the pages in use at ``fill`` (what attention must read).
      kv_gathered: what the reference gather reads (every page of every slot); 0
        on the kernel path and for a dense cache.
      kernel_unseen: KV reads inside a Mosaic kernel, which XLA does not count
        (= kv_in_use on the kernel path, else 0).
      fill: fraction of the pool in use.
      in_use_tokens: tokens in use at ``fill``.
    """

    xla: float
    hbm: float
    weights: float
    kv_in_use: float
    kv_gathered: float
    kernel_unseen: float
    fill: float
    in_use_tokens: int

    @property
    def paper(self) -> float:
        """Weights + KV in use: the least a step must read."""
        return self.weights + self.kv_in_use

    @property
    def counted(self) -> float:
        """The compiled program's bytes per step: the HBM walk's, else XLA's."""
        return self.hbm if self.hbm > 0 else self.xla

    @property
    def effective(self) -> float:
        """The step's bytes for a roofline: the compiled count plus what it cannot see."""
        return self.counted + self.kernel_unseen


def decode_traffic(
    pool: KvPool,
    *,
    xla_bytes: float,
    steps: int,
    weight_bytes: float,
    fill: float = 0.5,
    hbm_bytes: float = 0.0,
) -> DecodeTraffic:
    """A decode step's bytes per chip: the compiled counts vs weights + KV of pages in use.

    Args:
      pool: the engine's cache (``KvPool.from_state``).
      xla_bytes: the decode block's ``bytes accessed`` per chip (all its steps).
      hbm_bytes: the block's HBM bytes per chip from ``sizing.hbm_traffic`` (all its
        steps); 0 = not computed.
      steps: decode steps in the block.
      weight_bytes: engine weights per chip.
      fill: fraction of the pool's tokens in use, in (0, 1].

    Raises:
      ValueError: steps < 1 or fill outside (0, 1].
    """
    if steps < 1 or not 0.0 < fill <= 1.0:
        raise ValueError(f"decode_traffic: steps >= 1 and 0 < fill <= 1, got {steps}, {fill}")
    tokens = int(fill * pool.pool_tokens)
    in_use = tokens * pool.token_chip_bytes
    gathered = pool.reserved_tokens * pool.token_chip_bytes if pool.attention == "reference" else 0
    return DecodeTraffic(
        xla=xla_bytes / steps,
        hbm=hbm_bytes / steps,
        weights=float(weight_bytes),
        kv_in_use=in_use,
        kv_gathered=gathered,
        kernel_unseen=in_use if pool.attention == "tpu_kernel" else 0.0,
        fill=fill,
        in_use_tokens=tokens,
    )


def format_traffic(name: str, t: DecodeTraffic, pool: KvPool) -> str:
    """Lines under the plan: XLA's bytes vs the paper figure, and what the path reads."""
    gb = 1e9
    unseen = t.kernel_unseen
    head = (
        f"decode HBM bytes per chip and step of {name}, pool {100 * t.fill:.0f} % in use "
        f"({t.in_use_tokens:,} of {pool.pool_tokens:,} tokens): XLA's cost analysis "
        f"{t.xla / gb:.3f} GB; on paper weights {t.weights / gb:.3f} GB + KV of pages in "
        f"use {t.kv_in_use / gb:.3f} GB = {t.paper / gb:.3f} GB; (XLA + kernel reads) / "
        f"paper {(t.xla + unseen) / t.paper:.2f}"
    )
    if t.hbm > 0:
        head += (
            f"\n  HBM side of the compiled step (sizing.hbm_traffic: VMEM staging of the "
            f"weights, which XLA's count adds 3-5 times, left out) {t.hbm / gb:.3f} GB; "
            f"(HBM + kernel reads) / paper {(t.hbm + unseen) / t.paper:.2f}"
        )
    if pool.attention == "tpu_kernel":
        why = (
            "  kernel path: XLA's cost analysis does not see inside the Mosaic kernel "
            f"(ragged_paged_attention), so its KV reads ({t.kernel_unseen / gb:.3f} GB, pages "
            f"in use x page bytes per chip, computed on paper) are added: "
            f"{t.effective / gb:.3f} GB per step in the roofline"
        )
    elif pool.attention == "reference":
        why = (
            "  reference path: the pure-JAX gather reads every page of every slot "
            f"({pool.reserved_tokens:,} tokens, {t.kv_gathered / gb:.3f} GB per chip, whatever "
            "is in use), and XLA counts it; the TPU kernel would read the pages in use only"
        )
    else:
        why = (
            "  dense cache: attention reads every slot's S positions "
            f"({pool.chip_bytes / gb:.3f} GB per chip), whatever is in use"
        )
    return head + "\n" + why
