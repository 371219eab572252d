"""OpenAI chat requests checked, and tool calls in the model's own chat-template format.

``parse_chat_request`` turns the JSON body of ``POST /v1/chat/completions`` into a
``ChatRequest`` or raises ``RequestError`` carrying the fields of OpenAI's error body
(``{"error": {"message", "type", "param", "code"}}``), so a malformed request is
answered as the OpenAI API answers it.

Tool calls (``ToolFormat``). A chat template that renders ``tools`` itself (Qwen2.5,
Qwen3, Hermes-style: it writes ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` for the assistant's calls and ``<tool_response>`` for results) is used
as is: messages and tools go to the template, and the model's output is parsed in the
same ``<tool_call>`` format. A template with no tool support (SmolLM2's ChatML, the
tiny test model) gets the same Hermes format written by jaxflash: the tool list as a
system message (Qwen2.5's wording), an assistant's calls as ``<tool_call>`` blocks in
its content, tool results as ``tool`` messages. Which case applies is probed once per
tokenizer: does rendering with a tool change the text?
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a request's messages may have."""

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "jaxflash_probe_tool", "description": "probe", "parameters": {}},
}


class RequestError(ValueError):
    """A request the endpoint refuses, with OpenAI's error fields.

    Attributes:
      message: what is wrong, naming the field. param: the request field or None.
      code: a short machine-readable code or None. status: the HTTP status (400).
      kind: OpenAI's error ``type`` ("invalid_request_error").
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """A checked ``/v1/chat/completions`` request.

    Attributes:
      model: the model name asked for.
      messages: the conversation (plain dicts, as sent).
      tools: the tool definitions, or None.
      temperature, top_p: as asked (None: not given).
      max_tokens: the response budget asked (``max_completion_tokens`` too), or None.
      stop: strings that end the returned text (applied to the text).
      logprobs: return each sampled token's behaviour logprob.
      top_logprobs: alternatives per token (only 0 is served).
    """

    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{key} must be a number, got {value!r}", param=key)
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {value}", param=key)
    return float(value)


def _check_message(i: int, m: Any) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise RequestError(f"{param} must be an object", param=param)
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{param}.role must be one of {ROLES}, got {role!r}", param=param)
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is served
        if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            raise RequestError(f"{param}.content: only text parts are supported", param=param)
        content = "".join(str(p.get("text", "")) for p in content)
    if content is not None and not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or text parts", param=param)
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise RequestError(f"{param}.tool_calls: only an assistant's, as a list", param=param)
    if content is None and not calls:
        raise RequestError(f"{param}.content is missing", param=param)
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = content or ""
    for call in calls or ():
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{param}.tool_calls: each needs function.name", param=param)
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    """The checked request of a ``/v1/chat/completions`` JSON body.

    Raises:
      RequestError: not an object; no or malformed ``messages`` (roles, content);
        ``tools`` not a list of functions; a sampling field of the wrong type or range;
        ``n`` != 1, ``stream``, or ``top_logprobs`` > 0 (not served; each names the
        parameter).
    """
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    checked = tuple(_check_message(i, m) for i, m in enumerate(messages))
    tools = body.get("tools")
    if tools is not None:
        ok = isinstance(tools, list) and all(
            isinstance(t, Mapping)
            and t.get("type") == "function"
            and isinstance(t.get("function"), Mapping)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
        if not ok:
            raise RequestError("tools must be a list of function tools", param="tools")
        tools = tuple(dict(t) for t in tools) or None
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(
            f"n={n!r}: a session is one trajectory, so only n=1 is served (a GRPO group "
            "is rollout.group_size sessions)",
            param="n",
            code="unsupported_value",
        )
    if body.get("stream"):
        raise RequestError("stream=true is not served", param="stream", code="unsupported_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise RequestError(
            f"max_tokens must be an int >= 1, got {max_tokens!r}", param="max_tokens"
        )
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of strings", param="stop")
    top_logprobs = body.get("top_logprobs") or 0
    if top_logprobs:
        raise RequestError(
            "top_logprobs > 0 is not served (each sampled token's logprob is: logprobs=true)",
            param="top_logprobs",
            code="unsupported_value",
        )
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("model must be a string", param="model")
    return ChatRequest(
        model=model,
        messages=checked,
        tools=tools,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        max_tokens=max_tokens,
        stop=stop,
        logprobs=bool(body.get("logprobs", False)),
    )


# ---------------------------------------------------------------------- tool calls


def _hermes_system(tools: Sequence[Mapping[str, Any]]) -> str:
    """Qwen2.5's tool preamble (the Hermes format), for templates without tools."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _arguments(call: Mapping[str, Any]) -> Any:
    args = call.get("function", {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


class ToolFormat:
    """Tool calls in one tokenizer's chat-template format (module docstring).

    Args:
      tokenizer: ``apply_chat_template(messages, add_generation_prompt, **kwargs)``.

    Attributes:
      native: the template renders ``tools`` itself.
    """

    def __init__(self, tokenizer: Any) -> None:
        probe = [{"role": "user", "content": "U"}]
        plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True)
        try:
            with_tool = tokenizer.apply_chat_template(
                probe, add_generation_prompt=True, tools=[_PROBE_TOOL]
            )
        except TypeError:  # a tokenizer whose renderer takes no template variables
            with_tool = plain
        self.native = with_tool != plain

    def template_kwargs(self, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
        """Extra render variables: ``tools`` for a native template, else none."""
        return {"tools": list(tools)} if (tools and self.native) else {}

    def for_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """Messages as the template should see them.

        Native: tool-call arguments as objects (templates ``tojson`` them), else as
        sent. Otherwise: ``developer`` is ``system``, the tool list a system message
        (merged into a leading one), an assistant's calls ``<tool_call>`` blocks
        appended to its content.
        """
        out: list[dict[str, Any]] = []
        for m in messages:
            m = dict(m)
            calls = m.pop("tool_calls", None)
            if m["role"] == "developer":
                m["role"] = "system"
            if calls and self.native:
                m["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in calls
                ]
            elif calls:
                blocks = [
                    "<tool_call>\n"
                    + json.dumps(
                        {"name": c["function"]["name"], "arguments": _arguments(c)},
                        ensure_ascii=False,
                    )
                    + "\n</tool_call>"
                    for c in calls
                ]
                m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            if not self.native:
                m = {"role": m["role"], "content": m.get("content", "")}
            out.append(m)
        if tools and not self.native:
            preamble = _hermes_system(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{preamble}"}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out

    @staticmethod
    def parse(text: str, call_id: str) -> tuple[str | None, list[dict[str, Any]], int]:
        """The assistant message of a sampled text: content, tool calls, parse errors.

        Args:
          text: the decoded turn (up to its stop token).
          call_id: prefix of the calls' ids (``<call_id>_<i>``).

        Returns:
          (content without the ``<tool_call>`` blocks, or None when only calls remain;
          OpenAI tool calls with JSON-string arguments; how many blocks did not hold a
          ``{"name", "arguments"}`` object -- those stay in the content).
        """
        calls, errors, kept = [], 0, []
        last = 0
        for match in _TOOL_CALL.finditer(text):
            try:
                obj = json.loads(match.group(1))
                ok = isinstance(obj, dict) and isinstance(obj.get("name"), str)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                errors += 1
                continue
            kept.append(text[last : match.start()])
            last = match.end()
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(
                {
                    "id": f"{call_id}_{len(calls)}",
                    "type": "function",
                    "function": {
                        "name": obj["name"],
                        "arguments": json.dumps(args, ensure_ascii=False),
                    },
                }
            )
        kept.append(text[last:])
        content = "".join(kept).strip() if calls else text
        return (content or None) if calls else content, calls, errors


def same_assistant_message(sent: Mapping[str, Any], echoed: Mapping[str, Any]) -> bool:
    """Does an echoed assistant message carry what the endpoint returned?

    Content compared as text (None and "" alike); tool calls by name and parsed
    arguments, in order (ids and formatting of the JSON ignored).
    """
    if (sent.get("content") or "") != (echoed.get("content") or ""):
        return False
    a, b = sent.get("tool_calls") or [], echoed.get("tool_calls") or []
    return len(a) == len(b) and all(
        x["function"]["name"] == y["function"]["name"] and _arguments(x) == _arguments(y)
        for x, y in zip(a, b, strict=True)
    )


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two non-assistant messages are the same (role, content, tool_call_id, name)."""
    keys = ("role", "content", "tool_call_id", "name")
    return all((a.get(k) or None) == (b.get(k) or None) for k in keys)
