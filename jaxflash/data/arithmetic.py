"""Seeded procedural arithmetic: "What is 37 + 5 * 2? Answer with just the number."

Row i is a pure function of (seed, split, i): its numpy Generator is seeded by
``[seed, split_stream, i]``, so the data cursor is a plain int, a restart
resumes exactly, and any worker can produce any row without coordination.

Train and eval never share a problem: each expression string is hashed
(BLAKE2b, stable across processes and Python versions) into the eval part
(fraction `eval_fraction`) or the train part of the problem space, and a split
rejection-samples until it draws a problem from its own part. Disjointness is
by construction, not by luck of the seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

import numpy as np

DEFAULT_TEMPLATE = "What is {expr}? Answer with just the number."
_SPLIT_STREAM = {"train": 0, "eval": 1}
_MAX_TRIES = 10_000


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Evaluate ``operands[0] ops[0] operands[1] ...`` with * before + and -.

    Args:
      operands: n ints; ops: n-1 of "+", "-", "*".

    Returns:
      The exact integer value (Python ints: no overflow).
    """
    # Fold products into terms, then add the signed terms left to right.
    terms, signs = [operands[0]], [1]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def in_eval_part(expr: str, eval_fraction: float) -> bool:
    """Whether expression `expr` belongs to the held-out part of the problem space."""
    digest = hashlib.blake2b(expr.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < eval_fraction


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """A deterministic, infinite stream of arithmetic problems.

    Attributes:
      seed: base seed; rows are a function of (seed, split, index).
      min_operands, max_operands: operand count, uniform in [min, max] (>= 2).
      min_digits, max_digits: digit count of each operand, uniform in [min, max];
        an operand with d digits is uniform over [10^(d-1), 10^d - 1] (0..9 for d = 1).
      ops: allowed operators, a non-empty subset of "+-*".
      allow_negative: if False, problems with a negative result are redrawn.
      template: prompt text with an "{expr}" field.
      split: "train" or "eval"; the two never share an expression.
      eval_fraction: share of the problem space held out for eval, in (0, 1).
    """

    seed: int
    _: dataclasses.KW_ONLY
    min_operands: int = 2
    max_operands: int = 2
    min_digits: int = 1
    max_digits: int = 1
    ops: str = "+-*"
    allow_negative: bool = False
    template: str = DEFAULT_TEMPLATE
    split: Literal["train", "eval"] = "train"
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"ArithmeticTask.seed must be an int >= 0, got {self.seed!r}")
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                "ArithmeticTask needs 2 <= min_operands <= max_operands, got "
                f"min_operands={self.min_operands}, max_operands={self.max_operands}"
            )
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                "ArithmeticTask needs 1 <= min_digits <= max_digits, got "
                f"min_digits={self.min_digits}, max_digits={self.max_digits}"
            )
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(
                f"ArithmeticTask.ops must be a non-empty subset of '+-*', got {self.ops!r}"
            )
        if "{expr}" not in self.template:
            raise ValueError(
                f"ArithmeticTask.template must contain '{{expr}}', got {self.template!r}"
            )
        if self.split not in _SPLIT_STREAM:
            raise ValueError(f"ArithmeticTask.split must be 'train' or 'eval', got {self.split!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(
                f"ArithmeticTask.eval_fraction must be in (0, 1), got {self.eval_fraction}"
            )

    def _draw(self, rng: np.random.Generator) -> tuple[str, int]:
        n = int(rng.integers(self.min_operands, self.max_operands + 1))
        operands = []
        for _ in range(n):
            d = int(rng.integers(self.min_digits, self.max_digits + 1))
            low = 0 if d == 1 else 10 ** (d - 1)
            operands.append(int(rng.integers(low, 10**d)))
        ops = [self.ops[int(rng.integers(len(self.ops)))] for _ in range(n - 1)]
        expr = str(operands[0]) + "".join(
            f" {o} {x}" for o, x in zip(ops, operands[1:], strict=True)
        )
        return expr, evaluate(operands, ops)

    def problem(self, i: int) -> tuple[str, int]:
        """(expression, value) of row i.

        Raises:
          ValueError: i < 0.
          RuntimeError: no problem of this split satisfies the knobs within
            10,000 draws (e.g. allow_negative=False with ops "-" only and many operands).
        """
        if not isinstance(i, int | np.integer) or i < 0:
            raise ValueError(f"ArithmeticTask row index must be an int >= 0, got {i!r}")
        rng = np.random.default_rng([self.seed, _SPLIT_STREAM[self.split], int(i)])
        want_eval = self.split == "eval"
        for _ in range(_MAX_TRIES):
            expr, value = self._draw(rng)
            if value < 0 and not self.allow_negative:
                continue
            if in_eval_part(expr, self.eval_fraction) == want_eval:
                return expr, value
        raise RuntimeError(
            f"ArithmeticTask({self}) found no {self.split} problem for row {i} in "
            f"{_MAX_TRIES} draws; loosen the knobs"
        )

    def row(self, i: int) -> dict[str, str]:
        """Row i as {"prompt": user message, "answer": the integer as a string}."""
        expr, value = self.problem(i)
        return {"prompt": self.template.format(expr=expr), "answer": str(value)}

    def rows(self, start: int, stop: int) -> list[dict[str, str]]:
        """Rows [start, stop)."""
        return [self.row(i) for i in range(start, stop)]
