"""The stop set: every token id that ends a response, with where each one came from.

A checkpoint names the tokens that end a turn in several places, and they often
disagree: ``tokenizer_config.json``'s ``eos_token`` (Qwen2.5 base:
``<|endoftext|>``), ``generation_config.json``'s ``eos_token_id`` list (Qwen2.5:
``[<|im_end|>, <|endoftext|>]``; Llama 3.1: ``[<|end_of_text|>, <|eom_id|>,
<|eot_id|>]``), ``config.json``'s ``eos_token_id``, GGUF metadata
(``tokenizer.ggml.eos_token_id``, ``eot_token_id``, ``eom_token_id``) and the
chat template itself (the special token written right after an assistant
message: ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``</s>``). Stopping
on one of them only lets a model that ends its turn with another run to
``max_new_tokens``: marked truncated, and under a truncation penalty a correct
answer scores 0. The stop set is the union of all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxflash.models.text.chat_template import ChatTemplateError, render_chat_template

_PROBE = "jaxflashProbe7f3a"  # an assistant message no template rewrites
TEMPLATE_SOURCE = "chat template end of turn"

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""Named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES)."""


@dataclasses.dataclass(frozen=True)
class StopSet:
    """Token ids that end a response, and the sources that named each.

    Attributes:
      sources: {token id: tuple of source names}, e.g.
        ``{2: ("eos_token", "chat template end of turn")}``.
    """

    sources: Mapping[int, tuple[str, ...]]

    @property
    def ids(self) -> frozenset[int]:
        """The stop ids (never empty for a tokenizer: its eos is always in)."""
        return frozenset(self.sources)

    def describe(self, id_to_token: Any = None) -> str:
        """One line per id, ``id 'token' <- source, source``, for logs and configs."""
        lines = []
        for token_id in sorted(self.sources):
            text = "" if id_to_token is None else f" {id_to_token(token_id)!r}"
            lines.append(f"{token_id}{text} <- {', '.join(self.sources[token_id])}")
        return "; ".join(lines)


def build_stop_set(named: Iterable[tuple[str, Iterable[int]]]) -> StopSet:
    """Union of ``(source name, ids)`` pairs; each id keeps every source that named it.

    Raises:
      ValueError: an id that is not a non-negative int (names the source).
    """
    sources: dict[int, list[str]] = {}
    for source, ids in named:
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop set: {source} names an invalid token id {token_id!r}")
            names = sources.setdefault(int(token_id), [])
            if source not in names:
                names.append(source)
    return StopSet({k: tuple(v) for k, v in sources.items()})


def eos_ids_field(value: Any, *, source: str) -> list[int]:
    """``eos_token_id`` as stored in config.json / generation_config.json (int, list or null).

    Raises:
      ValueError: anything else (names the file).
    """
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise ValueError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")


def template_end_of_turn(
    template: str, special_tokens: Mapping[str, str], added_tokens: Sequence[str]
) -> str | None:
    """The added token a chat template writes right after an assistant message.

    Renders ``[user, assistant=<probe>]`` and reads what follows the probe
    (after optional whitespace): the longest added token it starts with.

    Args:
      template: the Jinja2 chat template.
      special_tokens: named special tokens passed to the template.
      added_tokens: contents of the tokenizer's added (special / control) tokens.

    Returns:
      e.g. "<|im_end|>", "<|eot_id|>", "<end_of_turn>", "</s>"; None when the
      template rejects the probe conversation or writes no token there.
    """
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render_chat_template(template, messages, special_tokens=special_tokens)
    except ChatTemplateError:
        return None
    at = text.find(_PROBE)
    if at < 0:
        return None
    rest = text[at + len(_PROBE) :].lstrip(" \n")
    matches = [t for t in added_tokens if t and rest.startswith(t)]
    return max(matches, key=len) if matches else None
