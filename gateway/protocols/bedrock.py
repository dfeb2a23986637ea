"""OpenAI chat completions ↔ AWS Bedrock's Converse API, both ways.

Requests (OpenAI → Converse): system and developer messages become ``system`` text
blocks; user and assistant turns keep their roles with ``text`` and ``image`` blocks
(data-URL images only: their bytes, base64 in JSON, with the format from the media
type); assistant ``tool_calls`` become ``toolUse`` blocks (arguments parsed) and
``tool`` messages ``toolResult`` blocks in a user turn (a JSON-object result as a
``json`` block, other text as a ``text`` block); consecutive turns of one role are
merged, as Converse wants them alternating. ``inferenceConfig`` takes ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p`` and ``stop``; ``tools`` become
``toolConfig.tools[].toolSpec`` and ``tool_choice`` ``toolConfig.toolChoice`` (auto,
any, or one tool; ``none`` sends no tools, as Converse has no such choice). ``n`` > 1,
image URLs that are not data URLs, audio and file parts are a 400 of ours.

Answers (Converse → OpenAI): ``output.message.content`` text joined, ``toolUse`` as
``tool_calls``; ``stopReason`` mapped; ``usage.inputTokens`` (plus cache reads and
writes) → ``prompt_tokens``, ``outputTokens`` → ``completion_tokens``. ConverseStream's
events (``messageStart``, ``contentBlockStart`` / ``Delta`` / ``Stop``,
``messageStop``, ``metadata``) become chunks, the usage chunk and ``[DONE]``.

Embeddings (InvokeModel, the model's own body): Amazon Titan Text Embeddings takes one
``inputText`` per call (``dimensions`` kept) and answers ``embedding`` and
``inputTextTokenCount``; Cohere Embed takes up to 96 ``texts`` (``input_type``
``search_document``) and answers ``embeddings``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.core.errors import InvalidRequest
from gateway.protocols.chat import (
    ChunkWriter,
    UpstreamAnswerError,
    append_turn,
    completion_object,
    content_parts,
    function_tools,
    text_of,
    tool_calls_of,
    usage_object,
)
from gateway.protocols.embeddings import embedding_inputs, embeddings_list

__all__ = [
    "COHERE_MAX_TEXTS",
    "StreamTranslator",
    "cohere_embedding_request",
    "embedding_family",
    "from_cohere_embeddings",
    "from_titan_embeddings",
    "not_an_embedding_model",
    "titan_embedding_requests",
    "to_chat_completion",
    "to_converse",
    "to_openai_error",
]

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
}
_IMAGE_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/gif": "gif",
                  "image/webp": "webp"}
_ERROR_CODES = {
    "ThrottlingException": ("rate_limit_error", "rate_limit_exceeded"),
    "ServiceQuotaExceededException": ("rate_limit_error", "rate_limit_exceeded"),
    "ValidationException": ("invalid_request_error", "invalid_request"),
    "AccessDeniedException": ("permission_error", "permission_denied"),
    "UnrecognizedClientException": ("authentication_error", "invalid_api_key"),
    "InvalidSignatureException": ("authentication_error", "invalid_api_key"),
    "ResourceNotFoundException": ("invalid_request_error", "model_not_found"),
    "ModelNotReadyException": ("upstream_error", "overloaded"),
    "ServiceUnavailableException": ("upstream_error", "overloaded"),
}


def _bad(message: str, code: str = "invalid_request") -> InvalidRequest:
    return InvalidRequest(f"cannot send to a Bedrock deployment: {message}", code=code)


# --------------------------------------------------------------------------- requests
def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for i, part in enumerate(content_parts(content, _bad, where)):
        if part.text is not None:
            blocks.append({"text": part.text})
            continue
        if part.inline is None:
            raise _bad(f"{where}.content[{i}]: Bedrock takes images as data URLs only")
        image_format = _IMAGE_FORMATS.get(part.inline[0])
        if image_format is None:
            raise _bad(f"{where}.content[{i}]: image type {part.inline[0]} is not png, jpeg, gif or webp")
        blocks.append({"image": {"format": image_format, "source": {"bytes": part.inline[1]}}})
    return blocks


def _tool_uses(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    return [{"toolUse": {"toolUseId": call.id or f"tooluse_{i}", "name": call.name, "input": call.arguments}}
            for i, call in enumerate(tool_calls_of(tool_calls, _bad, where))]


def _tool_result(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise _bad(f"{where}: a tool message needs tool_call_id")
    text = text_of(message.get("content"), _bad, where)
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = None
    block = {"json": parsed} if isinstance(parsed, dict) else {"text": text}
    return {"toolResult": {"toolUseId": call_id, "content": [block]}}


def _tool_config(tools: Any, choice: Any) -> dict[str, Any] | None:
    declared = function_tools(tools, _bad)
    if choice == "none":
        return None  # Converse has no "none": sending no tools is the same
    specs = []
    for tool in declared:
        spec: dict[str, Any] = {"name": tool.name, "inputSchema": {"json": tool.parameters or {"type": "object"}}}
        if tool.description is not None:
            spec["description"] = tool.description
        specs.append({"toolSpec": spec})
    config: dict[str, Any] = {"tools": specs}
    if choice == "auto":
        config["toolChoice"] = {"auto": {}}
    elif choice == "required":
        config["toolChoice"] = {"any": {}}
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        config["toolChoice"] = {"tool": {"name": choice["function"]["name"]}}
    elif choice is not None:
        raise _bad("'tool_choice' must be auto, none, required or a function")
    return config


def to_converse(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Converse body for an OpenAI chat body (the model goes in the URL)."""
    if body.get("n") not in (None, 1):
        raise _bad("'n' other than 1 is not supported")
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(body.get("messages") or []):
        role = message.get("role")
        where = f"messages[{i}]"
        if role in ("system", "developer"):
            text = text_of(message.get("content"), _bad, where)
            if text:
                system.append({"text": text})
        elif role == "user":
            append_turn(messages, "user", _blocks(message.get("content"), where))
        elif role == "assistant":
            append_turn(messages, "assistant",
                    _blocks(message.get("content"), where) + _tool_uses(message.get("tool_calls"), where))
        elif role == "tool":
            append_turn(messages, "user", [_tool_result(message, where)])
        else:
            raise _bad(f"{where}: role {role!r} is not supported")
    out: dict[str, Any] = {"messages": messages}
    if system:
        out["system"] = system
    inference: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        inference["maxTokens"] = max_tokens
    for ours, theirs in (("temperature", "temperature"), ("top_p", "topP")):
        if body.get(ours) is not None:
            inference[theirs] = body[ours]
    stop = body.get("stop")
    if isinstance(stop, str):
        inference["stopSequences"] = [stop]
    elif isinstance(stop, list) and stop:
        inference["stopSequences"] = list(stop)
    if inference:
        out["inferenceConfig"] = inference
    if body.get("tools"):
        config = _tool_config(body["tools"], body.get("tool_choice"))
        if config is not None:
            out["toolConfig"] = config
    return out


