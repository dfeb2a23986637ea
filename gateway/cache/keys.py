"""The response cache at the HTTP edge: what a request's key is, and replaying a hit.

:mod:`actors.cache` owns the stored answers; this module holds what the chat handler
needs around them:

* :func:`request_material` / :func:`exact_key` — the exact key hashes everything that
  shapes an answer: the routed model group, the requested model (a wildcard group
  sends it upstream), the scope (who may read the answer), whether it streams, and the
  body minus the fields that do not change the answer (``stream_options``, ``user``,
  ``metadata``, ``store``). Normalised: key order, ``null`` fields, parameters at their
  OpenAI default (``n: 1``, ``temperature: 1``, ``top_p: 1``, penalties 0, …), ``1.0``
  vs ``1``, and a message whose content is one text part vs the plain string.
* :func:`is_deterministic` — temperature 0 or top_p 0, sent explicitly. An unset
  temperature means the provider's default (1 for OpenAI): sampled, so not cached
  unless the group says ``deterministic_only: false``.
* :func:`client_directives` — ``Cache-Control: no-store`` (neither read nor write)
  and ``no-cache`` (do not read; the fresh answer is stored), and the opt-in header.
* :class:`CacheTicket` — one request's cache decision, its header, and the collector of
  a stream's events; :func:`replay` — a hit as a whole answer or an SSE stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.cache.store import CacheEntry
from gateway.core.config import CachePolicy
from gateway.core.usage import CallRecord, Usage
from gateway.protocols.sse import event_data

if TYPE_CHECKING:
    from actors.cache import CacheHandle
    from gateway.cache.semantic import Guard

__all__ = [
    "CACHE_HEADER",
    "KEY_HEADER",
    "OPT_IN",
    "SIMILARITY_HEADER",
    "CacheTicket",
    "EndStream",
    "client_directives",
    "exact_key",
    "is_deterministic",
    "replay",
    "request_material",
]

#: Request: ``use`` turns caching on for a group without a policy. Response: the outcome.
CACHE_HEADER = "x-gateway-cache"
SIMILARITY_HEADER = "x-gateway-cache-similarity"
#: The entry's key, so an operator can purge exactly the answer a user reports.
KEY_HEADER = "x-gateway-cache-key"
OPT_IN = "use"
#: Bump when the key's material changes shape, so old entries are never read.
KEY_VERSION = 1

#: Body fields that never change the answer's content.
_NOT_SHAPING = frozenset({"stream", "stream_options", "user", "metadata", "store"})
#: OpenAI's defaults: sending them is the same request as not sending them.
_DEFAULTS: Mapping[str, Any] = {
    "n": 1, "temperature": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0,
    "logprobs": False, "parallel_tool_calls": True,
}
_USAGE_NULL = b',"usage":null'
#: A chat stream's end marker: a replayed hit sends it only once its record is journaled.
_DONE = b"data: [DONE]\n\n"

#: How a streamed answer is ended once the client has all but its end: the call's record
#: is finished (journaled) first, then the end bytes are sent (the edge's pipeline gives it).
EndStream = Callable[[web.StreamResponse, bytes], Awaitable[None]]


def _number(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if (
        isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict)
        and content[0].get("type") == "text" and set(content[0]) == {"type", "text"}
    ):
        out["content"] = content[0]["text"]
    return out


def normalised_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body as far as the answer is concerned (see the module docstring)."""
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in _NOT_SHAPING or name == "model" or value is None:
            continue
        value = _number(value)
        if name in _DEFAULTS and value == _DEFAULTS[name] and type(value) is type(_DEFAULTS[name]):
            continue
        out[name] = value
    out["messages"] = [_message(m) for m in body.get("messages") or ()]
    return out


