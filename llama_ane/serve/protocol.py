"""OpenAI's request and response shapes: request bodies checked against a JSON Schema, chat
messages rendered with the model's chat template (tools included), tool calls parsed back, and the
response, chunk and error bodies.

Tool calls: with `tool_choice` naming a function, the answer is constrained to a JSON object of that
function's `parameters` schema and returned as its arguments; with "required", to
`{"name": ..., "arguments": {...}}` of one of the tools; with "auto", the answer is free text and
each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in it (the format of the tools
templates in the Hermes/Qwen style) becomes a tool call.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from ..errors import InvalidArgumentError

TOP_LOGPROBS_MAX = 20  # OpenAI's bound on top_logprobs
N_MAX = 16  # choices per request
STOP_MAX = 4  # stop strings per request (OpenAI's bound)

_NUMBER = {"type": "number"}
_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": 0},
    "seed": {"type": ["integer", "null"]},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": N_MAX},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": STOP_MAX},
                       {"type": "null"}]},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "null"},
                      {"type": "array", "items": {"type": "object", "required": ["type"],
                                                  "properties": {"type": {"const": "text"},
                                                                 "text": {"type": "string"}}}}]}
_FUNCTION = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                            "description": {"type": "string"}, "parameters": {"type": "object"}}}
CHAT_SCHEMA = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_SAMPLING,
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                           "content": _CONTENT, "name": {"type": "string"}, "tool_calls": {"type": "array"},
                           "tool_call_id": {"type": "string"}}}},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": TOP_LOGPROBS_MAX},
        "response_format": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name"],
                            "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                           "strict": {"type": ["boolean", "null"]}}}}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"],
                                             "properties": {"type": {"const": "function"}, "function": _FUNCTION}}},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                                  {"type": "object", "required": ["type", "function"],
                                   "properties": {"type": {"const": "function"},
                                                  "function": {"type": "object", "required": ["name"],
                                                               "properties": {"name": {"type": "string"}}}}}]},
    },
}
COMPLETION_SCHEMA = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [{"type": "string"},
                             {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                             {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": N_MAX}]},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": TOP_LOGPROBS_MAX},
        "echo": {"enum": [False, None]},
        "best_of": {"type": ["integer", "null"], "minimum": 1, "maximum": 1},
        "suffix": {"type": "null"},
    },
}


class RequestError(InvalidArgumentError):
    """A request the server refuses: `status` (4xx), the `param` at fault and an OpenAI error `code`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def check_body(body: Any, schema: dict) -> dict:
    """`body` if it matches `schema`, else a RequestError naming the first bad field."""
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(body))
    if error is not None:
        param = ".".join(str(p) for p in error.absolute_path) or None
        message = error.message if len(error.message) <= 200 else error.message[:200] + "..."
        raise RequestError(f"{param or 'the body'}: {message}", param)
    return body


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Sampling:
    """The generation options both endpoints share, checked."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no log-probabilities


def sampling(body: dict, default_max: int, limit: int, top_logprobs: int | None) -> Sampling:
    """The sampling options of a checked body; max_tokens above `limit` is refused."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
    if max_tokens > limit:
        param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        raise RequestError(f"{param} is {max_tokens}, more than this server allows ({limit}); lower it", param)
    stop = body.get("stop") or []
    temperature = body.get("temperature")
    return Sampling(max_tokens=max_tokens, temperature=1.0 if temperature is None else float(temperature),
                    top_p=float(body.get("top_p") or 1.0), top_k=int(body.get("top_k") or 0), seed=body.get("seed"),
                    n=int(body.get("n") or 1), stop=[stop] if isinstance(stop, str) else list(stop),
                    stream=bool(body.get("stream")),
                    include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
                    top_logprobs=top_logprobs)


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: text content, and tool calls' arguments as objects."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if k != "content"}
        msg["content"] = message_text(m.get("content"))
        if m.get("role") == "developer":
            msg["role"] = "system"
        calls = []
        for call in m.get("tool_calls") or []:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            calls.append({**call, "function": fn})
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


@dataclass
class ToolMode:
    """How an answer is read for tool calls: `forced` names the one function it must call;
    `required` constrains it to a call of some tool; `parse` reads <tool_call> blocks."""

    forced: str | None = None
    required: bool = False
    parse: bool = False
    names: list[str] = field(default_factory=list)


def tool_mode(body: dict) -> tuple[ToolMode, dict | None]:
    """The tool mode of a chat body and the JSON schema that constrains its answer (None: free)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto" if tools else "none")
    names = [t["function"]["name"] for t in tools]
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in params:
            given = ", ".join(names) or "none"
            raise RequestError(f"tool_choice names the function {name!r}, which is not in tools ({given})",
                               "tool_choice")
        return ToolMode(forced=name, names=names), params[name]
    if choice == "required":
        if not tools:
            raise RequestError("tool_choice is 'required' but no tools are given", "tool_choice")
        return ToolMode(required=True, names=names), {"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "arguments": p}, "required": ["name", "arguments"],
             "additionalProperties": False} for n, p in params.items()]}
    return ToolMode(parse=choice == "auto" and bool(tools), names=names), None


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict]]:
    """The answer's remaining content and its tool calls (OpenAI's shape), read as `mode` says."""
    calls: list[tuple[str, Any]] = []
    content: str | None = text
    if mode.forced:
        calls, content = [(mode.forced, text)], None
    elif mode.required or mode.parse:
        found = [text] if mode.required else _TOOL_CALL.findall(text)
        for raw in found:
            try:
                call = json.loads(raw)
            except ValueError:
                continue
            if isinstance(call, dict) and call.get("name") in mode.names:
                calls.append((call["name"], call.get("arguments", {})))
        if calls:
            content = None if mode.required else (_TOOL_CALL.sub("", text).strip() or None)
    return content, [{"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                     for name, args in calls]


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


def finish_reason(reason: str, calls: list[dict]) -> str:
    return "tool_calls" if calls else FINISH.get(reason, reason)


def completion_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(id_: str, obj: str, model: str, choices: list[dict], usage_: dict | None = None) -> dict:
    body = {"id": id_, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
