"""HBM bytes of a compiled TPU program, read instruction by instruction from its HLO.

XLA's ``cost_analysis()["bytes accessed"]`` sums, over the instructions of a
compiled module, the bytes each reads and writes in *every* memory space. On TPU
the compiler stages a weight into VMEM before the matmul reads it (``copy-start``
/ ``copy-done``, or ``slice-start`` / ``slice-done`` in slices), and the count
takes the weight 3 to 5 times: the staging copy's read, its output tuple (the VMEM
destination and, for ``copy-start``, the source again), the ``*-done``'s output
and the matmul's read from VMEM. Measured with libtpu 0.0.42.1 on one abstract
v5e chip: ``x[32, 1536] @ w[1536, 4480]`` in bfloat16 (a 13.8 MB weight) counts
69.2 MB (tests/sizing/test_tpu_compile.py); a decode step of Qwen2.5-1.5B's layers counts
193 MB per layer per chip against 47 MB of bfloat16 weights. Only the first read is
HBM traffic. (XLA counts nothing inside a Mosaic kernel either: ``sizing.kv_pool``.)

``hbm_traffic`` walks the module's text and counts, per instruction, only the
buffers that live in HBM (layouts without a memory-space mark ``S(n)``; VMEM is
``S(1)``):

- a fusion reads each operand whole, except one its fused computation only slices
  or gathers from (the slices' bytes), and writes its output, except an in-place
  root (dynamic-update-slice, scatter: the update's bytes, the buffer not read);
- ``copy-start`` / ``slice-start`` move the destination's bytes: a read where the
  source is in HBM, a write where the destination is; the ``*-done`` moves nothing;
- a Mosaic custom call counts nothing (its reads are computed on paper where they
  matter, ``sizing.kv_pool``); bitcasts, tuples, parameters and constants nothing;
- every other instruction reads its operands and writes its output;
- a ``while`` body counts ``trips`` times (XLA counts it once; the caller knows the
  trips: a decode block's steps), a ``call`` or ``conditional`` once per branch.

Sizes are those of the buffers as laid out: each dim padded to the layout's first
tile (``{1,0:T(8,128)}``), as XLA's TPU count does. The same walk with XLA's own
rules (every memory space, loop bodies once, the staging tuples whole) is kept as
``xla_rules``: it reproduces ``bytes accessed`` within 1 % on the decode blocks
measured (2- and 4-layer Qwen2.5-1.5B engines with bfloat16 and float32 weights,
599-1,729 MB; the 28-layer data=4 x tensor=2 engine, 5.86 GB; Llama-3.1-8B's
tensor=8 engine, 12.28 GB), which is the check that the walk reads the module the way
XLA does. It does not everywhere: on Qwen2.5-1.5B over data=2 x tensor=4 it counts
5.52 GB against XLA's 4.13 (multi-output fusions that also write a weight); a caller
keeps XLA's figure where the two disagree (``HbmTraffic.agrees``). XLA counts a
Mosaic call's small operands (not the ``pl.ANY`` ones it DMAs itself); the walk
counts none, a few MB that only a tiny program notices.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterator

_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM) + r")\[([\d,]*)\](\{[^}]*\})?")
_NO_TRAFFIC = {"bitcast", "tuple", "get-tuple-element", "parameter", "constant", "after-all",
               "partition-id", "replica-id", "opt-barrier", "iota", "while", "call",
               "conditional", "custom-call"}  # fmt: skip
_DONE = {"copy-done", "slice-done"}
_SLICING = {"slice", "dynamic-slice", "gather"}
AGREE_TOLERANCE = 0.05
"""Largest relative gap between ``xla_rules`` and XLA's own count for the walk to be used."""
AGREE_SLACK_BYTES = 4 << 20
"""...or absolute gap: what the walk leaves out under XLA's rules (a Mosaic kernel's own
small operands, scalars) is a few MB, which only a tiny program notices."""


