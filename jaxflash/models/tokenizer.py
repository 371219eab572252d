"""Tokenizer: Hugging Face ``tokenizers`` byte-level BPE plus the model's chat template.

Two sources give the same object:

- ``Tokenizer.from_gguf(path)``: the vocabulary, merges, token types and chat template
  stored in a GGUF file (llama.cpp's ``tokenizer.ggml.*`` keys). Only ``gpt2``-style
  byte-level BPE is supported; the pre-tokenizer follows ``tokenizer.ggml.pre``
  (SmolLM2's ``smollm``: every digit is its own pre-token, then the GPT-2 regex).
- ``Tokenizer.from_hf_dir(dir)``: ``tokenizer.json`` plus ``tokenizer_config.json``
  (chat template, eos/pad token) of a Hugging Face checkpoint directory.

Chat templates are Jinja2 programs shipped with the model; they are rendered in a
sandboxed environment with the same options as ``transformers`` (trim_blocks,
lstrip_blocks), so the string is the one the model was trained on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special tokens such as <|im_end|>),
# 4 = USER_DEFINED (added tokens that are not special).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4
# tokenizer.ggml.pre values whose pre-tokenizer is "digits one by one, then GPT-2 regex".
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_PRES = frozenset({"default", "gpt2", "gpt-2"})


class Tokenizer:
    """Text <-> token ids, special tokens and chat rendering for one model.

    Attributes:
      eos_id: id that ends a response (SmolLM2: 2, ``<|im_end|>``).
      pad_id: id used for padding (SmolLM2: 2).
      bos_id: id prepended by ``encode`` when ``add_bos`` is set, else None (SmolLM2: None).
      vocab_size: number of ids, including special tokens.
      chat_template: Jinja2 source of the chat template, or None.
    """

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        eos_token: str,
        pad_token: str | None = None,
        bos_token: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._tok = hf_tokenizer
        self.eos_token = eos_token
        self.eos_id = self._token_id(eos_token, "eos_token")
        self.pad_token = pad_token if pad_token is not None else eos_token
        self.pad_id = self._token_id(self.pad_token, "pad_token")
        self.bos_token = bos_token
        self.bos_id = self._token_id(bos_token, "bos_token") if bos_token is not None else None
        if add_bos and self.bos_id is None:
            raise ValueError("Tokenizer: add_bos=True needs a bos_token")
        self.add_bos = add_bos
        self.chat_template = chat_template

    def _token_id(self, token: str, what: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"Tokenizer: {what} {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (e.g. to save ``tokenizer.json``)."""
        return self._tok

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids.

        Args:
          text: any unicode string (e.g. a rendered chat prompt).

        Returns:
          list of int ids; BOS is prepended only if the model adds one (SmolLM2: no).

        Raises:
          TypeError: if ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids (int list or 1-D integer array).

        Raises:
          ValueError: if an id is outside [0, vocab_size).
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"Tokenizer.decode: ids out of range [0, {self.vocab_size}): {bad[:5]}"
            )
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the model's own chat template.

        Args:
          messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
          add_generation_prompt: append the assistant header so the model answers next.

        Returns:
          the prompt string (tokenize it with ``encode``; specials are recognised).

        Raises:
          ValueError: if the tokenizer has no chat template, or messages are malformed.
        """
        if self.chat_template is None:
            raise ValueError("Tokenizer.apply_chat_template: this tokenizer has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(
                    f"Tokenizer.apply_chat_template: messages[{i}] must be a dict with "
                    f"'role' and 'content', got {m!r}"
                )
        return _compiled_template(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token,
            bos_token=self.bos_token or "",
            pad_token=self.pad_token,
        )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file (llama.cpp ``tokenizer.ggml.*`` keys).

        Raises:
          FileNotFoundError: if ``path`` does not exist.
          ValueError: if the file's tokenizer is not byte-level BPE (``gpt2``) or its
            pre-tokenizer is unknown.
        """
        import gguf  # local: only this constructor needs the GGUF reader

        if not os.path.isfile(path):
            raise FileNotFoundError(f"Tokenizer.from_gguf: no GGUF file at {path}")
        fields = gguf.GGUFReader(path).fields

        def get(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"Tokenizer.from_gguf: {path}: tokenizer.ggml.model={kind!r}; only byte-level "
                "BPE ('gpt2') is supported"
            )
        tokens: list[str] = get("tokenizer.ggml.tokens")
        token_types: list[int] = get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
        pre = get("tokenizer.ggml.pre", "default")

        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        tok = tokenizers.Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGIT_SPLIT_PRES:
            # Same as SmolLM2's tokenizer.json: "12345" -> 1 2 3 4 5, then GPT-2 regex.
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in _GPT2_PRES:
            tok.pre_tokenizer = byte_level
        else:
            raise ValueError(
                f"Tokenizer.from_gguf: {path}: unsupported tokenizer.ggml.pre={pre!r} "
                f"(supported: {sorted(_DIGIT_SPLIT_PRES | _GPT2_PRES)})"
            )
        tok.decoder = decoders.ByteLevel()
        # Control/user-defined tokens already have ids in the vocab; registering them as
        # added tokens makes encode() match them whole instead of splitting "<|im_end|>".
        added = [
            tokenizers.AddedToken(
                t, special=ty == _GGUF_CONTROL, normalized=False, single_word=False
            )
            for t, ty in zip(tokens, token_types, strict=True)
            if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
        ]
        tok.add_tokens(added)

        def token_at(key: str) -> str | None:
            token_id = get(key)
            return None if token_id is None else tokens[int(token_id)]

        eos = token_at("tokenizer.ggml.eos_token_id")
        if eos is None:
            raise ValueError(f"Tokenizer.from_gguf: {path}: no tokenizer.ggml.eos_token_id")
        add_bos = bool(get("tokenizer.ggml.add_bos_token", False))
        return cls(
            tok,
            eos_token=eos,
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
            bos_token=token_at("tokenizer.ggml.bos_token_id") if add_bos else None,
            add_bos=add_bos,
            chat_template=get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) from a checkpoint directory.

        The chat template comes from ``chat_template.jinja`` if present, else from
        ``tokenizer_config.json``; eos/pad/bos tokens from ``tokenizer_config.json``.
        BOS is prepended only if the config says ``add_bos_token: true``.

        Raises:
          FileNotFoundError: if ``tokenizer.json`` is missing.
          ValueError: if no eos token can be determined.
        """
        tok_path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"Tokenizer.from_hf_dir: no tokenizer.json in {directory}")
        tok = tokenizers.Tokenizer.from_file(tok_path)
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        cfg: dict[str, Any] = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; use "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        eos = _token_content(cfg.get("eos_token"))
        if eos is None:
            raise ValueError(f"Tokenizer.from_hf_dir: {cfg_path} names no eos_token")
        add_bos = bool(cfg.get("add_bos_token", False))
        bos = _token_content(cfg.get("bos_token"))
        return cls(
            tok,
            eos_token=eos,
            pad_token=_token_content(cfg.get("pad_token")),
            bos_token=bos if add_bos else None,
            add_bos=add_bos,
            chat_template=template,
        )

    def save_hf(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (readable by transformers)."""
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "bos_token": self.bos_token,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes tokens as "str" or {"content": "str", ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


class _TemplateError(ValueError):
    """A chat template rejected the conversation (its own raise_exception call)."""


def _raise_exception(message: str) -> None:
    # Chat templates call raise_exception("...") to reject malformed conversations.
    raise _TemplateError(message)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compiled_template(source: str) -> jinja2.Template:
    """Compile once per template source, with the options transformers uses."""
    if source not in _TEMPLATE_CACHE:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise_exception
        _TEMPLATE_CACHE[source] = env.from_string(source)
    return _TEMPLATE_CACHE[source]
