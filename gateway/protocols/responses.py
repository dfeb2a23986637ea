"""OpenAI's Responses API (``/v1/responses``) ↔ the internal chat shape.

Requests (:func:`to_chat_request`): ``instructions`` becomes the first system message;
``input`` (a string, or a list of items) becomes messages in order — a message item
(``role`` user/assistant/system/developer, content a string or ``input_text`` /
``input_image`` / ``output_text`` / ``refusal`` parts), a ``function_call`` (an assistant
message's ``tool_calls``, consecutive calls in one message) and a
``function_call_output`` (a ``tool`` message); ``reasoning`` items are dropped (a chat
model cannot take them back). ``max_output_tokens`` → ``max_tokens``; ``temperature``,
``top_p``, ``user``, ``parallel_tool_calls`` kept; function ``tools`` and ``tool_choice``
re-shaped; ``text.format`` → ``response_format``. Built-in tools (``web_search``,
``file_search``, ...), ``input_file`` parts, ``item_reference`` items and ``background``
are a 400: only a deployment serving ``/responses`` natively could honour them.

Answers (:func:`to_response`): a ``chat.completion`` becomes a ``response`` object, its
text an ``output_text`` part of one ``message`` item and each tool call a
``function_call`` item; ``finish_reason`` ``length`` makes it ``incomplete``. The
stream's re-framing is :mod:`gateway.protocols.responses_stream`.

Stored conversations (:func:`input_items`) are lists of Responses items with ids, as
``GET /v1/responses/{id}/input_items`` lists them.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from gateway.core.errors import InvalidRequest

__all__ = [
    "ECHOED_FIELDS",
    "as_object",
    "input_items",
    "new_id",
    "response_object",
    "response_usage",
    "to_chat_request",
    "to_response",
]

#: Request fields echoed in the response object, with OpenAI's defaults.
ECHOED_FIELDS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "temperature": None,
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
    "user": None,
    "store": True,
    "truncation": "disabled",
}

_ROLES = frozenset({"user", "assistant", "system", "developer"})
_KEPT = ("temperature", "top_p", "user", "parallel_tool_calls", "stream", "seed")


def as_object(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one (for lenient reads of answers)."""
    return value if isinstance(value, dict) else {}


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (``resp_…``, ``msg_…``, ``fc_…``): unguessable, 48 hex."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _text_of(content: Any, where: str) -> str:
    """The text of a tool output (a string or a list of ``input_text`` parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise InvalidRequest(f"{where}: must be a string or a list of text parts", code="invalid_input")


def _chat_part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.text: must be a string", code="invalid_input")
        return {"type": "text", "text": part["text"]}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal", ""))}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise InvalidRequest(f"{where}: an input_image needs an image_url (file_id is not supported)",
                                 code="unsupported_input")
        image: dict[str, Any] = {"url": url}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        raise InvalidRequest(f"{where}: input_file parts are not supported by this deployment",
                             code="unsupported_input")
    raise InvalidRequest(f"{where}: unknown content part type {kind!r}", code="invalid_input")


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidRequest(f"{where}.role: must be one of user, assistant, system, developer", code="invalid_input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: must be a string or a list of parts", code="invalid_input")
    parts = [_chat_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        # Text only: a plain string, what every chat server (and every role) accepts.
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where}: must be an object", code="invalid_input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
                raise InvalidRequest(f"{where}: a function_call needs string call_id, name and arguments",
                                     code="invalid_input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}: a function_call_output needs a string call_id", code="invalid_input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), where)})
        elif kind == "reasoning":
            continue  # a chat model cannot take reasoning back; its answer stands without it
        else:
            raise InvalidRequest(f"{where}: items of type {kind!r} are not supported by this deployment",
                                 code="unsupported_input")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", code="invalid_tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(
                f"tools[{i}]: built-in tools such as {kind!r} are not supported by this deployment "
                "(only function tools, or a deployment serving the Responses API natively)",
                code="unsupported_tool",
            )
        if not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools[{i}].name: must be a string", code="invalid_tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest("'tool_choice' must be auto, none, required or a function", code="invalid_tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, dict):
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format: a json_schema needs a name and a schema", code="invalid_text_format")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest("text.format.type: must be text, json_object or json_schema", code="invalid_text_format")


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items, each with an id (as stored and listed)."""
    if isinstance(value, str) and value:
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' must be a non-empty string or a non-empty list of items", code="invalid_input")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}]: must be an object", code="invalid_input")
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            # Listed as OpenAI lists it: content as parts.
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "content": [{"type": part, "text": item["content"]}]}
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
        out.append({"id": new_id(prefix), **item, "type": kind} if "id" not in item else {**item, "type": kind})
    return out


def to_chat_request(body: Mapping[str, Any], conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body for a Responses body whose whole input (earlier turns first) is
    ``conversation``; InvalidRequest where chat cannot express it."""
    if body.get("background") is True:
        raise InvalidRequest("'background' is not supported", code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string", code="invalid_instructions")
        messages.append({"role": "system", "content": instructions})
    messages.extend(_messages(conversation))
    out: dict[str, Any] = {"model": body["model"], "messages": messages}
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1:
            raise InvalidRequest("'max_output_tokens' must be a positive integer", code="invalid_max_output_tokens")
        out["max_tokens"] = max_output
    for name in _KEPT:
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    return out


def response_usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage counts in the Responses shape."""
    if not isinstance(usage, Mapping):
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = prompt_details.get("cached_tokens") if isinstance(prompt_details, Mapping) else None
    reasoning = completion_details.get("reasoning_tokens") if isinstance(completion_details, Mapping) else None
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached or 0)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning or 0)},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def response_object(
    response_id: str, body: Mapping[str, Any], *, model: str, created_at: int | None = None,
    status: str = "in_progress", output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """A ``response`` object for the request ``body``, in OpenAI's field order."""
    echoed = {name: default if body.get(name) is None else body[name] for name, default in ECHOED_FIELDS.items()}
    text = as_object(body.get("text"))
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "model": model,
        "output": output or [],
        "reasoning": {"effort": None, "summary": None},
        "text": {"format": {"type": "text"}, **text},
        "usage": usage,
        **echoed,
    }


def _output_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    refusal = message.get("refusal")
    if text or (not message.get("tool_calls") and not refusal):
        items.append({"id": new_id("msg"), "type": "message", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    elif isinstance(refusal, str) and refusal:
        items.append({"id": new_id("msg"), "type": "message", "status": "completed", "role": "assistant",
                      "content": [{"type": "refusal", "refusal": refusal}]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        items.append({"id": new_id("fc"), "type": "function_call", "status": "completed",
                      "call_id": call.get("id") or new_id("call"), "name": function.get("name", ""),
                      "arguments": function.get("arguments") or ""})
    return items


def to_response(
    answer: Mapping[str, Any], body: Mapping[str, Any], response_id: str, *, model: str, created_at: int | None = None,
) -> dict[str, Any]:
    """The ``response`` object for a whole ``chat.completion`` answering ``body``; made at
    ``created_at`` (default: the answer's ``created``)."""
    choices = answer.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = as_object(first.get("message"))
    incomplete = first.get("finish_reason") == "length"
    return response_object(
        response_id, body, model=str(answer.get("model") or model),
        created_at=created_at if created_at is not None else (
            answer.get("created") if isinstance(answer.get("created"), int) else None),
        status="incomplete" if incomplete else "completed", output=_output_items(message),
        usage=response_usage(answer.get("usage")),
        incomplete_reason="max_output_tokens" if incomplete else None,
    )