def _padded(dims: list[int], layout: str) -> list[int]:
    """``dims`` padded to the layout's first tile, as the buffer lies in memory: a
    layout ``{1,0:T(8,128)}`` rounds the minor-most dim up to 128 and the next to 8
    (``minor_to_major`` names which dims those are)."""
    m = re.match(r"\{([\d,]*):T\(([\d,]+)\)", layout or "")
    if m is None:
        return dims
    order = [int(d) for d in m.group(1).split(",") if d]
    tile = [int(t) for t in m.group(2).split(",")]
    out = list(dims)
    for j, t in enumerate(reversed(tile)):
        if j < len(order):
            k = order[j]
            out[k] = -(-out[k] // t) * t
    return out


def _arrays(shape: str) -> list[tuple[int, bool]]:
    """(bytes as laid out, tile padding included; in HBM) of every array of a (tuple)
    shape string."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        n = math.prod(_padded([int(d) for d in dims.split(",") if d], layout))
        out.append((n * _ITEM[dtype], re.search(r"S\(\d+\)", layout or "") is None))
    return out


def _bytes(shape: str, hbm_only: bool) -> int:
    return sum(b for b, hbm in _arrays(shape) if hbm or not hbm_only)


def _close(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start`` (round and curly alike)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({":
            depth += 1
        elif text[i] in ")}":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    args: str
    attrs: str
    root: bool


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """Computations of an HLO module's text -> their instructions; and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            m = re.match(r"^(ENTRY )?%([\w.\-]+) ", line)
            if m and line.rstrip().endswith("{"):
                cur = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
            continue
        if line.startswith("}"):
            cur = None
            continue
        m = re.match(r"^\s*(ROOT )?%([\w.\-]+) = ", line)
        if m is None:
            continue
        rest = line[m.end() :]
        if rest.startswith("("):
            end = _close(rest, 0)
            shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        op, _, rest = rest.partition("(")
        end = _close("(" + rest, 0)
        args, attrs = rest[: end - 1], rest[end:]
        operands = tuple(re.findall(r"%([\w.\-]+)", args))
        cur.append(_Instr(m.group(2), shape, op, operands, args, attrs, bool(m.group(1))))
    if not entry:
        raise ValueError("hbm_traffic: no ENTRY computation in the HLO text")
    return comps, entry


@dataclasses.dataclass(frozen=True, kw_only=True)
class HbmTraffic:
    """One compiled program's bytes, per device (bytes).

    Attributes:
      hbm: bytes read from and written to HBM, loop bodies x their trips (module doc).
      xla_rules: the same walk under XLA's rules (all memory spaces, bodies once).
      xla: XLA's own ``bytes accessed`` (0 when not given).
      top: the largest HBM items, (bytes, instruction, op, computation), largest first.
    """

    hbm: float
    xla_rules: float
    xla: float = 0.0
    top: tuple[tuple[float, str, str, str], ...] = ()

    @property
    def agrees(self) -> bool:
        """The walk reproduces XLA's count within ``AGREE_TOLERANCE`` or
        ``AGREE_SLACK_BYTES`` (or no count was given)."""
        if not self.xla:
            return True
        gap = abs(self.xla_rules - self.xla)
        return gap <= max(AGREE_TOLERANCE * self.xla, AGREE_SLACK_BYTES)


def _multiplicities(comps: dict[str, list[_Instr]], entry: str, trips: int) -> dict[str, float]:
    """How often each computation runs per execution of the module (fusions excluded)."""
    mult: dict[str, float] = defaultdict(float)
    mult[entry] = 1.0
    order = [entry]
    for name in order:  # computations are appended as they are found: callers first
        for ins in comps[name]:
            if ins.op == "while":
                callees = [(re.search(r"body=%([\w.\-]+)", ins.attrs).group(1), trips)]
            elif ins.op in ("call", "conditional"):
                found = re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", ins.attrs)
                found += re.findall(r"%([\w.\-]+)", ins.attrs.partition("branch_computations=")[2])
                callees = [(c, 1) for c in found if c in comps]
            else:
                continue
            for callee, times in callees:
                mult[callee] += mult[name] * times
                if callee not in order:
                    order.append(callee)
    return mult


def _fusion(ins, comps, shapes, hbm_only) -> tuple[float, float]:
    """(bytes read, bytes written) of one fusion instruction (module doc)."""
    body = comps[re.search(r"calls=%([\w.\-]+)", ins.attrs).group(1)]
    by_name = {i.name: i for i in body}
    users: dict[str, list[_Instr]] = defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)

    def through_bitcasts(name: str) -> Iterator[_Instr]:
        for u in users[name]:
            yield from through_bitcasts(u.name) if u.op == "bitcast" else (u,)

    def source(name: str) -> _Instr:
        i = by_name[name]
        return source(i.operands[0]) if i.op == "bitcast" else i

    params = {int(i.args): i for i in body if i.op == "parameter"}
    root = source(next(i.name for i in body if i.root))
    written, in_place = None, None
    if root.op in ("dynamic-update-slice", "scatter"):
        update = root.operands[1 if root.op == "dynamic-update-slice" else 2]
        written = _bytes(by_name[update].shape, hbm_only=False)
        target = source(root.operands[0])
        in_place = int(target.args) if target.op == "parameter" else None
    read = 0.0
    for k, name in enumerate(ins.operands):
        shape = shapes.get(name, "")
        if k == in_place or (hbm_only and not any(hbm for _, hbm in _arrays(shape))):
            continue
        uses = list(through_bitcasts(params[k].name)) if k in params else []
        if uses and all(u.op in _SLICING for u in uses):
            read += sum(_bytes(u.shape, hbm_only=False) for u in uses)
        else:
            read += _bytes(shape, hbm_only)
    if written is None:
        return read, _bytes(ins.shape, hbm_only)
    out_in_hbm = any(hbm for _, hbm in _arrays(ins.shape))
    return read, written if out_in_hbm or not hbm_only else 0.0


