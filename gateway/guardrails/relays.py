"""Output policies on relayed streams: each upstream event's text through the window.

A stream's events come in one of two wires (``UpstreamReply.wire``): chat chunks
(``choices[].delta.content``, the internal shape) or Anthropic's named events
(``content_block_delta`` with a ``text_delta``). Each guard rewrites the text of the
events it is handed, holding back what the window holds (:mod:`gateway.guardrails.streams`)
and releasing it with the choice's (or block's) last event, so the client's stream keeps
its shape: same events, same order, the text only delayed or redacted. A ``block``
raises :class:`~gateway.core.errors.GuardrailBlocked`, which the pipeline answers with
the protocol's one error event.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.guardrails.engine import GuardrailEngine
from gateway.guardrails.policies import Decision
from gateway.guardrails.streams import StreamScreen
from gateway.protocols.sse import event_data

__all__ = ["AnthropicStreamGuard", "ChatStreamGuard", "stream_guard"]


def _encode(prefix: bytes, obj: Any) -> bytes:
    return prefix + b"data: " + orjson.dumps(obj) + b"\n\n"


class ChatStreamGuard:
    """Chat chunks: ``choices[i].delta.content`` through the window of choice ``i``."""

    def __init__(self, engine: GuardrailEngine) -> None:
        self.screen = StreamScreen(engine.stream_rules)

    def feed(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None or data == b"[DONE]":
            return event
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event  # the relay reports it as malformed
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list) or not choices:
            return event
        changed = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0) if isinstance(choice.get("index", 0), int) else 0
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            text = delta.get("content")
            if isinstance(text, str):
                delta["content"] = self.screen.feed(index, text)
                changed = True
            if choice.get("finish_reason") is not None:
                rest = self.screen.finish(index)
                if rest:
                    delta["content"] = (delta.get("content") or "") + rest
                    changed = True
        return _encode(b"", chunk) if changed else event

    def decisions(self) -> list[Decision]:
        return self.screen.decisions()


class AnthropicStreamGuard:
    """Anthropic events: ``text_delta`` text through the window of its content block."""

    def __init__(self, engine: GuardrailEngine) -> None:
        self.screen = StreamScreen(engine.stream_rules)

    def feed(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(obj, dict):
            return event
        index = obj.get("index", 0) if isinstance(obj.get("index", 0), int) else 0
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                delta["text"] = self.screen.feed(index, delta["text"])
                return _encode(b"event: content_block_delta\n", obj)
        elif kind == "content_block_stop":
            rest = self.screen.finish(index)
            if rest:
                # The held text goes out as one more delta, just before the block ends.
                flush = {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": rest}}
                return _encode(b"event: content_block_delta\n", flush) + event
        return event

    def decisions(self) -> list[Decision]:
        return self.screen.decisions()


def stream_guard(engine: GuardrailEngine | None, wire: str) -> ChatStreamGuard | AnthropicStreamGuard | None:
    """The guard of a stream in ``wire``, or None when no output policy follows streams."""
    if engine is None or not engine.stream_rules:
        return None
    return AnthropicStreamGuard(engine) if wire == "anthropic" else ChatStreamGuard(engine)
