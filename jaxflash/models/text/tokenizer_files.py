"""Reading and writing tokenizers: GGUF metadata and Hugging Face checkpoint files.

``tokenizer_from_gguf(path)`` builds the byte-level BPE stored in a GGUF file
(llama.cpp's ``tokenizer.ggml.*`` keys): ``gpt2``-style byte-level BPE, pre-tokenizer
from ``tokenizer.ggml.pre`` (SmolLM2's ``smollm`` splits every digit, then the GPT-2
regex), or a Gemma SentencePiece vocabulary (``tokenizer.ggml.model = llama`` in a
``gemma``/``gemma2``/``gemma3`` file; see ``_gemma_sentencepiece``).
``tokenizer_from_hf_dir(dir)`` reads ``tokenizer.json`` and
``tokenizer_config.json`` (special tokens, chat template, ``add_bos_token``),
and the stop ids of ``generation_config.json`` and ``config.json``.
``save_tokenizer_hf`` writes files that transformers and
``tokenizer_from_hf_dir`` read back to the same tokenizer and stop set.
"""

from __future__ import annotations

import json
import os
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from jaxflash.models.text.stop_tokens import SPECIAL_TOKEN_NAMES, TEMPLATE_SOURCE, eos_ids_field

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special tokens such as <|im_end|>),
# 4 = USER_DEFINED (added tokens that are not special).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4
# tokenizer.ggml.pre values whose pre-tokenizer is "digits one by one, then GPT-2 regex".
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_PRES = frozenset({"default", "gpt2", "gpt-2"})
# GGUF keys of the named special tokens, and of the extra end-of-generation ids.
_GGUF_SPECIALS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "sep_token": "tokenizer.ggml.seperator_token_id",  # llama.cpp's spelling
}
_GGUF_STOP_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
GENERATION_CONFIG_SOURCE = "generation_config.json eos_token_id"
CONFIG_SOURCE = "config.json eos_token_id"


def bos_eos_processor(
    tok: tokenizers.Tokenizer, *, bos: str | None, add_bos: bool, eos: str, add_eos: bool
) -> processors.TemplateProcessing:
    """The post-processor transformers builds from ``add_bos_token`` / ``add_eos_token``
    (``TokenizersBackend.update_post_processor``): ``[BOS] $A [EOS]``."""
    add_bos = add_bos and bos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = (
        f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    )
    specials = [(bos, tok.token_to_id(bos))] if add_bos else []
    specials += [(eos, tok.token_to_id(eos))] if add_eos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def tokenizer_from_gguf(path: str | os.PathLike) -> dict[str, Any]:
    """Read the tokenizer stored in a GGUF file: ``Tokenizer(**result)`` builds it.

    Returns the ``Tokenizer`` constructor's arguments (this module does not import
    ``tokenizer.py``, which imports it for ``Tokenizer.from_gguf``).

    Special tokens come from ``tokenizer.ggml.{bos,eos,unknown,padding}_token_id``;
    BOS is added by ``encode(add_special_tokens=True)`` iff
    ``tokenizer.ggml.add_bos_token``; the stop set adds ``eot_token_id`` and
    ``eom_token_id`` when present.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: the file's tokenizer is not byte-level BPE (``gpt2``), its
        pre-tokenizer is unknown, or it names no eos token.
    """
    import gguf  # local: only this constructor needs the GGUF reader

    if not os.path.isfile(path):
        raise FileNotFoundError(f"Tokenizer.from_gguf: no GGUF file at {path}")
    fields = gguf.GGUFReader(path).fields

    def get(key: str, default: Any = None) -> Any:
        return fields[key].contents() if key in fields else default

    kind = get("tokenizer.ggml.model")
    arch = get("general.architecture")
    tokens: list[str] = get("tokenizer.ggml.tokens")
    token_types: list[int] = get("tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "llama" and arch in _GEMMA_ARCHS:
        tok = _gemma_sentencepiece(tokens, get("tokenizer.ggml.unknown_token_id"))
    elif kind != "gpt2":
        raise ValueError(
            f"Tokenizer.from_gguf: {path}: tokenizer.ggml.model={kind!r} "
            f"(general.architecture={arch!r}); supported: byte-level BPE ('gpt2'), or "
            f"'llama' (SentencePiece) in a {sorted(_GEMMA_ARCHS)} file"
        )
    else:
        tok = _byte_level_bpe(path, tokens, get("tokenizer.ggml.merges"), get("tokenizer.ggml.pre"))
    # Control/user-defined tokens already have ids in the vocab; registering them as
    # added tokens makes encode() match them whole instead of splitting "<|im_end|>".
    # A token the vocabulary spells differently (Gemma's respelled space runs) is not
    # registered: it would get a new id past the model's rows.
    vocab = tok.get_vocab(with_added_tokens=False)
    tok.add_tokens(
        [
            tokenizers.AddedToken(
                t, special=ty == _GGUF_CONTROL, normalized=False, single_word=False
            )
            for t, ty in zip(tokens, token_types, strict=True)
            if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED) and vocab.get(t) is not None
        ]
    )
    special = {
        name: tokens[int(get(key))] for name, key in _GGUF_SPECIALS.items() if get(key) is not None
    }
    if "eos_token" not in special:
        raise ValueError(f"Tokenizer.from_gguf: {path}: no tokenizer.ggml.eos_token_id")
    tok.post_processor = bos_eos_processor(
        tok,
        bos=special.get("bos_token"),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        eos=special["eos_token"],
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
    )
    stops = [(f"GGUF {k}", [int(get(k))]) for k in _GGUF_STOP_KEYS if get(k) is not None]
    return {
        "hf_tokenizer": tok,
        "special_tokens": special,
        "chat_template": get("tokenizer.chat_template"),
        "stop_sources": stops,
    }


