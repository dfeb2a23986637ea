"""OpenAI chat completions ↔ the Gemini API's ``generateContent``, both ways.

Requests (OpenAI → Gemini): system and developer messages become ``systemInstruction``;
``user`` turns stay ``user``, ``assistant`` turns become ``model``; text parts become
``text`` parts, data-URL images ``inlineData`` (other image URLs ``fileData``); assistant
``tool_calls`` become ``functionCall`` parts (arguments parsed, id kept) and ``tool``
messages ``functionResponse`` parts in a user turn, named after the call they answer
(Gemini needs the name; OpenAI sends only the id, so it is looked up in the history).
Consecutive turns of one role are merged. ``generationConfig`` takes temperature,
top_p, max_tokens / max_completion_tokens, stop, seed, presence and frequency penalties,
and ``response_format`` (JSON mode, or a JSON schema as ``responseJsonSchema``);
``tools`` become one tool of ``functionDeclarations`` and ``tool_choice`` the
``functionCallingConfig`` mode (AUTO, NONE, ANY, ANY with one allowed name). Other
OpenAI-only fields are dropped; ``n`` > 1 and audio or file parts are a 400 of ours.

Answers (Gemini → OpenAI): the first candidate's text parts are joined, its
``functionCall`` parts become ``tool_calls`` (with the id Gemini sent, else a stable one
derived from the response and the part's position, identical whole or streamed);
``finishReason`` maps to OpenAI's; ``usageMetadata`` to ``usage`` (cached content
tokens as ``cached_tokens``, thinking tokens counted as completion tokens, as they are
billed). A prompt blocked by safety (``promptFeedback.blockReason``, no candidates) is
:class:`SafetyBlock`, which the provider answers as a 400 ``content_filter``.
"""

from __future__ import annotations

import hashlib
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
from gateway.protocols.sse import event_data

__all__ = [
    "SafetyBlock",
    "StreamTranslator",
    "embedding_requests",
    "from_predict_embeddings",
    "predict_embeddings_request",
    "retry_delay",
    "safety_block",
    "to_chat_completion",
    "to_embeddings_answer",
    "to_generate_content",
    "to_openai_error",
]

_FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
}
_ERROR_TYPES = {
    "INVALID_ARGUMENT": ("invalid_request_error", "invalid_request"),
    "FAILED_PRECONDITION": ("invalid_request_error", "invalid_request"),
    "UNAUTHENTICATED": ("authentication_error", "invalid_api_key"),
    "PERMISSION_DENIED": ("permission_error", "permission_denied"),
    "NOT_FOUND": ("invalid_request_error", "model_not_found"),
    "RESOURCE_EXHAUSTED": ("rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": ("upstream_error", "overloaded"),
}


class SafetyBlock(Exception):
    """Gemini refused the prompt itself (``promptFeedback.blockReason``)."""

    def __init__(self, reason: str, message: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.message = message

    def openai_error(self) -> bytes:
        detail = f": {self.message}" if self.message else ""
        return orjson.dumps({"error": {
            "message": f"Gemini blocked the prompt ({self.reason}){detail}",
            "type": "invalid_request_error", "param": "messages", "code": "content_filter"}})


def _bad(message: str, code: str = "invalid_request") -> InvalidRequest:
    return InvalidRequest(f"cannot send to a Gemini deployment: {message}", code=code)


# --------------------------------------------------------------------------- requests
def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for part in content_parts(content, _bad, where):
        if part.text is not None:
            parts.append({"text": part.text})
        elif part.inline is not None:
            parts.append({"inlineData": {"mimeType": part.inline[0], "data": part.inline[1]}})
        else:
            parts.append({"fileData": {"fileUri": part.url}})
    return parts


def _function_calls(tool_calls: Any, where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    parts = []
    for call in tool_calls_of(tool_calls, _bad, where):
        entry: dict[str, Any] = {"name": call.name, "args": call.arguments}
        if call.id is not None:
            entry["id"] = call.id
            names[call.id] = call.name
        parts.append({"functionCall": entry})
    return parts


def _function_response(message: Mapping[str, Any], where: str, names: Mapping[str, str]) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise _bad(f"{where}: a tool message needs tool_call_id")
    name = names.get(call_id)
    if name is None:
        raise _bad(f"{where}: tool_call_id {call_id!r} answers no earlier assistant tool call")
    text = text_of(message.get("content"), _bad, where)
    try:  # a JSON object result goes as is; anything else is wrapped, as Gemini wants an object
        result = orjson.loads(text)
    except orjson.JSONDecodeError:
        result = None
    response = result if isinstance(result, dict) else {"result": text}
    return {"functionResponse": {"id": call_id, "name": name, "response": response}}


def _tools(tools: Any) -> list[dict[str, Any]]:
    declarations = []
    for tool in function_tools(tools, _bad):
        entry: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            entry["description"] = tool.description
        if tool.parameters is not None:
            # JSON Schema as OpenAI has it; Gemini's parametersJsonSchema takes it unchanged.
            entry["parametersJsonSchema"] = tool.parameters
        declarations.append(entry)
    return [{"functionDeclarations": declarations}]


def _tool_config(choice: Any) -> dict[str, Any] | None:
    if choice is None:
        return None
    if choice == "auto":
        mode: dict[str, Any] = {"mode": "AUTO"}
    elif choice == "none":
        mode = {"mode": "NONE"}
    elif choice == "required":
        mode = {"mode": "ANY"}
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        mode = {"mode": "ANY", "allowedFunctionNames": [choice["function"]["name"]]}
    else:
        raise _bad("'tool_choice' must be auto, none, required or a function")
    return {"functionCallingConfig": mode}


def _generation_config(body: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "topP"), ("seed", "seed"),
                         ("presence_penalty", "presencePenalty"), ("frequency_penalty", "frequencyPenalty")):
        if body.get(ours) is not None:
            config[theirs] = body[ours]
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        config["maxOutputTokens"] = max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        config["stopSequences"] = [stop]
    elif isinstance(stop, list) and stop:
        config["stopSequences"] = list(stop)
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind == "json_object":
            config["responseMimeType"] = "application/json"
        elif kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise _bad("response_format.json_schema.schema must be an object")
            config["responseMimeType"] = "application/json"
            config["responseJsonSchema"] = schema
        elif kind not in (None, "text"):
            raise _bad(f"response_format type {kind!r} is not supported")
    return config


def to_generate_content(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``generateContent`` body for an OpenAI chat body; InvalidRequest if not expressible."""
    if body.get("n") not in (None, 1):
        raise _bad("'n' other than 1 is not supported")
    system: list[str] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id → function name, for functionResponse
    for i, message in enumerate(body.get("messages") or []):
        role = message.get("role")
        where = f"messages[{i}]"
        if role in ("system", "developer"):
            text = text_of(message.get("content"), _bad, where)
            if text:
                system.append(text)
        elif role == "user":
            append_turn(contents, "user", _parts(message.get("content"), where), "parts")
        elif role == "assistant":
            parts = _parts(message.get("content"), where)
            parts += _function_calls(message.get("tool_calls"), where, names)
            append_turn(contents, "model", parts, "parts")
        elif role == "tool":
            append_turn(contents, "user", [_function_response(message, where, names)], "parts")
        else:
            raise _bad(f"{where}: role {role!r} is not supported")
    out: dict[str, Any] = {"contents": contents}
    if system:
        out["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
    config = _generation_config(body)
    if config:
        out["generationConfig"] = config
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
        tool_config = _tool_config(body.get("tool_choice"))
        if tool_config is not None:
            out["toolConfig"] = tool_config
    return out


# --------------------------------------------------------------------------- answers
def safety_block(answer: Mapping[str, Any]) -> SafetyBlock | None:
    """The prompt block in an answer (no candidates, ``promptFeedback.blockReason``), if any."""
    feedback = answer.get("promptFeedback")
    if answer.get("candidates") or not isinstance(feedback, dict) or not feedback.get("blockReason"):
        return None
    return SafetyBlock(str(feedback["blockReason"]), feedback.get("blockReasonMessage"))


def _usage(metadata: Any) -> dict[str, Any]:
    metadata = metadata if isinstance(metadata, dict) else {}
    prompt = int(metadata.get("promptTokenCount") or 0)
    completion = int(metadata.get("candidatesTokenCount") or 0) + int(metadata.get("thoughtsTokenCount") or 0)
    return usage_object(prompt, completion, cached=int(metadata.get("cachedContentTokenCount") or 0))


def _call_id(call: Mapping[str, Any], response_id: str, position: int) -> str:
    if isinstance(call.get("id"), str) and call["id"]:
        return str(call["id"])
    digest = hashlib.sha256(f"{response_id}:{position}:{call.get('name')}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _tool_call(call: Mapping[str, Any], response_id: str, position: int) -> dict[str, Any]:
    return {
        "id": _call_id(call, response_id, position),
        "type": "function",
        "function": {"name": call.get("name"), "arguments": orjson.dumps(call.get("args") or {}).decode()},
    }


def _candidate(answer: Mapping[str, Any]) -> Mapping[str, Any]:
    candidates = answer.get("candidates")
    if not isinstance(candidates, list) or not candidates or not isinstance(candidates[0], dict):
        return {}
    return candidates[0]


def _parts_of(candidate: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _finish_reason(raw: Any, has_tool_calls: bool) -> str:
    if has_tool_calls and raw in (None, "STOP"):
        return "tool_calls"  # Gemini says STOP after a function call; OpenAI clients expect tool_calls
    return _FINISH_REASONS.get(str(raw), "stop")


def to_chat_completion(answer: Mapping[str, Any], *, model: str, created: int | None = None) -> dict[str, Any]:
    """The ``chat.completion`` for a whole ``GenerateContentResponse`` (not blocked)."""
    response_id = str(answer.get("responseId") or "")
    candidate = _candidate(answer)
    parts = _parts_of(candidate)
    # Thought summaries (``thought: true``) are the model's reasoning, not its answer.
    text = "".join(p["text"] for p in parts if isinstance(p.get("text"), str) and not p.get("thought"))
    calls = [p["functionCall"] for p in parts if isinstance(p.get("functionCall"), dict)]
    tool_calls = [_tool_call(c, response_id, i) for i, c in enumerate(calls)]
    return completion_object(
        response_id=response_id, model=str(answer.get("modelVersion") or model),
        content=text if text or not tool_calls else None, tool_calls=tool_calls,
        finish_reason=_finish_reason(candidate.get("finishReason"), bool(tool_calls)),
        usage=_usage(answer.get("usageMetadata")), created=created,
    )


def to_openai_error(status: int, raw: bytes) -> bytes:
    """A Google API error body (``{"error": {code, message, status}}``) in the OpenAI shape."""
    message, error_type, code = f"gemini answered HTTP {status}", "upstream_error", None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    error = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or message)
        error_type, code = _ERROR_TYPES.get(str(error.get("status")), (error_type, None))
        details = error.get("details")
        details = details if isinstance(details, list) else []
        if any(isinstance(d, dict) and d.get("reason") == "API_KEY_INVALID" for d in details):
            # Google answers a bad key with 400 INVALID_ARGUMENT; say what it is.
            error_type, code = "authentication_error", "invalid_api_key"
    return orjson.dumps({"error": {"message": message, "type": error_type, "code": code}})


def retry_delay(raw: bytes) -> float | None:
    """Seconds from a ``google.rpc.RetryInfo`` detail (``"retryDelay": "17s"``), if any."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    for detail in details if isinstance(details, list) else ():
        delay = detail.get("retryDelay") if isinstance(detail, dict) else None
        if isinstance(delay, str) and delay.endswith("s"):
            try:
                return max(0.0, float(delay[:-1]))
            except ValueError:
                return None
    return None


class StreamTranslator:
    """Turns one ``streamGenerateContent?alt=sse`` stream into OpenAI chunk events."""

    __slots__ = ("_calls", "_finish", "_started", "_usage", "finished", "writer")

    def __init__(self, *, model: str, include_usage: bool, created: int | None = None) -> None:
        self.writer = ChunkWriter(model=model, include_usage=include_usage, created=created)
        self._started = False
        self._calls = 0
        self._finish: Any = None
        self._usage: Any = None
        self.finished = False

    def parse(self, event: bytes) -> dict[str, Any] | None:
        """The JSON object of one SSE event (None for comments); UpstreamAnswerError if broken."""
        data = event_data(event)
        if data is None:
            return None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamAnswerError("gemini stream sent an event that is not JSON") from None
        if not isinstance(obj, dict):
            raise UpstreamAnswerError("gemini stream sent JSON that is not an object")
        return obj

    def feed(self, answer: Mapping[str, Any]) -> list[bytes]:
        """The OpenAI events for one streamed ``GenerateContentResponse``."""
        if "error" in answer:
            error = answer.get("error") or {}
            raise UpstreamAnswerError(f"gemini stream error: {error.get('status', '')}: {error.get('message', '')}")
        block = safety_block(answer)
        if block is not None:
            raise UpstreamAnswerError(f"gemini blocked the prompt mid-stream ({block.reason})")
        out: list[bytes] = []
        if not self._started:
            self._started = True
            self.writer.response_id = str(answer.get("responseId") or "")
            self.writer.model = str(answer.get("modelVersion") or self.writer.model)
            out.append(self.writer.chunk({"role": "assistant", "content": ""}))
        if answer.get("usageMetadata") is not None:
            self._usage = answer["usageMetadata"]  # each chunk carries the running totals
        candidate = _candidate(answer)
        for part in _parts_of(candidate):
            if isinstance(part.get("text"), str) and part["text"] and not part.get("thought"):
                out.append(self.writer.chunk({"content": part["text"]}))
            elif isinstance(part.get("functionCall"), dict):
                call = {"index": self._calls,
                        **_tool_call(part["functionCall"], self.writer.response_id, self._calls)}
                self._calls += 1
                out.append(self.writer.chunk({"tool_calls": [call]}))
        if candidate.get("finishReason"):
            self._finish = candidate["finishReason"]
        return out

    def close(self) -> list[bytes]:
        """The closing events once Gemini's stream ended (it sends no end marker)."""
        if not self._started:
            raise UpstreamAnswerError("gemini stream ended before any answer")
        self.finished = True
        if self._finish is None:
            raise UpstreamAnswerError("gemini stream ended without a finish reason")
        last = self.writer.chunk({}, _finish_reason(self._finish, self._calls > 0))
        return [last, *self.writer.end(_usage(self._usage))]


# --------------------------------------------------------------------------- embeddings
def embedding_requests(body: Mapping[str, Any], model: str) -> list[dict[str, Any]]:
    """``embedContent`` requests for an OpenAI embeddings body, one per input (sent alone
    to ``embedContent``, or together to ``batchEmbedContents``)."""
    request: dict[str, Any] = {"model": f"models/{model}"}
    if isinstance(body.get("dimensions"), int):
        request["outputDimensionality"] = body["dimensions"]
    return [{**request, "content": {"parts": [{"text": text}]}} for text in embedding_inputs(body, _bad)]


def to_embeddings_answer(answer: Mapping[str, Any], *, body: Mapping[str, Any], model: str,
                         prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings list for an ``embedContent`` or ``batchEmbedContents`` answer.

    Gemini reports no token counts for embeddings: ``prompt_tokens`` is the caller's estimate.
    """
    embeddings = [answer["embedding"]] if isinstance(answer.get("embedding"), dict) else answer.get("embeddings")
    if not isinstance(embeddings, list):
        raise UpstreamAnswerError("gemini answered embeddings without an embeddings list")
    vectors = [e.get("values") if isinstance(e, dict) else None for e in embeddings]
    return embeddings_list(vectors, model=model, prompt_tokens=prompt_tokens, body=body)


def predict_embeddings_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """Vertex AI's ``:predict`` body for text embedding models: one instance per input,
    ``dimensions`` as ``parameters.outputDimensionality``."""
    out: dict[str, Any] = {"instances": [{"content": text} for text in embedding_inputs(body, _bad)]}
    if isinstance(body.get("dimensions"), int):
        out["parameters"] = {"outputDimensionality": body["dimensions"]}
    return out


def from_predict_embeddings(answer: Mapping[str, Any], *, body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """OpenAI's embeddings list for a ``:predict`` answer (``predictions[].embeddings``),
    the prompt tokens summed from each prediction's ``statistics.token_count``."""
    predictions = answer.get("predictions")
    if not isinstance(predictions, list):
        raise UpstreamAnswerError("vertex answered embeddings without predictions")
    vectors, tokens = [], 0
    for prediction in predictions:
        embeddings = prediction.get("embeddings") if isinstance(prediction, dict) else None
        if not isinstance(embeddings, dict):
            raise UpstreamAnswerError("vertex answered a prediction without embeddings")
        vectors.append(embeddings.get("values"))
        statistics = embeddings.get("statistics")
        count = statistics.get("token_count") if isinstance(statistics, dict) else None
        if isinstance(count, int | float) and not isinstance(count, bool):
            tokens += round(count)  # a number in JSON; Vertex writes it as a float
    return embeddings_list(vectors, model=model, prompt_tokens=tokens, body=body)
