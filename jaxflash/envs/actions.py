"""Parsing the policy's action out of its response text.

Two formats, chosen per environment (``ActionFormat``):

- ``"answer_tag"`` (ROLL's convention, arXiv 2510.11345): the response holds its action
  in ``<answer>...</answer>``; the model may think before it. The last complete tag
  counts (a model that quotes the format while reasoning and then answers is judged
  by its answer).
- ``"first_word"``: the response's first word is the action (``Down``, ``down.``,
  ``**Right**`` ...); what follows it is ignored. For small models that cannot keep
  a tag format (SmolLM2-135M-Instruct almost never writes ``<answer>`` tags, but
  answers a one-word question with a word). The *first* word, not any or the last
  action word: an autoregressive policy commits to its move first, and a response
  that drifts into free text after its move must not be credited with whichever
  word a lenient search finds; a response that starts with anything else (prose, a
  grid, "Leftmost") is invalid, and so is a first line that names several moves
  (the options listed back, "Left, Down, Right or Up").

Matching of the action vocabulary ignores case and surrounding whitespace.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

ActionFormat = Literal["answer_tag", "first_word"]
ACTION_FORMATS: tuple[str, ...] = ("answer_tag", "first_word")

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# Leading non-word characters (whitespace, markdown, quotes, brackets), then a word:
# letters only, so "Left2" or "Leftmost" is one word that is not "Left".
_FIRST_WORD_RE = re.compile(r"[\W_]*([^\W\d_]+)(?![\w])", re.UNICODE)


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


def parse_first_word(text: str, choices: Sequence[str]) -> int | None:
    """Index into ``choices`` of the response's first word, or None (format ``first_word``).

    The first word is the first run of letters after any leading whitespace,
    punctuation or markup (``"**Down**"``, ``" down."``, ``"Down\\nbecause..."`` ->
    Down); it must end at a non-letter/digit (``"Leftmost"``, ``"Left2"`` are not
    Left). Compared case-insensitively. A first line that names more than one of
    the choices (``"Left, Down, Right"``: the options echoed back) is not a move:
    under GRPO a policy learned to list the options to avoid the invalid-action
    penalty when a listing counted as its first word.

    Args:
      text: one turn's response text.
      choices: the action vocabulary (single words).

    Returns:
      the index of the matching choice, or None (empty text, or another first word).

    Raises:
      TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_first_word: text must be str, got {type(text).__name__}")
    match = _FIRST_WORD_RE.match(text)
    if match is None:
        return None
    word = match.group(1).lower()
    lowered = [c.lower() for c in choices]
    if word not in lowered:
        return None
    first_line = text.strip().split("\n", 1)[0].lower()
    named = {w for w in re.findall(r"[^\W\d_]+", first_line) if w in lowered}
    return lowered.index(word) if len(named) == 1 else None


def parse_action(text: str, choices: Sequence[str], action_format: ActionFormat) -> int | None:
    """Index into ``choices`` of the action in ``text`` under ``action_format``, or None.

    Raises:
      ValueError: an unknown ``action_format``.
    """
    if action_format == "answer_tag":
        return parse_choice(text, choices)
    if action_format == "first_word":
        return parse_first_word(text, choices)
    raise ValueError(
        f"parse_action: action_format must be one of {ACTION_FORMATS}, got {action_format!r}"
    )
