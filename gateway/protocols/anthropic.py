"""Anthropic's Messages API ↔ the internal shape (OpenAI chat completions), both ways.

One module for every mapping between the two, used by the outbound provider
(:mod:`gateway.providers.anthropic`: chat → Messages for ``type: anthropic``
deployments) and the inbound route (``POST /v1/messages``: Messages → chat for any
other deployment). The stream's event-by-event re-framing, both ways, is in
:mod:`gateway.protocols.anthropic_stream`; the tables it shares (finish reasons, usage)
are here.

Outbound requests (chat → Messages): system and developer messages become ``system``;
user content parts become text and image blocks (data URLs as base64 sources, other URLs
as URL sources); assistant ``tool_calls`` become ``tool_use`` blocks with their
arguments parsed, intact; ``tool`` messages become ``tool_result`` blocks in a user
turn; consecutive turns of one role are merged, as the Messages API wants them
alternating. ``max_tokens`` (or ``max_completion_tokens``) defaults to
:data:`DEFAULT_MAX_TOKENS` because Anthropic requires it; ``stop`` becomes
``stop_sequences``; ``temperature``, ``top_p``, ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``user`` are mapped; other OpenAI-only fields are dropped
(Anthropic refuses unknown fields). What cannot be expressed (``n`` > 1, audio or file
parts, malformed tool arguments) is a 400 of ours.

Inbound requests (Messages → chat): ``system`` becomes the first system message; text
and image blocks become content parts; ``tool_use`` blocks become the assistant's
``tool_calls`` and ``tool_result`` blocks ``tool`` messages (ids kept, so they match);
``tools`` become function tools, ``tool_choice`` auto/any/tool/none becomes
auto/required/function/none (``disable_parallel_tool_use`` → ``parallel_tool_calls:
false``); ``stop_sequences`` → ``stop``, ``metadata.user_id`` → ``user``;
``temperature``, ``top_p``, ``top_k`` and ``max_tokens`` are kept. Thinking blocks and
``thinking`` have no chat counterpart and are dropped; documents, server tools and
other block types are a 400 (``invalid_request_error``).

Answers: a ``message`` ↔ a ``chat.completion`` (text joined, ``tool_use`` ↔
``tool_calls`` with JSON arguments), stop reasons ↔ finish reasons by the two tables
below, usage ``input_tokens`` (+ cache reads and writes) ↔ ``prompt_tokens`` and
``output_tokens`` ↔ ``completion_tokens``. Errors: Anthropic's ``{"type": "error",
"error": {"type", "message"}}`` ↔ the OpenAI shape, the status kept.

Why one module of ~650 lines: the two directions share their tables and block helpers,
and change together whenever either wire changes; splitting them would invite the second
copy of a mapping this module exists to prevent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.core.errors import InvalidRequest
from gateway.protocols.chat import append_turn, data_url, function_tools, text_of, tool_calls_of

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "FINISH_REASONS",
    "STOP_REASONS",
    "anthropic_error_body",
    "anthropic_error_type",
    "anthropic_status",
    "anthropic_usage",
    "chat_tool_call",
    "chat_usage",
    "countable_text",
    "from_chat_completion",
    "from_messages_request",
    "to_anthropic_error",
    "to_chat_completion",
    "to_messages_request",
    "to_openai_error",
    "tool_input",
]

ANTHROPIC_VERSION = "2023-06-01"
#: Anthropic requires max_tokens; this is used when the client sent none.
DEFAULT_MAX_TOKENS = 4096

#: Anthropic ``stop_reason`` → OpenAI ``finish_reason``.
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
#: OpenAI ``finish_reason`` → Anthropic ``stop_reason``. A chat answer does not say
#: whether a stop sequence or the model's own end stopped it: ``stop`` is ``end_turn``.
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
#: Anthropic error type → the OpenAI-shape ``code`` the outbound provider reports.
_ERROR_CODES = {
    "rate_limit_error": "rate_limit_exceeded",
    "authentication_error": "invalid_api_key",
    "overloaded_error": "overloaded",
    "not_found_error": "not_found",
}
#: HTTP status → Anthropic error type, as Anthropic's documentation lists them
#: (another 4xx is ``invalid_request_error``, another 5xx ``api_error``).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_status(status: int) -> int:
    """The status Anthropic answers where another API says 503: 529, its overload."""
    return 529 if status == 503 else status


def anthropic_error_type(status: int) -> str:
    """The Anthropic error type an answer of ``status`` carries."""
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(message: str, type_: str) -> bytes:
    """Anthropic's error JSON, encoded: ``{"type": "error", "error": {"type", "message"}}``."""
    return orjson.dumps({"type": "error", "error": {"type": type_, "message": message}})


