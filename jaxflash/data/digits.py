"""Seeded procedural digit-string tasks: "reverse 3 1 4" -> "413" (also sort, copy).

Built for learning from scratch: a tiny random-init model with a vocabulary of
a few words (the digits, the operation words, ``=``) can learn these by RL in a
few hundred steps, and ``rewards.digits.digit_match`` gives partial credit per
position, so a random policy already scores about 1 / ``num_symbols`` and every
position learned raises the reward (see benchmarks/staleness.py).

Row i is a pure function of (seed, split, i), as in ``arithmetic``: its numpy
Generator is seeded by ``[seed, split_stream, i]``. Train and eval never share a
problem: each digit string is hashed (BLAKE2b) into the eval part (fraction
``eval_fraction``) or the train part, and a split rejection-samples until it draws
from its own part.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

import numpy as np

OPS = ("reverse", "sort", "copy")
_SPLIT_STREAM = {"train": 0, "eval": 1}
_MAX_TRIES = 10_000


def apply_op(op: str, digits: list[int]) -> list[int]:
    """The answer digits of ``op`` ("reverse" | "sort" | "copy") on ``digits``.

    Raises:
      ValueError: unknown op.
    """
    if op == "reverse":
        return digits[::-1]
    if op == "sort":
        return sorted(digits)
    if op == "copy":
        return list(digits)
    raise ValueError(f"digit task op must be one of {OPS}, got {op!r}")


def _in_eval_part(key: str, eval_fraction: float) -> bool:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < eval_fraction


@dataclasses.dataclass(frozen=True)
class DigitTask:
    """A deterministic, infinite stream of digit-string problems.

    Attributes:
      seed: base seed; rows are a function of (seed, split, index).
      op: "reverse" | "sort" | "copy".
      length: digits per problem (>= 1); the answer has the same length.
      num_symbols: digits drawn uniformly from 0 .. num_symbols - 1 (2..10).
      split: "train" or "eval"; the two never share a digit string.
      eval_fraction: share of the problem space held out for eval, in (0, 1).

    Prompt: ``"<op> d1 d2 ... dk"`` (space-separated, so every digit is one word);
    answer: the result digits without spaces, e.g. ``"413"``.
    """

    seed: int
    _: dataclasses.KW_ONLY
    op: str = "reverse"
    length: int = 3
    num_symbols: int = 10
    split: Literal["train", "eval"] = "train"
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"DigitTask.seed must be an int >= 0, got {self.seed!r}")
        if self.op not in OPS:
            raise ValueError(f"DigitTask.op must be one of {OPS}, got {self.op!r}")
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"DigitTask.length must be an int >= 1, got {self.length!r}")
        if not isinstance(self.num_symbols, int) or not 2 <= self.num_symbols <= 10:
            raise ValueError(
                f"DigitTask.num_symbols must be an int in [2, 10], got {self.num_symbols!r}"
            )
        if self.split not in _SPLIT_STREAM:
            raise ValueError(f"DigitTask.split must be 'train' or 'eval', got {self.split!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"DigitTask.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.num_symbols**self.length < 20:
            raise ValueError(
                f"DigitTask: {self.num_symbols}^{self.length} digit strings are too few to "
                "split into train and eval parts (need >= 20)"
            )

    def problem(self, i: int) -> tuple[list[int], list[int]]:
        """(input digits, answer digits) of row i.

        Raises:
          ValueError: i < 0.
          RuntimeError: no string of this split within 10,000 draws.
        """
        if not isinstance(i, int | np.integer) or i < 0:
            raise ValueError(f"DigitTask row index must be an int >= 0, got {i!r}")
        rng = np.random.default_rng([self.seed, _SPLIT_STREAM[self.split], int(i)])
        want_eval = self.split == "eval"
        for _ in range(_MAX_TRIES):
            digits = [int(d) for d in rng.integers(0, self.num_symbols, size=self.length)]
            key = "".join(map(str, digits))
            if _in_eval_part(key, self.eval_fraction) == want_eval:
                return digits, apply_op(self.op, digits)
        raise RuntimeError(f"DigitTask({self}) found no {self.split} problem for row {i}")

    def row(self, i: int) -> dict[str, str]:
        """Row i as {"prompt": "<op> d1 ... dk", "answer": "<digits>"}."""
        digits, answer = self.problem(i)
        return {
            "prompt": " ".join([self.op, *map(str, digits)]),
            "answer": "".join(map(str, answer)),
        }

    def rows(self, start: int, stop: int) -> list[dict[str, str]]:
        """Rows [start, stop)."""
        return [self.row(i) for i in range(start, stop)]