_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def _byte_level_bpe(path: str, tokens: list[str], merges: list[str], pre: str | None):
    """GPT-2 style byte-level BPE with the file's merges and pre-tokenizer."""
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False)
    tok = tokenizers.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = pre or "default"
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
    return tok


def _gemma_sentencepiece(tokens: list[str], unk_id: int | None) -> tokenizers.Tokenizer:
    """Gemma's SentencePiece BPE (byte fallback) from a GGUF vocabulary.

    The file stores no merges. Gemma's vocabulary is ordered by merge priority (its
    scores are not), so the merges are rebuilt from it: every split of a token into
    two vocabulary pieces, tokens earlier in the file first, ties broken by the
    longer left then right piece, the splits of one token by the pieces' ids.
    Whitespace-only tokens holding a space are stored with real spaces but looked up
    as "▁" runs, so they are respelled first (a repeated spelling keeps its last id).
    Normalizer, pre-tokenizer, byte fallback and decoder are those of Gemma's
    ``tokenizer.json``. This is the construction transformers' GGUF reader uses
    (checked id for id in tests/models/test_gemma3_gguf.py).
    """
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    candidates = []
    for token, rank in vocab.items():
        splits = [
            (token[:k], token[k:])
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        candidates.extend((rank, left, right) for left, right in splits)
    # Stable sort: earlier token first, then longer left piece, then longer right piece.
    candidates.sort(key=lambda c: (c[0], -len(c[1]), -len(c[2])))
    merges = [(left, right) for _, left, right in candidates]
    unk = spelled[unk_id] if unk_id is not None else None
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, byte_fallback=True)
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes tokens as "str" or {"content": "str", ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def tokenizer_from_hf_dir(directory: str | os.PathLike) -> dict[str, Any]:
    """Read a Hugging Face checkpoint directory's tokenizer, template and stop set.

    Returns the ``Tokenizer`` constructor's arguments (``Tokenizer.from_hf_dir``).

    - ``tokenizer.json``: the tokenizer; its post-processor decides what
      ``encode(add_special_tokens=True)`` adds. tokenizer_config's
      ``add_bos_token`` / ``add_eos_token`` are ignored, as transformers 5 does
      whenever a tokenizer.json exists (real checkpoints that add BOS carry it
      in the post-processor).
    - chat template: ``chat_template.jinja`` if present, else
      ``tokenizer_config.json``'s ``chat_template`` (a named list: "default").
    - special tokens: ``bos/eos/unk/sep/pad/cls/mask_token`` of tokenizer_config.
    - stop set: eos, ``generation_config.json`` and ``config.json``
      ``eos_token_id`` (int or list), the template's end-of-turn token.

    Raises:
      FileNotFoundError: if ``tokenizer.json`` is missing.
      ValueError: no eos token, or a malformed ``eos_token_id``.
    """
    directory = os.fspath(directory)
    tok_path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(f"Tokenizer.from_hf_dir: no tokenizer.json in {directory}")
    tok = tokenizers.Tokenizer.from_file(tok_path)
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    cfg = _read_json(cfg_path)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # HF allows named templates; use "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    special = {name: _token_content(cfg.get(name)) for name in SPECIAL_TOKEN_NAMES}
    special = {k: v for k, v in special.items() if v is not None}
    if "eos_token" not in special:
        raise ValueError(f"Tokenizer.from_hf_dir: {cfg_path} names no eos_token")
    stops = []
    for name, source in (
        ("generation_config.json", GENERATION_CONFIG_SOURCE),
        ("config.json", CONFIG_SOURCE),
    ):
        path = os.path.join(directory, name)
        ids = eos_ids_field(_read_json(path).get("eos_token_id"), source=path)
        if ids:
            stops.append((source, ids))
    return {
        "hf_tokenizer": tok,
        "special_tokens": special,
        "chat_template": template,
        "stop_sources": stops,
    }


def save_tokenizer_hf(tokenizer: Any, directory: str | os.PathLike) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.

    ``tokenizer`` is a ``jaxflash.models.text.tokenizer.Tokenizer`` (typed ``Any``: this
    module must not import that one, which imports it).

    transformers reads them back to the same ids and template; the generation
    config lists the whole stop set, so ``generate`` stops where we do.
    """
    os.makedirs(directory, exist_ok=True)
    tokenizer.hf_tokenizer.save(os.path.join(directory, "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokenizer.special_tokens,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    if tokenizer.chat_template is not None:
        cfg["chat_template"] = tokenizer.chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    gen = {"eos_token_id": sorted(tokenizer.stop_ids), "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        gen["bos_token_id"] = tokenizer.bos_id
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)


__all__ = [
    "CONFIG_SOURCE",
    "GENERATION_CONFIG_SOURCE",
    "TEMPLATE_SOURCE",
    "bos_eos_processor",
    "save_tokenizer_hf",
    "tokenizer_from_gguf",
    "tokenizer_from_hf_dir",
]
