"""Pieces of the OpenAI chat shape that every translating provider reads or writes.

Reading a request: text of a content, a data-URL image, a tool call's JSON arguments,
whether the client asked for stream usage. Writing an answer: ``chat.completion`` and
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
