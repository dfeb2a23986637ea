"""Pieces of the OpenAI chat shape that every translating provider reads or writes.

Reading a request: text of a content, a data-URL image, an assistant turn's tool calls
and the request's function tools (each checked once, naming the bad entry), whether the
client asked for stream usage; merging consecutive turns of one role, as the vendors
that want turns alternating need. Writing an answer: ``chat.completion`` and
``chat.completion.chunk`` objects with one choice, the usage-only chunk, ``[DONE]``.
A vendor mapping (gateway/protocols/gemini.py, ...) uses these so each fact about the
OpenAI shape is written once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.core.errors import InvalidRequest

__all__ = [
    "ContentPart",
    "FunctionTool",
    "ToolCall",
    "append_turn",
    "function_tools",
    "tool_calls_of",
    "content_parts",
    "DONE_EVENT",
    "ChunkWriter",
    "UpstreamAnswerError",
    "completion_object",
    "data_url",
    "parse_tool_arguments",
    "text_of",
    "usage_object",
    "wants_usage",
]

DONE_EVENT = b"data: [DONE]\n\n"


class UpstreamAnswerError(ValueError):
    """The provider answered something its wire does not allow (a provider failure)."""


def text_of(content: Any, bad: Callable[[str], InvalidRequest], where: str) -> str:
    """Text of a system / tool content: a string or a list of text parts.

    ``bad(message)`` builds the InvalidRequest the caller raises for anything else.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text parts are supported here")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where}: content must be a string or a list of parts")


def data_url(url: str) -> tuple[str, str] | None:
    """``(media_type, base64 data)`` of a ``data:...;base64,`` URL; None for other URLs.

    Raises ValueError for a data URL that is not base64 or has no media type.
    """
    if not url.startswith("data:"):
        return None
    header, sep, data = url[5:].partition(",")
    media_type, _, encoding = header.partition(";")
    if not sep or encoding != "base64" or not media_type:
        raise ValueError("a data URL image must be base64 (data:image/png;base64,...)")
    return media_type, data


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a chat message's content, read once for every vendor's mapping:
    ``text``, or an image as inline ``(media_type, base64 data)`` or a plain ``url``."""

    text: str | None = None
    inline: tuple[str, str] | None = None
    url: str | None = None


def content_parts(content: Any, bad: Callable[[str], InvalidRequest], where: str) -> list[ContentPart]:
    """A user or assistant content (a string, or text and image_url parts) as parts; empty
    texts are dropped (vendors refuse them); anything else is ``bad``, naming the part."""
    if content is None:
        return []
    if isinstance(content, str):
        return [ContentPart(text=content)] if content else []
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of parts")
    parts: list[ContentPart] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if part["text"]:
                parts.append(ContentPart(text=part["text"]))
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise bad(f"{where}.content[{i}]: image_url needs a url")
            try:
                inline = data_url(url)
            except ValueError as exc:
                raise bad(f"{where}.content[{i}]: {exc}") from None
            parts.append(ContentPart(inline=inline) if inline is not None else ContentPart(url=url))
        else:
            raise bad(f"{where}.content[{i}]: part type {kind!r} is not supported")
    return parts


def parse_tool_arguments(arguments: Any) -> dict[str, Any]:
    """A tool call's ``arguments`` (a JSON string, as OpenAI sends them) as an object.

    Raises ValueError when they are not a JSON object.
    """
    if not arguments:
        return {}
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        raise ValueError("arguments is not JSON") from None
    if not isinstance(parsed, dict):
        raise ValueError("arguments must be a JSON object")
    return parsed


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of an assistant turn: its id (None if the client sent none), the
    function's name and its arguments parsed into an object."""

    id: str | None
    name: str
    arguments: dict[str, Any]


def tool_calls_of(tool_calls: Any, bad: Callable[..., InvalidRequest], where: str) -> list[ToolCall]:
    """An assistant message's ``tool_calls``; ``bad(message[, code])`` names a bad entry."""
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise bad(f"{where}.tool_calls must be a list")
    calls = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where}.tool_calls[{i}] needs function.name")
        try:
            arguments = parse_tool_arguments(function.get("arguments"))
        except ValueError as exc:
            raise bad(f"{where}.tool_calls[{i}].function.{exc}", "invalid_tool_arguments") from None
        call_id = call.get("id")
        calls.append(ToolCall(str(call_id) if call_id else None, function["name"], arguments))
    return calls


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function tool of a request: name, description (None if absent) and the JSON
    Schema of its parameters (None if absent or empty)."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None


def function_tools(tools: Any, bad: Callable[[str], InvalidRequest]) -> list[FunctionTool]:
    """A request's ``tools``, all function tools with a name (else ``bad``)."""
    if not isinstance(tools, list):
        raise bad("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"tools[{i}] must be a function tool with a name")
        description = function.get("description")
        parameters = function.get("parameters")
        out.append(FunctionTool(function["name"], description if isinstance(description, str) else None,
                                parameters if isinstance(parameters, dict) and parameters else None))
    return out


def append_turn(turns: list[dict[str, Any]], role: str, items: list[dict[str, Any]], key: str = "content") -> None:
    """Add ``items`` as a ``role`` turn, merged into the last turn when it has that role
    (nothing is added for no items)."""
    if not items:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1][key].extend(items)
    else:
        turns.append({"role": role, key: items})


def wants_usage(body: Mapping[str, Any]) -> bool:
    """Did the client ask for a usage chunk at the end of its stream?"""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def usage_object(prompt: int, completion: int, *, cached: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` for token counts (``cached``: prompt tokens read from a cache)."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def completion_object(
    *, response_id: str, model: str, content: str | None, tool_calls: list[dict[str, Any]],
    finish_reason: str, usage: dict[str, Any], created: int | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


class ChunkWriter:
    """Writes one stream's ``chat.completion.chunk`` events (one choice), as OpenAI does."""

    __slots__ = ("created", "include_usage", "model", "response_id")

    def __init__(self, *, model: str, include_usage: bool, response_id: str = "", created: int | None = None) -> None:
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.include_usage = include_usage
        self.response_id = response_id

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI does when usage is asked for
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def end(self, usage: dict[str, Any]) -> list[bytes]:
        """The closing events: the usage-only chunk (when asked for), then ``[DONE]``."""
        if not self.include_usage:
            return [DONE_EVENT]
        chunk = {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "choices": [], "usage": usage}
        return [b"data: " + orjson.dumps(chunk) + b"\n\n", DONE_EVENT]
