"""What one chat call used: tokens from the provider's answer, and the call's record.

Non-streaming answers carry ``usage``; streams carry it in a final chunk (the gateway
asks for it) or, when cut short, it is estimated from the chunks that were delivered.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import orjson

from gateway.core.config import Price

__all__ = ["CallRecord", "StreamTap", "Usage", "new_call_id", "usage_from_answer"]


#: The bits ``uuid.UUID(version=4)`` clears and sets: the variant (10, RFC 4122) and the version (4).
_V4_CLEAR = ~((0xC000 << 48) | (0xF000 << 64)) & (2**128 - 1)
_V4_SET = (0x8000 << 48) | (4 << 76)
_new_object = object.__new__
_set_slot = object.__setattr__
#: Looked up once: an enum member read through its class costs ~0.15 µs.
_SAFETY_UNKNOWN = uuid.SafeUUID.unknown


def new_call_id() -> uuid.UUID:
    """A version-4 UUID from ``random``: no system call, unlike ``uuid4()`` (``os.urandom``).

    The ledger's idempotency key must be unique, not secret: 122 random bits from the
    process's Mersenne Twister, which CPython seeds from ``os.urandom`` at start and
    reseeds in every forked child (``serve --workers`` starts fresh processes anyway),
    so no two processes share a sequence. Nothing in the gateway seeds ``random``.

    Built as ``uuid.UUID(int=bits, version=4)`` builds it, minus its argument checks
    (0.8 µs, every call): the same two slots set the same way (Python 3.14's
    ``UUID._from_int`` does exactly this), the same bits masked in.
    """
    call_id = _new_object(uuid.UUID)
    _set_slot(call_id, "int", (random.getrandbits(128) & _V4_CLEAR) | _V4_SET)
    _set_slot(call_id, "is_safe", _SAFETY_UNKNOWN)
    return call_id


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: Provider-reported cost (Venice ``cost.usd`` / ``cost.diem``), if any.
    cost_usd: float | None = None
    cost_diem: float | None = None
    #: True when counted from delivered chunks because the provider reported none.
    estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def absorb(self, obj: dict[str, Any]) -> bool:
        """Take ``usage`` (and ``cost``) from an answer or chunk; True if found."""
        usage = obj.get("usage")
        found = False
        if isinstance(usage, dict):
            # ``input_tokens``/``output_tokens``: the same counts under newer names.
            self.prompt_tokens = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
            self.completion_tokens = _count(usage.get("completion_tokens", usage.get("output_tokens")))
            self.estimated = False
            found = True
        cost = obj.get("cost")
        if isinstance(cost, dict):
            if isinstance(cost.get("usd"), int | float):
                self.cost_usd = float(cost["usd"])
            if isinstance(cost.get("diem"), int | float):
                self.cost_diem = float(cost["diem"])
        return found


def _count(value: Any) -> int:
    """A token count as reported; anything that is not a non-negative number is 0."""
    if value.__class__ is int:  # what providers send: no isinstance of a union (0.15 µs)
        return value if value >= 0 else 0
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return 0
    return int(value)


def usage_from_answer(
    body: bytes, parsed: dict[str, Any] | None = None
) -> tuple[Usage, dict[str, Any] | None]:
    """Usage of a whole (non-streaming) answer, and the parsed answer if it is JSON.

    ``parsed`` is the answer as the provider already parsed it (``UpstreamReply.answer``):
    then ``body`` is not parsed a second time.

    An answer with a ``usage`` object and no ``cost`` (every OpenAI-style answer) has its
    Usage made with its counts at once, as :meth:`Usage.absorb` would count them: ~35
    bytecode instructions fewer than an empty Usage, then absorb and its two :func:`_count`
    calls (a count that is a non-negative int is itself, as there).
    """
    if parsed is None:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return Usage(), None
        if not isinstance(parsed, dict):
            return Usage(), None
    reported = parsed.get("usage")
    if reported.__class__ is dict and parsed.get("cost") is None:
        prompt = reported.get("prompt_tokens", reported.get("input_tokens"))
        completion = reported.get("completion_tokens", reported.get("output_tokens"))
        return Usage(
            prompt if prompt.__class__ is int and prompt >= 0 else _count(prompt),
            completion if completion.__class__ is int and completion >= 0 else _count(completion),
        ), parsed
    usage = Usage()
    usage.absorb(parsed)
    return usage, parsed


#: A string of a content chunk as its template frames it: no quote, backslash or control
#: character (JSON would have them escaped), so these bytes are the string itself, valid
#: in JSON wherever another such string was (UTF-8 is checked by decoding).
_PLAIN_STRING = re.compile(rb'[^"\\\x00-\x1f]*')
_CONTENT_KEY = b'"content"'
_CONTENT_OPENS = b'"content":"'
#: OpenAI's ``obfuscation``: random characters of a random length in every chunk (after
#: the choices), read by nobody; a template leaves its string free, as it does the text.
_PAD_KEY = b'"obfuscation"'
_PAD_OPENS = b'"obfuscation":"'
#: Templates taken again (the previous one did not fit a chunk of the template's shape)
#: before a stream's tap gives up on them: each costs a few finds; the parse is the same.
_MAX_TEMPLATE_MISSES = 3


class StreamTap:
    """Watches a relayed stream's chunks: ids, finish reasons, usage, delivered text.

    The relay hands it each event (:meth:`inspect_event`), then, for an event that was
    not a content chunk of the template's shape, its ``data:`` payload (:meth:`inspect`),
    which says whether to forward it: a usage-only chunk the client did not ask for is
    swallowed.

    A provider sends its content chunks byte for byte alike but for the text (same id,
    model, created, one choice, no finish reason, ``"usage":null``; OpenAI's random
    ``obfuscation`` string aside). A chunk parsed whole that has that shape becomes the
    template: the bytes of its event (one ``data:`` line) around the text (and the
    padding). A later event made of the same bytes around strings that need no JSON escape
    is one line, its payload that same object with another text, so it is accounted for
    without a parse (its text counted and kept, nothing else changes); anything else is
    parsed as before. The result, malformed payloads included, is what a parse of every
    payload gives.
    """

    __slots__ = (
        "_kept_text",
        "_pad_tail",
        "_saw_usage",
        "_template_misses",
        "_text_prefix",
        "_text_rest",
        "chunks",
        "client_wants_usage",
        "done",
        "finish_reasons",
        "first_chunk_at",
        "malformed",
        "response_id",
        "response_model",
        "text_chars",
        "usage",
    )

    def __init__(self, *, client_wants_usage: bool, keep_text: bool = False) -> None:
        self.client_wants_usage = client_wants_usage
        self.usage = Usage()
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.finish_reasons: list[str] = []
        self.text_chars = 0
        self.chunks = 0
        self.done = False
        #: A data payload was neither JSON nor [DONE]: the relay ends the stream with an error.
        self.malformed = False
        self.first_chunk_at: float | None = None
        self._saw_usage = False
        #: The delivered text, kept only when content capture is on (CAPTURE_GENAI_CONTENT).
        self._kept_text: list[str] | None = [] if keep_text else None
        #: The template content chunk's event's bytes before its text (None: no template),
        #: after it (to the end, or to its padding's string), and after the padding (None:
        #: none); the event's ``data: `` and blank line included.
        self._text_prefix: bytes | None = None
        self._text_rest = b""
        self._pad_tail: bytes | None = None
        self._template_misses = 0

    def inspect_event(self, event: bytes) -> bool:
        """Account for one event if it is a content chunk of the template's shape on one
        ``data:`` line (True: it is relayed, its payload ``event[6:-2]``); else count nothing
        (False: the event is to be read whole, its payload given to :meth:`inspect`).

        Most chunks of most streams end here: the relay asks it first, so they are neither
        cut out of their event (``event_data``) nor looked at twice.
        """
        prefix = self._text_prefix
        if prefix is None or not event.startswith(prefix):
            return False
        start, rest = len(prefix), self._text_rest
        if self._pad_tail is None:
            # Its bytes from the text's start end with the rest (and are at least as long).
            if not event.endswith(rest, start):
                return False
            raw = event[start : -len(rest)]
        else:
            end = event.find(b'"', start)  # the text's closing quote: a plain text has none of its own
            if end < 0 or not event.startswith(rest, end) or not self._padded(event, end):
                return False
            raw = event[start:end]
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            return False  # not UTF-8: the parse says it is malformed
        # A plain string (what _PLAIN_STRING matches) in three C calls on the decoded text,
        # half the regex's cost: isprintable() is False for every control character (the
        # newline too: the event stays one line) and for a few other characters, parsed.
        if not text.isprintable() or '"' in text or "\\" in text:
            return False
        self.chunks += 1  # first_chunk_at is set: the template came from a chunk parsed before
        self.text_chars += len(text)
        if self._kept_text is not None:
            self._kept_text.append(text)
        return True

    def inspect(self, data: bytes) -> bool:
        """Account for one payload (parsed); returns False if it must not reach the client."""
        if data == b"[DONE]":
            self.done = True
            return True
        if self.first_chunk_at is None:
            self.first_chunk_at = time.monotonic()
        self.chunks += 1
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.malformed = True
            return False
        if not isinstance(obj, dict):
            return True
        if self.response_id is None:
            self.response_id = obj.get("id")
            self.response_model = obj.get("model")
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                    self.text_chars += len(delta["content"])
                    if self._kept_text is not None:
                        self._kept_text.append(delta["content"])
                reason = choice.get("finish_reason")
                if isinstance(reason, str):
                    self.finish_reasons.append(reason)
        if obj.get("usage") is not None or obj.get("cost") is not None:
            self._saw_usage = self.usage.absorb(obj) or self._saw_usage
            if not self.client_wants_usage and choices == []:
                return False
        elif (self.response_id is not None and isinstance(choices, list) and len(choices) == 1
              and self._template_misses <= _MAX_TEMPLATE_MISSES):
            self._learn_template(data, choices[0])
        return True

    def _padded(self, event: bytes, end: int) -> bool:
        """Whether ``event`` goes on from its text (closed at ``end``) as the template's
        padding does: the bytes to the padding's string, a plain string, the tail."""
        tail = self._pad_tail
        assert tail is not None
        after = end + len(self._text_rest)
        pad_end = event.find(b'"', after)
        if pad_end < 0 or pad_end + len(tail) != len(event) or not event.startswith(tail, pad_end) \
                or not _PLAIN_STRING.fullmatch(event, after, pad_end):
            return False
        if not event.isascii():
            try:
                event[after:pad_end].decode()
            except UnicodeDecodeError:
                return False  # not UTF-8: the parse says it is malformed
        return True

    def _learn_template(self, data: bytes, choice: Any) -> None:
        """Take ``data`` as the template of content chunks if it is one: a single choice
        with a text delta and no finish reason, no usage or cost (the caller checked), the
        text's key and the text written plainly (no escape anywhere, one ``"content"``),
        and OpenAI's padding, if any, after the text. No newline: its event is one line."""
        if not isinstance(choice, dict) or isinstance(choice.get("finish_reason"), str):
            return
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        if not isinstance(content, str) or b"\\" in data or b"\n" in data or data.count(_CONTENT_KEY) != 1:
            return
        start = data.find(_CONTENT_OPENS)
        if start < 0:
            return
        start += len(_CONTENT_OPENS)
        end = data.find(b'"', start)
        if data[start:end] != content.encode():
            return
        rest, tail = data[end:], None
        at = data.find(_PAD_OPENS, end)
        if at >= 0 and data.count(_PAD_KEY) == 1:
            # Whatever string it holds (no escape: it is the key), nothing the tap reads changes.
            pad = at + len(_PAD_OPENS)
            rest, tail = data[end:pad], data[data.find(b'"', pad) :]
        if self._text_prefix is not None:
            self._template_misses += 1  # the one before did not fit a chunk of its shape
        if tail is None:
            rest += b"\n\n"
        else:
            tail += b"\n\n"
        self._text_prefix, self._text_rest, self._pad_tail = b"data: " + data[:start], rest, tail

    def kept_text(self) -> str | None:
        """The delivered text if ``keep_text`` was asked for, else None."""
        return None if self._kept_text is None else "".join(self._kept_text)

    def final_usage(self, prompt_estimate: int) -> Usage:
        """The usage to record: reported, or estimated from what was delivered."""
        if not self._saw_usage:
            self.usage.prompt_tokens = prompt_estimate
            # ~4 characters per token, the usual rule of thumb for English text.
            self.usage.completion_tokens = (self.text_chars + 3) // 4
            self.usage.estimated = True
        return self.usage


