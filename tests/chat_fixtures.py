"""Small Hugging Face checkpoint directories for tokenizer / chat-template tests.

``tests/data/chat_models/<name>/`` holds a real model's chat template
(``chat_template.jinja``), its ``tokenizer_config.json`` and
``generation_config.json`` (special tokens, BOS flags and stop ids as the model
ships them, ids renumbered), and ``fixture.json`` naming its special / added
tokens. ``build_checkpoint`` writes a directory transformers and jaxflash both
load: a ``tokenizer.json`` built here with ``tokenizers`` (ids: specials first,
then added tokens, then 256 byte symbols; no merges), byte-level BPE or, with
``"style": "sentencepiece"``, Gemma's byte-fallback pipeline — nothing comes
from a model hub.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

DATA = Path(__file__).parent / "data" / "chat_models"
NAMES = sorted(p.name for p in DATA.iterdir() if (p / "fixture.json").exists())


def fixture(name: str) -> dict:
    return json.loads((DATA / name / "fixture.json").read_text(encoding="utf-8"))


def _sentencepiece_style(specials: list[str]) -> tokenizers.Tokenizer:
    """Gemma's pipeline (transformers' GemmaTokenizer rebuilds exactly this around
    the file's vocabulary): spaces -> "▁", BPE with byte fallback, no merges."""
    vocab: dict[str, int] = {}
    for token in [*specials, *(f"<0x{b:02X}>" for b in range(256)), "▁"]:
        vocab.setdefault(token, len(vocab))
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in specials]
    )
    return tok


def build_tokenizer_json(name: str, *, adds_bos: bool | None = None) -> tokenizers.Tokenizer:
    """The fixture's tokenizer; ``adds_bos`` False drops its BOS post-processor."""
    spec = fixture(name)
    bos = spec.get("post_bos") if adds_bos is not False else None
    specials, added = spec["specials"], spec.get("added", [])
    if spec.get("style") == "sentencepiece":
        tok = _sentencepiece_style(specials)
    else:
        tok = _byte_level(specials, added)
    if bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    return tok


def _byte_level(specials: list[str], added: list[str]) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for token in [*specials, *added, *sorted(pre_tokenizers.ByteLevel.alphabet())]:
        vocab.setdefault(token, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in specials]
    )
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def build_checkpoint(
    name: str,
    directory: Path,
    *,
    config_changes: dict | None = None,
    adds_bos: bool | None = None,
) -> Path:
    """Write ``<directory>/<name>/`` (tokenizer.json + configs + template) and return it.

    Args:
      config_changes: keys to set (value None: delete) in tokenizer_config.json.
      adds_bos: False writes a tokenizer.json whose post-processor adds no BOS.
    """
    src, out = DATA / name, Path(directory) / name
    out.mkdir(parents=True, exist_ok=True)
    spec = fixture(name)
    build_tokenizer_json(name, adds_bos=adds_bos).save(str(out / "tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    if spec.get("template_in_config"):
        config["chat_template"] = template
    else:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    for key, value in (config_changes or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return out