def _walk(comps, entry, trips, *, hbm_only: bool, xla: bool) -> list[tuple[float, _Instr, str]]:
    shapes = {i.name: i.shape for c in comps.values() for i in c}
    out = []
    for comp, times in _multiplicities(comps, entry, 1 if xla else trips).items():
        for ins in comps[comp]:
            if ins.op in _DONE:
                moved = 0.0 if not xla else _bytes(ins.shape, hbm_only=False)
            elif ins.op in _NO_TRAFFIC:
                continue
            elif ins.op == "fusion":
                moved = sum(_fusion(ins, comps, shapes, hbm_only))
            elif ins.op in ("copy-start", "slice-start"):
                # copy-start: (destination, source, context); slice-start: ((source),
                # destination, context). Both move the destination's bytes.
                arrays = _arrays(ins.shape)
                dest_bytes, dest_hbm = arrays[0] if ins.op == "copy-start" else arrays[-2]
                source = shapes.get(ins.operands[0], "")
                if xla:
                    read = _bytes(source, False) if ins.op == "copy-start" else dest_bytes
                    moved = read + (
                        _bytes(ins.shape, False) if ins.op == "copy-start" else dest_bytes
                    )
                else:
                    src_hbm = any(hbm for _, hbm in _arrays(source))
                    moved = dest_bytes * ((src_hbm or not hbm_only) + (dest_hbm or not hbm_only))
            elif ins.op == "dynamic-update-slice":  # in place: the update, read and written
                moved = 2 * _bytes(shapes.get(ins.operands[1], ""), hbm_only=False)
            else:
                moved = sum(_bytes(shapes.get(o, ""), hbm_only) for o in ins.operands)
                moved += _bytes(ins.shape, hbm_only)
            out.append((times * moved, ins, comp))
    return out


def hbm_traffic(text: str, *, trips: int = 1, xla_bytes: float = 0.0, top: int = 8) -> HbmTraffic:
    """HBM bytes of a compiled program (``compiled.as_text()``), per device.

    Args:
      text: the compiled (scheduled, memory-space assigned) HLO module's text.
      trips: how many times each ``while`` body runs (a decode block's steps).
      xla_bytes: XLA's ``bytes accessed`` for the same program, to check the walk.
      top: how many of the largest HBM items to keep.

    Returns:
      ``HbmTraffic`` (module doc).

    Raises:
      ValueError: the text has no ENTRY computation.
    """
    comps, entry = _parse(text)
    rows = _walk(comps, entry, trips, hbm_only=True, xla=False)
    rules = _walk(comps, entry, trips, hbm_only=False, xla=True)
    biggest = sorted(rows, key=lambda r: -r[0])[:top]
    return HbmTraffic(
        hbm=float(sum(r[0] for r in rows)),
        xla_rules=float(sum(r[0] for r in rules)),
        xla=float(xla_bytes),
        top=tuple((b, i.name, i.op, c) for b, i, c in biggest),
    )