@dataclass(slots=True)
class CallRecord:
    """Everything known about one chat call when it ends; what billing and metrics see."""

    request_id: str
    api_key_id: uuid.UUID | None
    subject_id: uuid.UUID | None
    requested_model: str
    served_model: str | None = None
    provider: str | None = None
    deployment: str | None = None
    status: int = 0
    outcome: str = "ok"  # ok | provider_error | upstream_error | cancelled | cut
    stream: bool = False
    usage: Usage = field(default_factory=Usage)
    response_id: str | None = None
    finish_reasons: tuple[str, ...] = ()
    started_at: float = field(default_factory=time.time)
    latency: float = 0.0
    ttft: float | None = None
    retries: int = 0
    failovers: int = 0
    #: The fallback model name that served (or was tried last), when the group's own failed.
    fallback_model: str | None = None
    error_type: str | None = None
    #: Monotonic time the HTTP request arrived (set by the edge; for the overhead metric).
    received_at: float | None = None
    #: Monotonic time the first upstream attempt started, and the seconds spent waiting
    #: for providers until a reply to relay was in hand (all attempts and backoff).
    upstream_started_at: float | None = None
    upstream_time: float = 0.0
    #: Stream chunks relayed.
    chunks: int = 0
    #: W3C trace context headers to send upstream (``traceparent``, ``tracestate``).
    trace_headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    #: The completion text, kept only when CAPTURE_GENAI_CONTENT=true (for span events).
    completion: str | None = None
    #: The gateway's own id for this call: the ledger's idempotency key (never reused,
    #: unlike ``request_id``, which a client may choose).
    call_id: uuid.UUID = field(default_factory=new_call_id)
    #: The price table of the deployment that served the call, if configured.
    price: Price | None = None
    #: What the call cost, settled once when it ends (:func:`gateway.billing.pricing.settle_cost`):
    #: the provider's own ``cost``, else the price table's, else 0.
    cost_usd: float = 0.0
    #: The same cost in integer micro-USD, rounded up: what budgets count (never less
    #: than the ledger's exact figure).
    cost_micro_usd: int = 0
    #: provider | price | unpriced (tokens but no way to price them) | none (no tokens)
    #: | cache (answered from the response cache).
    cost_source: str = "none"
    #: Relayed by ``/passthrough/...``: with no usage recognised, cost_source is "passthrough".
    passthrough: bool = False
    #: Response cache: "hit" (answered from the cache: no provider call, cost 0),
    #: "miss" (looked up, called the provider), "bypass" (not cacheable), None (cache off).
    cache: str | None = None
    #: Cosine similarity of a semantic hit (None for exact hits and everything else).
    cache_similarity: float | None = None
    #: The protocol the client spoke: chat (``/v1/chat/completions``) | anthropic (``/v1/messages``).
    protocol: str = "chat"
    #: What guardrail policies did: (policy, action, direction) each, never the text.
    guardrails: tuple[tuple[str, str, str], ...] = ()
    #: The call listeners (billing, metrics, logs) have seen this record: it is final. A
    #: stream finishes its record before its end marker is sent, so a client never sees a
    #: complete answer whose usage event is not yet in the journal.
    finished: bool = False
    #: The ledger row billing journaled for this call, held until its billing line is
    #: logged once the answer is out (``BillingHandle.log_line``); None before and after.
    ledger_row: dict[str, object] | None = None


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
