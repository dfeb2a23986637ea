"""Token usage recognised in an answer of any wire the gateway knows, for pass-through.

A pass-through answer is relayed unchanged, so its usage is read on the side: from the
whole JSON body, or from each SSE event of a stream. The shapes recognised:

* OpenAI (chat, embeddings, Responses): ``usage.prompt_tokens`` / ``completion_tokens``
  or ``usage.input_tokens`` / ``output_tokens`` (also nested as ``response.usage``);
* Anthropic Messages: ``usage.input_tokens`` / ``output_tokens`` (plus cache reads and
  writes), in a message or in a stream's ``message_start.message`` / ``message_delta``;
* Gemini: ``usageMetadata.promptTokenCount`` / ``candidatesTokenCount``
  (+ ``thoughtsTokenCount``);
* Bedrock: Converse's ``usage.inputTokens`` / ``outputTokens`` (whole, or a
  ConverseStream ``metadata`` event), InvokeModel streams'
  ``amazon-bedrock-invocationMetrics.inputTokenCount`` / ``outputTokenCount``, Titan
  embeddings' ``inputTextTokenCount``, and InvokeModel's
  ``X-Amzn-Bedrock-Input-Token-Count`` / ``-Output-Token-Count`` answer headers.

Across a stream each count keeps its largest value: Anthropic sends input tokens first
and output tokens last, Gemini and OpenAI send running or final totals, so the largest
seen is the call's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from multidict import CIMultiDictProxy

__all__ = ["UsageSniffer", "recognised_usage"]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _from_usage(usage: Mapping[str, Any]) -> tuple[int, int] | None:
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
    if "input_tokens" in usage or "output_tokens" in usage:
        prompt = (_int(usage.get("input_tokens")) + _int(usage.get("cache_read_input_tokens"))
                  + _int(usage.get("cache_creation_input_tokens")))
        return prompt, _int(usage.get("output_tokens"))
    if "inputTokens" in usage or "outputTokens" in usage:  # Bedrock Converse
        prompt = (_int(usage.get("inputTokens")) + _int(usage.get("cacheReadInputTokens"))
                  + _int(usage.get("cacheWriteInputTokens")))
        return prompt, _int(usage.get("outputTokens"))
    return None


def recognised_usage(obj: Any) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` of one answer or event, or None if it has none."""
    if not isinstance(obj, dict):
        return None
    metadata = obj.get("usageMetadata")
    if isinstance(metadata, dict):
        return (_int(metadata.get("promptTokenCount")),
                _int(metadata.get("candidatesTokenCount")) + _int(metadata.get("thoughtsTokenCount")))
    metrics = obj.get("amazon-bedrock-invocationMetrics")
    if isinstance(metrics, dict):
        return _int(metrics.get("inputTokenCount")), _int(metrics.get("outputTokenCount"))
    if "inputTextTokenCount" in obj:  # Amazon Titan embeddings
        return _int(obj.get("inputTextTokenCount")), 0
    for holder in (obj, obj.get("message"), obj.get("response")):
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if isinstance(usage, dict) and (found := _from_usage(usage)) is not None:
            return found
    return None


class UsageSniffer:
    """Accumulates the usage seen in one answer's JSON payloads (whole or per event)."""

    __slots__ = ("completion_tokens", "prompt_tokens", "recognised")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.recognised = False

    def feed_json(self, payload: bytes) -> None:
        """Look at one JSON payload; anything that is not JSON is ignored."""
        if b"sage" not in payload and b"TokenCount" not in payload:  # skip parsing most stream events
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        found = recognised_usage(obj)
        if found is not None:
            self._saw(found)

    def feed_headers(self, headers: Mapping[str, str] | CIMultiDictProxy[str]) -> None:
        """Look at the answer's headers (Bedrock's InvokeModel puts its token counts there)."""
        prompt = headers.get("X-Amzn-Bedrock-Input-Token-Count", "")
        completion = headers.get("X-Amzn-Bedrock-Output-Token-Count", "")
        if prompt.isdigit() or completion.isdigit():
            self._saw((int(prompt) if prompt.isdigit() else 0, int(completion) if completion.isdigit() else 0))

    def _saw(self, found: tuple[int, int]) -> None:
        self.recognised = True
        self.prompt_tokens = max(self.prompt_tokens, found[0])
        self.completion_tokens = max(self.completion_tokens, found[1])
