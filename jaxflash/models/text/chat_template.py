"""Chat templates rendered in the environment Hugging Face ``transformers`` gives them.

A chat template is a Jinja2 program shipped with a checkpoint. The string a
model was trained on is whatever ``transformers``' ``apply_chat_template``
renders, so this module rebuilds that renderer's environment rather than
Jinja2's defaults (transformers 5.x, ``utils/chat_template_utils.py``):

- ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
  the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and a
  ``{% generation %}...{% endgeneration %}`` block tag that renders its body
  and records the character span (transformers' assistant-token mask);
- filter ``tojson(x, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)`` (plain ``json.dumps``: no HTML escaping, unlike Jinja's);
- globals ``raise_exception(msg)``, ``strftime_now(fmt)``, a restricted
  ``dict`` and a ``namespace`` that refuses underscore-prefixed attributes;
- render variables: ``messages`` (``None``-valued keys dropped, reasoning
  aliases filled), ``tools=None``, ``documents=None``,
  ``add_generation_prompt`` and every named special token of the tokenizer
  (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ... — always,
  whether or not the tokenizer adds BOS when encoding).

``tests/models/test_chat_templates.py`` checks token-id parity against transformers
itself on real templates (SmolLM2, Qwen2.5, Llama 3.x, DeepSeek-R1-distill,
Mistral, Gemma and the GGUF-embedded one). transformers is not imported here:
it stays a test-time cross-check, so importing jaxflash does not pay for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# Names under which a message's reasoning arrives; templates read the first one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template rejected the conversation (its own ``raise_exception``) or failed."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}``: renders body, records its span.

    transformers uses the spans for ``return_assistant_tokens_mask``; here they
    come back from ``render_chat_template(..., return_generation_spans=True)``.
    """

    tags = {"generation"}  # noqa: RUF012 (jinja's class attribute)

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self._tracking: contextvars.ContextVar = contextvars.ContextVar(
            "jaxflash_generation_spans", default=None
        )
        environment.extend(track_generation=self.track)

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_generation")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_generation(self, caller: Any) -> str:
        text = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text

    @contextlib.contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
        token = self._tracking.set((blocks, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` / ``dict.fromkeys(...)`` without attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes ({name!r})"
            )


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` once in transformers' chat-template environment.

    Raises:
      ChatTemplateError: the template does not parse (names the line).
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: line {e.lineno}: {e}") from None


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers passes them: fresh dicts, None-valued keys dropped,
    reasoning under ``reasoning_content`` (and ``thinking``) when given by any name."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict, got {message!r}")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = False,
    return_generation_spans: bool = False,
    **template_kwargs: Any,
) -> str | tuple[str, list[tuple[int, int]]]:
    """Render a conversation exactly as ``transformers``' ``apply_chat_template(tokenize=False)``.

    Args:
      source: the Jinja2 chat template.
      messages: ``[{"role": ..., "content": ..., ...}, ...]`` (non-empty).
      special_tokens: the tokenizer's named special tokens, e.g.
        ``{"bos_token": "<s>", "eos_token": "</s>", "pad_token": ...}``; always
        passed, so a template writing ``{{ bos_token }}`` gets it even when the
        tokenizer does not add BOS itself.
      add_generation_prompt: append the assistant header (the model answers next).
      return_generation_spans: also return the [start, end) character spans of
        every ``{% generation %}`` block (the assistant turns a template marks).
      **template_kwargs: extra template variables (e.g. ``date_string``,
        ``enable_thinking``); they override special tokens of the same name.

    Returns:
      The rendered string, or (string, spans) with ``return_generation_spans``.

    Raises:
      ChatTemplateError: empty conversation, a message that is not a dict, a
        template that does not parse, or the template's own ``raise_exception``
        (its message is kept).
    """
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation")
    template = compile_chat_template(source)
    variables = {
        **dict(special_tokens),
        **template_kwargs,
        "messages": _plain_messages(messages),
        "tools": template_kwargs.get("tools"),
        "documents": template_kwargs.get("documents"),
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        if not return_generation_spans:
            return template.render(**variables)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with template.environment.track_generation(blocks, spans):
            for block in template.generate(**variables):
                blocks.append(block)
        return "".join(blocks), spans
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None