def request_material(group: str, requested_model: str, scope: str, stream: bool, body: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the exact key hashes, as one JSON-able mapping."""
    return {
        "v": KEY_VERSION, "group": group, "model": requested_model, "scope": scope,
        "stream": stream, "body": normalised_body(body),
    }


def exact_key(material: Mapping[str, Any]) -> str:
    """128-bit BLAKE2b of the material's canonical JSON (sorted keys)."""
    return hashlib.blake2b(orjson.dumps(material, option=orjson.OPT_SORT_KEYS), digest_size=16).hexdigest()


def is_deterministic(body: Mapping[str, Any]) -> bool:
    """Greedy decoding asked for explicitly: temperature 0 or top_p 0."""
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
            return True
    return False


def client_directives(headers: Mapping[str, str]) -> tuple[bool, bool, bool]:
    """``(opted_in, may_read, may_write)`` from the request's headers."""
    opted_in = headers.get(CACHE_HEADER, "").strip().lower() == OPT_IN
    control = headers.get("Cache-Control")
    if not control:
        return opted_in, True, True
    tokens = {t.strip().split("=", 1)[0].lower() for t in control.split(",")}
    if "no-store" in tokens:
        return opted_in, False, False
    return opted_in, "no-cache" not in tokens, True


@dataclass(slots=True, eq=False)
class CacheTicket:
    """One request's cache decision, made after routing and before dispatch."""

    handle: CacheHandle
    key: str
    scope: str
    subject: str
    group: str
    policy: CachePolicy
    stream: bool
    read: bool
    write: bool
    material: dict[str, Any]
    #: Semantic groups only: the final user message, its partition and guard.
    semantic_text: str | None = None
    partition: str | None = None
    guard: Guard | None = None
    vector: asyncio.Future[Any] | None = None
    #: "hit" | "miss" | "bypass", shown in the response header and the CallRecord.
    status: str = "miss"
    similarity: float | None = None
    _events: list[bytes] | None = field(default=None)
    _collected: int = 0

    async def lookup(self) -> CacheEntry | None:
        """A stored answer to serve instead of calling the provider, or None."""
        return await self.handle.lookup(self)

    def headers(self) -> dict[str, str]:
        headers = {CACHE_HEADER: self.status}
        if self.status != "bypass":
            headers[KEY_HEADER] = self.key
        if self.similarity is not None:
            headers[SIMILARITY_HEADER] = f"{self.similarity:.4f}"
        return headers

    def collect(self, event: bytes) -> None:
        """Keep one raw upstream event of a stream that may be stored once complete."""
        if not self.write:
            return
        if self._events is None:
            self._events = []
        self._collected += len(event)
        if self._collected > self.handle.max_entry_bytes:
            self.write = False  # too big to store: stop holding it
            self._events = None
            return
        self._events.append(event)

    def store_answer(self, body: bytes, content_type: str, answer: Mapping[str, Any], record: CallRecord) -> None:
        """Store a successful whole answer (status 200, JSON with choices)."""
        if not self.write or not isinstance(answer.get("choices"), list) or len(body) > self.handle.max_entry_bytes:
            return
        self.handle.store(self, self._entry(body, content_type, record))

    def store_stream(self, record: CallRecord) -> None:
        """Store a stream that ended with ``[DONE]`` and no error."""
        events, self._events = self._events, None
        if not self.write or not events or record.outcome != "ok":
            return
        self.handle.store(self, self._entry(b"".join(events), "text/event-stream", record))

    def _entry(self, body: bytes, content_type: str, record: CallRecord) -> CacheEntry:
        now = time.time()
        return CacheEntry(
            key=self.key, scope=self.scope, subject=self.subject, group=self.group, stream=self.stream,
            body=body, content_type=content_type, created_at=now, expires_at=now + self.policy.ttl,
            response_id=record.response_id, model=record.served_model, finish_reasons=record.finish_reasons,
            prompt_tokens=record.usage.prompt_tokens, completion_tokens=record.usage.completion_tokens,
        )


def _client_events(entry: CacheEntry, wants_usage: bool) -> bytes:
    """The stored events as the live relay would have shown them to this client."""
    if wants_usage:
        return entry.body
    out: list[bytes] = []
    for event in entry.events():
        data = event_data(event)
        if data is not None and (b'"usage"' in data or b'"cost"' in data):
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
            # The same test as the live relay's StreamTap: a usage-only chunk is not shown.
            if isinstance(obj, dict) and obj.get("choices") == [] and (
                obj.get("usage") is not None or obj.get("cost") is not None
            ):
                continue
        out.append(event.replace(_USAGE_NULL, b"") if _USAGE_NULL in event else event)
    return b"".join(out)


async def replay(
    request: web.Request, entry: CacheEntry, ticket: CacheTicket, body: Mapping[str, Any],
    record: CallRecord, sse_headers: Mapping[str, str], end_stream: EndStream,
) -> web.StreamResponse:
    """Answer from ``entry``: the stored body, or its events as an SSE stream whose
    ``[DONE]`` goes through ``end_stream`` (after the record is journaled)."""
    record.status = 200
    record.served_model = entry.model
    record.response_id = entry.response_id
    record.finish_reasons = entry.finish_reasons
    # Tokens say what was served; the provider was not called, so nothing was spent.
    record.usage = Usage(entry.prompt_tokens, entry.completion_tokens, cost_usd=0.0)
    record.cache_similarity = ticket.similarity
    if not entry.stream:
        return web.Response(body=entry.body, headers={"Content-Type": entry.content_type, **ticket.headers()})
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    events = _client_events(entry, wants_usage)
    head, end = (events[: -len(_DONE)], _DONE) if events.endswith(_DONE) else (events, b"")
    response = web.StreamResponse(status=200, headers={**sse_headers, **ticket.headers()})
    await response.prepare(request)
    try:
        await response.write(head)
    except ConnectionError:
        record.outcome = "cancelled"
        return response  # the client left: serve's end records it
    await end_stream(response, end)
    return response