# --------------------------------------------------------------------------- answers
def _usage(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    cached = int(usage.get("cacheReadInputTokens") or 0)
    prompt = int(usage.get("inputTokens") or 0) + cached + int(usage.get("cacheWriteInputTokens") or 0)
    return usage_object(prompt, int(usage.get("outputTokens") or 0), cached=cached)


def _tool_call(tool_use: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": tool_use.get("toolUseId"), "type": "function",
            "function": {"name": tool_use.get("name"), "arguments": orjson.dumps(tool_use.get("input") or {}).decode()}}


def to_chat_completion(answer: Mapping[str, Any], *, model: str, response_id: str,
                       created: int | None = None) -> dict[str, Any]:
    """The ``chat.completion`` for a whole Converse answer."""
    output = answer.get("output")
    message = output.get("message") if isinstance(output, dict) else None
    if not isinstance(message, dict):
        raise UpstreamAnswerError("bedrock answered without output.message")
    blocks = [b for b in message.get("content") or [] if isinstance(b, dict)]
    text = "".join(b["text"] for b in blocks if isinstance(b.get("text"), str))
    tool_calls = [_tool_call(b["toolUse"]) for b in blocks if isinstance(b.get("toolUse"), dict)]
    return completion_object(
        response_id=response_id, model=model, content=text if text or not tool_calls else None,
        tool_calls=tool_calls, finish_reason=_FINISH_REASONS.get(str(answer.get("stopReason")), "stop"),
        usage=_usage(answer.get("usage")), created=created,
    )


def to_openai_error(status: int, raw: bytes, error_type_header: str | None) -> bytes:
    """A Bedrock error (``{"message"}`` plus ``x-amzn-ErrorType``) in the OpenAI shape."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    message = str((obj.get("message") or obj.get("Message")) if isinstance(obj, dict) else "") \
        or f"bedrock answered HTTP {status}"
    name = (error_type_header or "").split(":")[0]
    error_type, code = _ERROR_CODES.get(name, ("upstream_error", None))
    return orjson.dumps({"error": {"message": f"{name}: {message}" if name else message,
                                   "type": error_type, "code": code}})


class StreamTranslator:
    """Turns one ConverseStream's events (type, JSON payload) into OpenAI chunk events."""

    __slots__ = ("_finish", "_tools", "_usage", "finished", "writer")

    def __init__(self, *, model: str, include_usage: bool, response_id: str, created: int | None = None) -> None:
        self.writer = ChunkWriter(model=model, include_usage=include_usage, response_id=response_id,
                                  created=int(time.time()) if created is None else created)
        #: Content block index → OpenAI tool-call index.
        self._tools: dict[int, int] = {}
        self._finish = "stop"
        self._usage: Any = None
        self.finished = False

    def feed(self, event_type: str, payload: Mapping[str, Any]) -> list[bytes]:
        if event_type == "messageStart":
            return [self.writer.chunk({"role": "assistant", "content": ""})]
        if event_type == "contentBlockStart":
            tool_use = (payload.get("start") or {}).get("toolUse")
            if not isinstance(tool_use, dict):
                return []
            index = self._tools.setdefault(int(payload.get("contentBlockIndex", 0)), len(self._tools))
            call = {"index": index, **_tool_call({**tool_use, "input": {}})}
            call["function"]["arguments"] = ""  # the arguments follow as toolUse deltas
            return [self.writer.chunk({"tool_calls": [call]})]
        if event_type == "contentBlockDelta":
            delta = payload.get("delta") or {}
            if isinstance(delta.get("text"), str):
                return [self.writer.chunk({"content": delta["text"]})]
            tool_delta = delta.get("toolUse")
            tool_index = self._tools.get(int(payload.get("contentBlockIndex", 0)))
            if isinstance(tool_delta, dict) and tool_index is not None:
                piece = {"index": tool_index, "function": {"arguments": str(tool_delta.get("input") or "")}}
                return [self.writer.chunk({"tool_calls": [piece]})]
            return []  # reasoning content has no OpenAI counterpart
        if event_type == "messageStop":
            self._finish = _FINISH_REASONS.get(str(payload.get("stopReason")), "stop")
            return [self.writer.chunk({}, self._finish)]
        if event_type == "metadata":
            self._usage = payload.get("usage")
            self.finished = True
            return self.writer.end(_usage(self._usage))
        return []  # contentBlockStop, and event types added later


# --------------------------------------------------------------------------- embeddings (InvokeModel)
#: Most texts one Cohere Embed call takes.
COHERE_MAX_TEXTS = 96


def embedding_family(model: str) -> str | None:
    """``titan`` (Amazon Titan Text Embeddings), ``cohere`` (Cohere Embed) or None (not an
    embedding model mapped here); an inference-profile prefix (``us.``, ``eu.``) is allowed."""
    if "amazon.titan-embed-text" in model:
        return "titan"
    if "cohere.embed" in model:
        return "cohere"
    return None


def titan_embedding_requests(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One Titan InvokeModel body per input (``inputText``; ``dimensions`` kept)."""
    extra = {"dimensions": body["dimensions"]} if isinstance(body.get("dimensions"), int) else {}
    return [{"inputText": text, **extra} for text in embedding_inputs(body, _bad)]


def cohere_embedding_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Cohere Embed InvokeModel body for every input at once (``search_document``:
    OpenAI's embeddings API does not say what the texts are for)."""
    texts = embedding_inputs(body, _bad)
    if len(texts) > COHERE_MAX_TEXTS:
        raise _bad(f"Cohere Embed takes at most {COHERE_MAX_TEXTS} inputs per call, got {len(texts)}")
    return {"texts": texts, "input_type": "search_document"}


def from_titan_embeddings(answers: list[Mapping[str, Any]], *, body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """OpenAI's embeddings list for the Titan answers (``embedding``), in input order, the
    prompt tokens summed from each ``inputTextTokenCount``."""
    tokens = sum(int(a.get("inputTextTokenCount") or 0) for a in answers)
    return embeddings_list([a.get("embedding") for a in answers], model=model, prompt_tokens=tokens, body=body)


def from_cohere_embeddings(answer: Mapping[str, Any], *, body: Mapping[str, Any], model: str,
                           prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings list for a Cohere Embed answer (``embeddings``, a list of float
    vectors, or ``{"float": [...]}`` when embedding types were asked)."""
    vectors = answer.get("embeddings")
    if isinstance(vectors, dict):
        vectors = vectors.get("float")
    if not isinstance(vectors, list):
        raise UpstreamAnswerError("bedrock answered Cohere embeddings without an embeddings list")
    return embeddings_list(vectors, model=model, prompt_tokens=prompt_tokens, body=body)


def not_an_embedding_model(model: str) -> InvalidRequest:
    """The 400 for an embeddings call to a Bedrock model this mapping does not embed with."""
    return _bad(f"model {model!r} is not an embedding model this gateway maps "
                "(amazon.titan-embed-text-*, cohere.embed-*)", "model_not_supported")
