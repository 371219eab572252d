"""Parsing the policy's action out of its response text.

The convention (ROLL, arXiv 2510.11345) is that the response holds its action in
``<answer>...</answer>``; the model may think before it. The last complete tag
counts (a model that quotes the format while reasoning and then answers is judged
by its answer). Matching of the action vocabulary ignores case and surrounding
whitespace.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def parse_answer(text: str) -> str | None:
    """Content of the last complete ``<answer>...</answer>`` in ``text``, stripped.

    Args:
      text: one turn's response text.

    Returns:
      the stripped content, or None when there is no complete tag.

    Raises:
      TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_answer: text must be str, got {type(text).__name__}")
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def parse_choice(text: str, choices: Sequence[str]) -> int | None:
    """Index into ``choices`` of the action in the last ``<answer>`` tag, or None.

    Args:
      text: one turn's response text.
      choices: the action vocabulary (e.g. ``("Left", "Down", "Right", "Up")``);
        compared case-insensitively.

    Returns:
      the index of the matching choice, or None (no tag, or not a choice).
    """
    answer = parse_answer(text)
    if answer is None:
        return None
    lowered = [c.lower() for c in choices]
    try:
        return lowered.index(answer.lower())
    except ValueError:
        return None
