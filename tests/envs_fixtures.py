"""Shared helpers of the envs tests: a tiny ChatML tokenizer and scripted policies.

The tokenizer is the real ``jaxflash.models.text.tokenizer.Tokenizer`` over a toy
word-level vocabulary in which "assistant", "user", "system", "tool", "Hi" and every
printable ASCII character are single tokens, so ChatML turns tokenize exactly as in
the pitfall case: ``[<|im_start|>, "assistant", "\\n", "Hi", "!", <|im_end|>, "\\n"]``.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jaxflash.models.text.tokenizer import Tokenizer
from jaxflash.types import FinishReason, GenerationRequest, Sample

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["assistant", "user", "system", "tool", "Hi"]


def chatml_tokenizer() -> Tokenizer:
    """Toy ChatML tokenizer: ids 0/1/2 = <|endoftext|>/<|im_start|>/<|im_end|>."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"] + ["√"]
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + chars)}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    words = "|".join(WORDS)
    hf.pre_tokenizer = pre_tokenizers.Split(
        tokenizers.Regex(f"{words}|[\\s\\S]"), behavior="isolated"
    )
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIALS])
    return Tokenizer(hf, eos_token="<|im_end|>", chat_template=CHATML)


def text_sample(
    tokenizer,
    request: GenerationRequest,
    text: str,
    *,
    end_id: int | None = None,
    version: int = 0,
    tokens: Sequence[int] | None = None,
    finish: FinishReason = FinishReason.EOS,
) -> Sample:
    """A finished turn whose response is ``text`` (or ``tokens``) + ``end_id``.

    Behaviour logprobs are -(position + 1) / 10 so tests can see them carried over.
    """
    ids = list(tokens) if tokens is not None else tokenizer.encode(text)
    if finish == FinishReason.EOS:
        ids.append(tokenizer.eos_id if end_id is None else end_id)
    return Sample(
        prompt_id=request.prompt_id,
        sample_index=request.sample_index,
        prompt_tokens=np.asarray(request.prompt_tokens, np.int32),
        response_tokens=np.asarray(ids, np.int32),
        behaviour_logprobs=-(np.arange(len(ids), dtype=np.float32) + 1) / 10,
        token_versions=np.full(len(ids), version, np.int32),
        start_version=version,
        finish_reason=finish,
    )


def scripted_policy(tokenizer, reply: Callable[[GenerationRequest], str], **kw):
    """A batched policy (requests -> Samples) answering each request with ``reply(request)``."""

    def generate(requests: Sequence[GenerationRequest]) -> list[Sample]:
        return [text_sample(tokenizer, r, reply(r), **kw) for r in requests]

    return generate
