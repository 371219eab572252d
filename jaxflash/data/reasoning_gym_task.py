"""Procedural reasoning tasks from reasoning-gym (Countdown, chain sums, puzzles, ...).

reasoning-gym (PyPI ``reasoning-gym``, open-thought/reasoning-gym) generates
~100 families of verifiable problems offline, each with its own verifier
(``score_answer``). ``ReasoningGymTask(dataset, seed, split=...)`` turns one
family into jaxflash rows: row ``i`` is a pure function of (seed, split, i),
so the data cursor is an int and a resumed run reads the same problems.

Rows: ``{"prompt": <question + answer-format instruction>, "answer": <JSON of
{"dataset", "entry"}>, "meta"}``. The answer carries the whole entry
(question, oracle answer, metadata) because reasoning-gym's verifiers need it
(Countdown checks the numbers used and the target); the ``reasoning_gym``
reward (``jaxflash.rewards.reasoning_gym_reward``) reads it back.

Train and eval never share a question: each question is hashed (BLAKE2b) into
the eval part (``eval_fraction``) or the train part, and each split draws
candidates from its own seed stream until one falls in its part (the same
construction as ``arithmetic.ArithmeticTask``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Literal

DEFAULT_TEMPLATE = (
    "{question}\n\nThink it through, then give only your final answer inside "
    "<answer></answer> tags."
)
_BLOCK = 1024  # items per reasoning-gym dataset object (some datasets pre-generate `size` items)
_MAX_TRIES = 256  # candidates per row: P(no eval question in 256 at 10 %) ~ 2e-12
_SPLIT_STREAM = {"train": 0, "eval": 1}


def _stable_int(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # non-negative 63-bit


def _jsonable(x: Any) -> Any:
    if isinstance(x, set | frozenset):
        return sorted(x, key=repr)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def entry_to_answer(dataset: str, entry: Mapping[str, Any]) -> str:
    """The answer string of a row: JSON ``{"dataset": ..., "entry": ...}``.

    Raises:
      ValueError: the entry holds values JSON cannot carry (names the dataset).
    """
    try:
        return json.dumps({"dataset": dataset, "entry": dict(entry)}, default=_jsonable)
    except TypeError as e:
        raise ValueError(
            f"reasoning-gym dataset {dataset!r}: entry is not JSON-able ({e})"
        ) from None


def _import_reasoning_gym():
    try:
        import reasoning_gym  # noqa: PLC0415 (optional, ~1 s import)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reasoning-gym tasks need the reasoning-gym package: pip install reasoning-gym"
        ) from e
    return reasoning_gym


class ReasoningGymTask:
    """Rows of one reasoning-gym dataset, deterministic in (seed, split, index).

    Args:
      dataset: a reasoning-gym dataset name ("countdown", "chain_sum", ...).
      seed: base seed.
      split: "train" or "eval" (disjoint questions).
      eval_fraction: share of the question space held out for eval, in (0, 1).
      config: keyword options of the dataset's config (e.g. Countdown's
        ``min_numbers``); validated by reasoning-gym.
      template: prompt format with a ``{question}`` field.

    Raises:
      ValueError: unknown dataset (lists the known ones), bad split/fraction,
        a template without ``{question}``, or a config reasoning-gym rejects.
      ImportError: reasoning-gym is not installed.
    """

    def __init__(
        self,
        dataset: str,
        seed: int,
        *,
        split: Literal["train", "eval"] = "train",
        eval_fraction: float = 0.1,
        config: Mapping[str, Any] | None = None,
        template: str = DEFAULT_TEMPLATE,
    ) -> None:
        rg = _import_reasoning_gym()
        if dataset not in rg.factory.DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}; known: {sorted(rg.factory.DATASETS)}"
            )
        if split not in _SPLIT_STREAM:
            raise ValueError(f"ReasoningGymTask.split must be train | eval, got {split!r}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(
                f"ReasoningGymTask.eval_fraction must be in (0, 1), got {eval_fraction}"
            )
        if "{question}" not in template:
            raise ValueError("ReasoningGymTask.template must contain {question}")
        self.dataset, self.seed, self.split = dataset, int(seed), split
        self.eval_fraction = float(eval_fraction)
        self.config = dict(config or {})
        self.template = template
        self._block(0)  # fail now on a bad config, not at the first row

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one task object per run)
    def _block(self, block: int) -> Any:
        rg = _import_reasoning_gym()
        seed = _stable_int(self.seed, _SPLIT_STREAM[self.split], block) % (2**31)
        try:
            return rg.create_dataset(self.dataset, seed=seed, size=_BLOCK, **self.config)
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(
                f"reasoning-gym dataset {self.dataset!r} rejected config {self.config}: {e}"
            ) from None

    def _in_eval_part(self, question: str) -> bool:
        return _stable_int(self.dataset, question) / 2.0**63 < self.eval_fraction

    def row(self, index: int) -> dict[str, Any]:
        """Row ``index`` of this split: {"prompt", "answer", "meta"}.

        Raises:
          RuntimeError: no question of this split among the candidates (the
            dataset's question space is too small for the split).
        """
        want_eval = self.split == "eval"
        for attempt in range(_MAX_TRIES):
            candidate = index * _MAX_TRIES + attempt
            block, position = divmod(candidate, _BLOCK)
            entry = self._block(block)[position]
            if self._in_eval_part(entry["question"]) == want_eval:
                return {
                    "prompt": self.template.format(question=entry["question"]),
                    "answer": entry_to_answer(self.dataset, entry),
                    "meta": {"source": f"reasoning_gym:{self.dataset}", "index": index},
                }
        raise RuntimeError(
            f"reasoning-gym {self.dataset!r}: no {self.split} question in {_MAX_TRIES} candidates "
            f"for row {index} (question space too small for eval_fraction={self.eval_fraction})"
        )

    def rows(self, start: int, stop: int) -> list[dict[str, Any]]:
        return [self.row(i) for i in range(start, stop)]
