"""A fake Gemini API (``generativelanguage.googleapis.com``) speaking its own wire.

``POST /v1beta/models/{model}:generateContent``, ``:streamGenerateContent?alt=sse``
(``data: {...}`` events separated by CRLF blank lines, no end marker, usage on every
chunk, the finish reason on the last), ``:embedContent`` and ``:batchEmbedContents``.
The key must come in ``x-goog-api-key`` (or ``?key=``), else Google's 400
``API_KEY_INVALID``. Requests are validated like Google's proto JSON parser does:
unknown fields (top level, ``generationConfig``, parts) are 400 "Unknown name", roles
must be ``user`` / ``model``, a ``functionResponse`` needs a name.

Answers: text "This is a mock answer to: <last user text>"; with function declarations
and a last user turn that is not a function response, a ``functionCall`` of the first
declared function (no id, as the Gemini API sends); after a function response, text
quoting it. A prompt containing ``BLOCKME`` is blocked (``promptFeedback.blockReason``).
Script steps (``VendorState.script``): ``{"status": N, "retry_delay": "7s"}``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway.core.tokens import count_tokens
from gateway.testing.fake_vendor import STATE_KEY, VendorState, json_response

__all__ = ["GeminiFake", "answer_model_call", "google_error", "make_app"]

_TOP_FIELDS = {"contents", "systemInstruction", "generationConfig", "tools", "toolConfig", "safetySettings",
               "cachedContent"}
_CONFIG_FIELDS = {"temperature", "topP", "topK", "maxOutputTokens", "stopSequences", "candidateCount", "seed",
                  "presencePenalty", "frequencyPenalty", "responseMimeType", "responseSchema",
                  "responseJsonSchema", "thinkingConfig"}
_PART_FIELDS = {"text", "inlineData", "fileData", "functionCall", "functionResponse", "thought"}
_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
           500: "INTERNAL", 503: "UNAVAILABLE"}


@dataclass(slots=True)
class GeminiFake:
    """What the fake accepts."""

    api_key: str = "gemini-key-1"
    models: tuple[str, ...] = ("gemini-2.5-flash", "gemini-embedding-001")
    state: VendorState = field(default_factory=VendorState)


def google_error(status: int, message: str, details: list[dict[str, Any]] | None = None) -> web.Response:
    error: dict[str, Any] = {"code": status, "message": message, "status": _STATUS.get(status, "UNKNOWN")}
    if details:
        error["details"] = details
    return json_response({"error": error}, status)


def _invalid(request_fields: set[str], allowed: set[str], where: str) -> web.Response | None:
    unknown = sorted(request_fields - allowed)
    if unknown:
        return google_error(400, f'Invalid JSON payload received. Unknown name "{unknown[0]}" at \'{where}\': '
                                  "Cannot find field.")
    return None


def _validate(body: Any) -> web.Response | None:
    if not isinstance(body, dict):
        return google_error(400, "Invalid JSON payload received.")
    problem = _invalid(set(body), _TOP_FIELDS, "") or _invalid(set(body.get("generationConfig") or {}),
                                                               _CONFIG_FIELDS, "generation_config")
    if problem:
        return problem
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        return google_error(400, "* GenerateContentRequest.contents: contents is not specified")
    for i, content in enumerate(contents):
        if content.get("role") not in ("user", "model"):
            return google_error(400, f"Please use a valid role: user, model. (contents[{i}])")
        for part in content.get("parts") or []:
            if (problem := _invalid(set(part), _PART_FIELDS, f"contents[{i}].parts[0]")) is not None:
                return problem
            response = part.get("functionResponse")
            if response is not None and not response.get("name"):
                return google_error(400, "* GenerateContentRequest.contents[].parts[].function_response.name: "
                                          "Name cannot be empty.")
    return None


def _prompt_text(body: dict[str, Any]) -> str:
    texts = [p.get("text", "") for c in body["contents"] for p in c.get("parts") or [] if "text" in p]
    system = body.get("systemInstruction") or {}
    texts += [p.get("text", "") for p in system.get("parts") or []]
    return " ".join(texts)


def _answer_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    last = body["contents"][-1]
    parts = last.get("parts") or []
    responses = [p["functionResponse"] for p in parts if "functionResponse" in p]
    if responses:
        return [{"text": "Tool said: " + orjson.dumps(responses[0]["response"]).decode()}]
    declarations = [d for t in body.get("tools") or [] for d in t.get("functionDeclarations") or []]
    last_text = next((p["text"] for p in reversed(parts) if "text" in p), "")
    if declarations and last.get("role") == "user":
        return [{"functionCall": {"name": declarations[0]["name"], "args": {"query": last_text, "n": [1, 2]}}}]
    return [{"text": f"This is a mock answer to: {last_text}"}]


def _usage(prompt: int, candidates: int) -> dict[str, Any]:
    return {"promptTokenCount": prompt, "candidatesTokenCount": candidates, "totalTokenCount": prompt + candidates,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}]}


def _authorized(request: web.Request, fake: GeminiFake) -> bool:
    return (request.headers.get("x-goog-api-key") or request.query.get("key")) == fake.api_key


async def _models_route(request: web.Request) -> web.StreamResponse:
    fake: GeminiFake = request.app[_FAKE_KEY]
    body = await fake.state.record(request)
    if not _authorized(request, fake):
        return google_error(400, "API key not valid. Please pass a valid API key.", [
            {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID",
             "domain": "googleapis.com"}])
    return await answer_model_call(request, fake.state, fake.models, body)


async def answer_model_call(
    request: web.Request, state: VendorState, models: tuple[str, ...], body: Any
) -> web.StreamResponse:
    """Answer ``.../models/{model}:{method}`` (authorised already): the Gemini API's and
    Vertex AI's ``publishers/google`` models share this wire."""
    model, _, method = request.match_info["target"].partition(":")
    if model not in models:
        return google_error(404, f"models/{model} is not found for API version v1beta, or is not supported for "
                                  f"{method}.")
    step = state.next_step()
    if "status" in step:
        details = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": step["retry_delay"]}] \
            if "retry_delay" in step else None
        return google_error(int(step["status"]), "scripted failure", details)
    if method == "batchEmbedContents":
        return json_response({"embeddings": [{"values": _vector(r["content"]["parts"][0]["text"])}
                                             for r in body["requests"]]})
    if method == "embedContent":
        return json_response({"embedding": {"values": _vector(body["content"]["parts"][0]["text"])}})
    if method not in ("generateContent", "streamGenerateContent"):
        return google_error(404, f"method {method} not found")
    if (problem := _validate(body)) is not None:
        return problem
    prompt_tokens = count_tokens(_prompt_text(body))
    response_id = f"gem-{len(state.calls)}"
    if "BLOCKME" in _prompt_text(body):
        blocked = {"promptFeedback": {"blockReason": "SAFETY", "safetyRatings": [
            {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH", "blocked": True}]},
            "usageMetadata": _usage(prompt_tokens, 0), "modelVersion": model, "responseId": response_id}
        return await _sse(request, [blocked]) if method == "streamGenerateContent" else json_response(blocked)
    parts = _answer_parts(body)
    out_tokens = sum(count_tokens(p["text"]) if "text" in p else 8 for p in parts)
    if method == "generateContent":
        return json_response({"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP",
                                              "index": 0}],
                              "usageMetadata": _usage(prompt_tokens, out_tokens), "modelVersion": model,
                              "responseId": response_id})
    if request.query.get("alt") != "sse":
        return google_error(400, "this fake streams only with alt=sse")
    chunks: list[dict[str, Any]] = []
    pieces = parts[0]["text"].split(" ") if "text" in parts[0] else None
    if pieces is not None:
        for i, word in enumerate(pieces):
            chunks.append({"candidates": [{"content": {"role": "model", "parts": [
                {"text": word if i == 0 else f" {word}"}]}, "index": 0}]})
    else:
        chunks.append({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}]})
    chunks[-1]["candidates"][0]["finishReason"] = "STOP"
    for i, chunk in enumerate(chunks):
        done = max(1, out_tokens * (i + 1) // len(chunks))
        chunk.update({"usageMetadata": _usage(prompt_tokens, done), "modelVersion": model,
                      "responseId": response_id})
    return await _sse(request, chunks)


async def _sse(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(b"data: " + orjson.dumps(chunk) + b"\r\n\r\n")
    await response.write_eof()
    return response


def _vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(b / 255, 4) for b in digest[:8]]


_FAKE_KEY = web.AppKey("gemini_fake", GeminiFake)


def make_app(fake: GeminiFake) -> web.Application:
    """The fake Gemini API serving ``fake``'s rules."""
    app = web.Application()
    app[_FAKE_KEY] = fake
    app[STATE_KEY] = fake.state
    app.router.add_post("/v1beta/models/{target}", _models_route)
    return app