# --------------------------------------------------------------------------- requests
def _bad(message: str, code: str = "invalid_request") -> InvalidRequest:
    return InvalidRequest(f"cannot send to an Anthropic deployment: {message}", code=code)


def _text_of(content: Any, where: str) -> str:
    """Text of a system/tool content: a string or a list of text parts."""
    return text_of(content, _bad, where)


def _image_block(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}: image_url needs a url")
    try:
        inline = data_url(url)
    except ValueError:
        raise _bad(f"{where}: a data URL image must be base64 (data:image/png;base64,...)") from None
    if inline is not None:
        media_type, data = inline
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _content_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """User or assistant content as Messages blocks (empty text is dropped: refused there)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of parts")
    blocks: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if part["text"]:
                blocks.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            blocks.append(_image_block(part, f"{where}.content[{i}]"))
        else:
            raise _bad(f"{where}.content[{i}]: part type {kind!r} is not supported")
    return blocks


def _tool_use_blocks(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": call.id or f"toolu_{i}", "name": call.name, "input": call.arguments}
            for i, call in enumerate(tool_calls_of(tool_calls, _bad, where))]


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for tool in function_tools(tools, _bad):
        entry: dict[str, Any] = {"name": tool.name,
                                 "input_schema": tool.parameters or {"type": "object", "properties": {}}}
        if tool.description is not None:
            entry["description"] = tool.description
        out.append(entry)
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    mapped: dict[str, Any] | None
    if choice is None:
        mapped = {"type": "auto"} if parallel is False else None
    elif choice == "auto":
        mapped = {"type": "auto"}
    elif choice == "none":
        mapped = {"type": "none"}
    elif choice == "required":
        mapped = {"type": "any"}
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        mapped = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise _bad("'tool_choice' must be auto, none, required or a function")
    if mapped is not None and parallel is False and mapped["type"] != "none":
        mapped["disable_parallel_tool_use"] = True
    return mapped


def to_messages_request(body: Mapping[str, Any], *, stream: bool) -> dict[str, Any]:
    """The Messages API body for an OpenAI chat body; InvalidRequest if not expressible."""
    if body.get("n") not in (None, 1):
        raise _bad("'n' other than 1 is not supported")
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(body.get("messages") or []):
        role = message.get("role")
        where = f"messages[{i}]"
        if role in ("system", "developer"):
            text = _text_of(message.get("content"), where)
            if text:
                system.append(text)
        elif role == "user":
            append_turn(messages, "user", _content_blocks(message.get("content"), where))
        elif role == "assistant":
            blocks = _content_blocks(message.get("content"), where)
            blocks += _tool_use_blocks(message.get("tool_calls"), where)
            append_turn(messages, "assistant", blocks)
        elif role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not isinstance(tool_call_id, str):
                raise _bad(f"{where}: a tool message needs tool_call_id")
            result = {"type": "tool_result", "tool_use_id": tool_call_id,
                      "content": _text_of(message.get("content"), where)}
            append_turn(messages, "user", [result])
        else:
            raise _bad(f"{where}: role {role!r} is not supported")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    if system:
        out["system"] = "\n\n".join(system)
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        out["stop_sequences"] = list(stop)
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
    if choice is not None and "tools" in out:
        out["tool_choice"] = choice
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    if stream:
        out["stream"] = True
    return out


# --------------------------------------------------------------------------- inbound requests
def _invalid(message: str, code: str = "invalid_request") -> InvalidRequest:
    return InvalidRequest(message, code=code)


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise _invalid(f"{where}: expected a text block")
    return str(block["text"])


def _system_text(system: Any) -> str:
    """``system`` as one string: a string, or text blocks joined (cache_control dropped)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n\n".join(_block_text(block, f"system[{i}]") for i, block in enumerate(system))
    raise _invalid("'system' must be a string or a list of text blocks")


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict) and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    elif kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _invalid(f"{where}: an image needs a base64 or url source")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_block_text(block, f"{where}.content[{i}]") for i, block in enumerate(content))
    raise _invalid(f"{where}: tool_result content must be a string or text blocks")


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic user turn as chat messages: its tool results first (as ``tool``
    messages, which must follow the assistant's call), then the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _invalid(f"{where}.content must be a string or a list of blocks")
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{i}]"
        if kind == "text":
            parts.append({"type": "text", "text": _block_text(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise _invalid(f"{at}: a tool_result needs tool_use_id")
            results.append({"role": "tool", "tool_call_id": tool_use_id,
                            "content": _tool_result_text(block.get("content"), at)})
        else:
            raise _invalid(f"{at}: block type {kind!r} is not supported by this deployment")
    out = results
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text and len(parts) == 1
                    else parts})
    return out


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _invalid(f"{where}.content must be a string or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{i}]"
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_use":
            assert isinstance(block, dict)
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _invalid(f"{at}: a tool_use needs id and name")
            calls.append(chat_tool_call(block))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # no chat counterpart; the model does not need its own reasoning back
        else:
            raise _invalid(f"{at}: block type {kind!r} is not supported by this deployment")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _function_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _invalid("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (
            None, "custom"
        ):
            raise _invalid(f"tools[{i}] must be a client tool with a name (server tools need an Anthropic deployment)")
        function: dict[str, Any] = {
            "name": tool["name"],
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
        }
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """``tool_choice`` in chat terms, and ``parallel_tool_calls`` (None: unset)."""
    if not isinstance(choice, dict):
        raise _invalid("'tool_choice' must be an object with a type")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _invalid("'tool_choice' type must be auto, any, tool (with a name) or none")


def from_messages_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body for an Anthropic Messages body (already validated by the
    route: ``model``, ``max_tokens``, ``messages``); InvalidRequest where not expressible."""
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body["messages"]):
        where = f"messages[{i}]"
        if message["role"] == "user":
            messages.extend(_user_messages(message.get("content"), where))
        else:
            messages.append(_assistant_message(message.get("content"), where))
    out: dict[str, Any] = {"model": body["model"], "messages": messages, "max_tokens": body["max_tokens"]}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _invalid("'stop_sequences' must be a list of strings")
        if stop:
            out["stop"] = list(stop)
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        out["user"] = metadata["user_id"]
    if body.get("tools"):
        out["tools"] = _function_tools(body["tools"])
        if body.get("tool_choice") is not None:
            choice, parallel = _chat_tool_choice(body["tool_choice"])
            out["tool_choice"] = choice
            if parallel is not None:
                out["parallel_tool_calls"] = parallel
    if body.get("stream") is True:
        out["stream"] = True
    return out


def countable_text(body: Mapping[str, Any]) -> tuple[str, int]:
    """The text an Anthropic request's input tokens are counted from, and its number of
    messages (each costs a few tokens of framing): system, text blocks, tool inputs and
    results, tool definitions. Images are not text: they are not counted."""
    pieces: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        pieces.append(system)
    elif isinstance(system, list):
        pieces += [b["text"] for b in system if isinstance(b, dict) and isinstance(b.get("text"), str)]
    listed = body.get("messages")
    messages: list[Any] = listed if isinstance(listed, list) else []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            pieces.append(content)
            continue
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            if isinstance(block.get("text"), str):
                pieces.append(block["text"])
            elif block.get("type") == "tool_use":
                pieces.append(f"{block.get('name', '')} {orjson.dumps(block.get('input') or {}).decode()}")
            elif block.get("type") == "tool_result":
                inner = block.get("content")
                if isinstance(inner, str):
                    pieces.append(inner)
                elif isinstance(inner, list):
                    pieces += [b["text"] for b in inner if isinstance(b, dict) and isinstance(b.get("text"), str)]
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            pieces.append(orjson.dumps(tool).decode())
    return "\n".join(pieces), len(messages)


# --------------------------------------------------------------------------- answers
def chat_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic ``usage`` as chat ``usage`` (cache reads and writes are prompt tokens)."""
    cache_read = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0) + cache_read
    completion = int(usage.get("output_tokens") or 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cache_read:
        out["prompt_tokens_details"] = {"cached_tokens": cache_read}
    return out


def anthropic_usage(usage: Any) -> dict[str, int]:
    """Chat ``usage`` as Anthropic ``usage``: the inverse of :func:`chat_usage`."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and cached > 0 else 0
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    out = {
        "input_tokens": max(0, (prompt if isinstance(prompt, int) else 0) - cached),
        "output_tokens": completion if isinstance(completion, int) else 0,
    }
    if cached:
        out["cache_read_input_tokens"] = cached
    return out


def chat_tool_call(block: Mapping[str, Any], index: int | None = None) -> dict[str, Any]:
    """A ``tool_use`` block as a chat tool call (``index`` for a stream's delta)."""
    call: dict[str, Any] = {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": orjson.dumps(block.get("input") or {}).decode()},
    }
    if index is not None:
        call = {"index": index, **call}
    return call


def tool_input(arguments: Any) -> Any:
    """A chat tool call's ``arguments`` as a ``tool_use`` input: parsed JSON; a model that
    wrote something else keeps it, under ``_raw``, rather than losing it."""
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"_raw": arguments}
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}


def _tool_use_block(call: Any) -> dict[str, Any] | None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return None
    return {"type": "tool_use", "id": str(call.get("id") or ""), "name": str(function.get("name") or ""),
            "input": tool_input(function.get("arguments"))}


def to_chat_completion(message: Mapping[str, Any], *, created: int | None = None) -> dict[str, Any]:
    """The ``chat.completion`` for a whole Messages ``message``."""
    blocks = message.get("content") or []
    text = "".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
    tool_calls = [chat_tool_call(b) for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    reply: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None, "refusal": None}
    if tool_calls:
        reply["tool_calls"] = tool_calls
    return {
        "id": message.get("id"),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": message.get("model"),
        "choices": [{
            "index": 0,
            "message": reply,
            "logprobs": None,
            "finish_reason": FINISH_REASONS.get(str(message.get("stop_reason")), "stop"),
        }],
        "usage": chat_usage(message.get("usage") or {}),
    }


def from_chat_completion(answer: Mapping[str, Any], *, model: str) -> dict[str, Any]:
    """The Messages ``message`` for a whole ``chat.completion`` (its first choice)."""
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    given = choice.get("message")
    reply: dict[str, Any] = given if isinstance(given, dict) else {}
    content: list[dict[str, Any]] = []
    text = reply.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in reply.get("tool_calls") or []:
        block = _tool_use_block(call)
        if block is not None:
            content.append(block)
    reason = choice.get("finish_reason")
    return {
        "id": str(answer.get("id") or ""),
        "type": "message",
        "role": "assistant",
        "model": str(answer.get("model") or model),
        "content": content,
        "stop_reason": STOP_REASONS.get(reason, "end_turn") if isinstance(reason, str) else "end_turn",
        "stop_sequence": None,
        "usage": anthropic_usage(answer.get("usage")),
    }


def _error_fields(raw: bytes) -> tuple[str | None, str | None]:
    """``(message, type)`` of an error body in either shape, where readable."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, None
    error = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(error, dict):
        message, type_ = error.get("message"), error.get("type")
        return (str(message) if message else None), (str(type_) if type_ else None)
    return None, None


def to_openai_error(status: int, raw: bytes) -> bytes:
    """An Anthropic error body in the OpenAI shape (the status is kept by the caller)."""
    message, type_ = _error_fields(raw)
    type_ = type_ or "upstream_error"
    return orjson.dumps({"error": {"message": message or f"anthropic answered HTTP {status}", "type": type_,
                                   "code": _ERROR_CODES.get(type_)}})


def to_anthropic_error(status: int, raw: bytes) -> bytes:
    """An OpenAI-shaped provider error in Anthropic's shape (the status is kept by the
    caller); the type follows the status, as the Anthropic SDKs read it."""
    message, _ = _error_fields(raw)
    return anthropic_error_body(message or f"upstream answered HTTP {status}",
                                anthropic_error_type(anthropic_status(status)))
