"""Tokenizer: Hugging Face ``tokenizers`` plus the model's chat template and stop set.

Two sources give the same object (``tokenizer_files.py`` reads them):

- ``Tokenizer.from_gguf(path)``: vocabulary, merges, token types, special ids and
  chat template stored in a GGUF file (llama.cpp's ``tokenizer.ggml.*`` keys).
- ``Tokenizer.from_hf_dir(dir)``: ``tokenizer.json`` + ``tokenizer_config.json``
  (+ ``generation_config.json`` / ``config.json`` for the stop set) of a Hugging
  Face checkpoint directory.

It behaves like ``transformers``' fast tokenizer where that matters for RL:

- **BOS.** ``encode(text, add_special_tokens=True)`` adds what the tokenizer's
  post-processor adds (``tokenizer.json``'s, as transformers 5 does; for GGUF
  files the one ``tokenizer.ggml.add_bos_token`` implies).
  ``encode_chat`` / ``apply_chat_template(tokenize=True)`` render the template
  with every named special token (``bos_token`` included, whether or not the
  tokenizer adds BOS) and encode *without* special tokens, as
  ``apply_chat_template(tokenize=True)`` does: a template that writes
  ``{{ bos_token }}`` gives exactly one BOS, one that does not gives none.
- **Templates** render in transformers' environment (``chat_template.py``).
- **Stop set.** ``stop_ids`` holds every id that ends a response (eos,
  generation_config's list, GGUF eot/eom, the template's end-of-turn token),
  ``stop_set.describe()`` says where each came from, and ``response_text``
  decodes a response up to (not including) its first stop id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

from jaxflash.models.text.chat_template import render_chat_template
from jaxflash.models.text.stop_tokens import (
    SPECIAL_TOKEN_NAMES,
    TEMPLATE_SOURCE,
    StopSet,
    build_stop_set,
    template_end_of_turn,
)


class Tokenizer:
    """Text <-> token ids, special tokens, chat rendering and the stop set of one model.

    Args:
      hf_tokenizer: a ``tokenizers.Tokenizer``; its post-processor decides what
        ``encode(..., add_special_tokens=True)`` adds (e.g. BOS).
      special_tokens: named special tokens, ``{"eos_token": ..., "bos_token":
        ..., "pad_token": ..., "unk_token": ...}`` (eos required); all are
        passed to the chat template.
      chat_template: Jinja2 source, or None.
      stop_sources: ``[(source name, ids), ...]`` naming further stop ids
        (generation_config.json, GGUF eot/eom); eos and the template's
        end-of-turn token are added here.

    Attributes:
      eos_id: id of ``eos_token`` (SmolLM2: 2, ``<|im_end|>``).
      pad_id: id of ``pad_token``, else eos (SmolLM2: 2).
      bos_id: id of ``bos_token`` or None (SmolLM2 GGUF: 1, ``<|im_start|>``).
      add_bos: whether ``encode(text, add_special_tokens=True)`` starts with BOS.
      vocab_size: number of ids the tokenizer can produce (largest id + 1).
      stop_set / stop_ids: see the module docstring.

    Raises:
      ValueError: a special token or stop id outside the vocabulary, or no eos.
    """

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        stop_sources: Iterable[tuple[str, Iterable[int]]] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._tok = hf_tokenizer
        # Template variables every render gets unless the call overrides them (e.g.
        # Qwen3's enable_thinking=False for a whole run).
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        named = dict(special_tokens or {})
        if eos_token is not None:
            named["eos_token"] = eos_token
        unknown = sorted(set(named) - set(SPECIAL_TOKEN_NAMES))
        if unknown:
            raise ValueError(f"Tokenizer: unknown special token names {unknown}")
        self.special_tokens: dict[str, str] = {k: v for k, v in named.items() if v is not None}
        if "eos_token" not in self.special_tokens:
            raise ValueError("Tokenizer: an eos_token is required")
        self._ids = {k: self._token_id(v, k) for k, v in self.special_tokens.items()}
        self.eos_token = self.special_tokens["eos_token"]
        self.eos_id = self._ids["eos_token"]
        self.bos_token = self.special_tokens.get("bos_token")
        self.bos_id = self._ids.get("bos_token")
        self.pad_token = self.special_tokens.get("pad_token", self.eos_token)
        self.pad_id = self._ids.get("pad_token", self.eos_id)
        self.chat_template = chat_template
        self._vocab_size = 1 + max(self._tok.get_vocab(with_added_tokens=True).values())
        first = self._tok.encode("", add_special_tokens=True).ids
        self.add_bos = self.bos_id is not None and first[:1] == [self.bos_id]
        named_stops: list[tuple[str, Iterable[int]]] = [("eos_token", [self.eos_id])]
        named_stops += [(s, list(ids)) for s, ids in stop_sources]
        if chat_template is not None:
            added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
            end = template_end_of_turn(chat_template, self.special_tokens, added)
            if end is not None:
                named_stops.append((TEMPLATE_SOURCE, [self._token_id(end, TEMPLATE_SOURCE)]))
        self.stop_set: StopSet = build_stop_set(named_stops)
        outside = sorted(i for i in self.stop_set.ids if i >= self._vocab_size)
        if outside:
            raise ValueError(
                f"Tokenizer: stop ids {outside} are outside the vocabulary of "
                f"{self._vocab_size} ids ({self.stop_set.describe()})"
            )

    def _token_id(self, token: str, what: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"Tokenizer: {what} {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends a response (pass to the slot loop as ``stop_ids``)."""
        return self.stop_set.ids

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (e.g. to save ``tokenizer.json``)."""
        return self._tok

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids.

        Args:
          text: any unicode string (e.g. a rendered chat prompt, which carries
            its own BOS if the template writes one).
          add_special_tokens: apply the post-processor (transformers'
            ``tokenizer(text)`` default; adds BOS for Llama 3, Gemma, Mistral).
            Off by default here: rendered chats must not get a second BOS.

        Raises:
          TypeError: if ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids (int list or 1-D integer array).

        Raises:
          ValueError: if an id is outside [0, vocab_size) (e.g. a padded
            embedding row; ``models.config.model_config.reconcile_vocab`` keeps them from
            being sampled).
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"Tokenizer.decode: ids out of range [0, {self.vocab_size}): {bad[:5]}"
            )
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def response_text(self, response_ids: Sequence[int]) -> str:
        """The text a reward sees: the response up to its first stop id, exclusive.

        Args:
          response_ids: generated ids (``Sample.response_tokens``; a finished
            sample ends with the stop id that ended it).

        Returns:
          Decoded text (special tokens before the stop kept as written).
        """
        ids = [int(i) for i in response_ids]
        stops = self.stop_ids
        cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        return self.decode(ids[:cut])

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    # ------------------------------------------------------------------ chat template

    def with_chat_template(
        self,
        chat_template: str | None,
        *,
        extra_stops: Iterable[tuple[str, Iterable[int]]] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        """The same tokenizer with another chat template (e.g. a documented plain prompt
        format for a base model whose files carry none, like Gemma 3 270M) and/or more
        stop ids (``[(source name, ids)]``, e.g. the newline a plain format ends on),
        and/or template variables every render gets (``template_kwargs``, merged over
        this tokenizer's: ``{"enable_thinking": False}`` for Qwen3).

        The stop set keeps every source but the old template's end-of-turn token; the
        new template's end-of-turn token (if it has one) joins it.

        Raises:
          ValueError: as the constructor (e.g. a template end-of-turn token that is
            not in the vocabulary).
        """
        stops = [
            (source, [i])
            for i, sources in self.stop_set.sources.items()
            for source in sources
            if source not in ("eos_token", TEMPLATE_SOURCE)
        ]
        stops += [(source, list(ids)) for source, ids in extra_stops]
        return Tokenizer(
            self._tok,
            special_tokens=self.special_tokens,
            chat_template=chat_template,
            stop_sources=stops,
            template_kwargs={**self.template_kwargs, **(template_kwargs or {})},
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's own chat template.

        Same string as transformers' ``apply_chat_template(..., tokenize=False)``
        (note: ``add_generation_prompt`` defaults to True here, False there).

        Args:
          messages: ``[{"role": "system"|"user"|"assistant"|..., "content": ...}]``.
          add_generation_prompt: append the assistant header so the model answers next.
          tokenize: return token ids (``encode_chat``) instead of the string.
          **template_kwargs: extra template variables (``tools``, ``date_string``,
            ``enable_thinking``...), over the tokenizer's own ``template_kwargs``.

        Returns:
          the prompt string, or its ids when ``tokenize``.

        Raises:
          ValueError: no chat template, malformed messages, or the template's
            own ``raise_exception`` (``chat_template.ChatTemplateError``).
        """
        if self.chat_template is None:
            raise ValueError("Tokenizer.apply_chat_template: this tokenizer has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(
                    f"Tokenizer.apply_chat_template: messages[{i}] must be a dict with "
                    f"'role' and 'content', got {m!r}"
                )
        text = render_chat_template(
            self.chat_template,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            **{**self.template_kwargs, **template_kwargs},
        )
        return self.encode(text) if tokenize else text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a rendered conversation, as transformers'
        ``apply_chat_template(messages, tokenize=True)``: the template decides
        BOS; no special token is added on top."""
        return self.apply_chat_template(
            messages, add_generation_prompt, tokenize=True, **template_kwargs
        )

    def encode_chat_with_mask(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """``encode_chat`` plus a 0/1 mask of the tokens inside ``{% generation %}``
        blocks (transformers' ``return_assistant_tokens_mask``: a token counts when
        its characters overlap a block).

        Raises:
          ValueError: as ``apply_chat_template``, or the template has no
            ``{% generation %}`` block (the mask would be all zeros).
        """
        if self.chat_template is None or "generation" not in self.chat_template:
            raise ValueError(
                "Tokenizer.encode_chat_with_mask: the chat template has no {% generation %} block"
            )
        text, spans = render_chat_template(
            self.chat_template,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            return_generation_spans=True,
            **{**self.template_kwargs, **template_kwargs},
        )
        encoding = self._tok.encode(text, add_special_tokens=False)
        mask = [
            int(any(s < end and e > start for s, e in spans)) for start, end in encoding.offsets
        ]
        return encoding.ids, mask

    # ------------------------------------------------------------------ files

    @classmethod
    def from_gguf(cls, path: Any) -> Tokenizer:
        """See ``tokenizer_files.tokenizer_from_gguf``."""
        from jaxflash.models.text.tokenizer_files import tokenizer_from_gguf  # noqa: PLC0415

        return cls(**tokenizer_from_gguf(path))

    @classmethod
    def from_hf_dir(cls, directory: Any) -> Tokenizer:
        """See ``tokenizer_files.tokenizer_from_hf_dir``."""
        from jaxflash.models.text.tokenizer_files import tokenizer_from_hf_dir  # noqa: PLC0415

        return cls(**tokenizer_from_hf_dir(directory))

    def save_hf(self, directory: Any) -> None:
        """See ``tokenizer_files.save_tokenizer_hf``."""
        from jaxflash.models.text.tokenizer_files import save_tokenizer_hf  # noqa: PLC0415

        save_tokenizer_hf(self, directory)
