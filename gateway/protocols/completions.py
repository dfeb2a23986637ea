"""OpenAI's legacy completions (``/v1/completions``) ↔ the internal chat shape.

Requests: ``prompt`` (a string, or a list of one string) becomes one user message;
``max_tokens`` (legacy default 16, as OpenAI's), ``temperature``, ``top_p``, ``n``,
``stop``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``,
``user``, ``stream`` and ``stream_options`` are kept. What a chat model cannot do —
several prompts in one call, ``echo``, ``suffix``, ``logprobs``, ``best_of`` other than
1 — is a 400 ``invalid_request_error``.

Answers: a ``chat.completion`` becomes a ``text_completion`` (each choice's message
content as ``text``, its finish reason and the usage kept); each stream chunk becomes a
``text_completion`` chunk with the delta's text, event by event; the usage-only chunk and
``[DONE]`` are the chat stream's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.core.errors import InvalidRequest

__all__ = ["DEFAULT_MAX_TOKENS", "from_completions_request", "to_text_completion", "to_text_completion_chunk"]

#: OpenAI's own default for the legacy endpoint (chat has none).
DEFAULT_MAX_TOKENS = 16

_KEPT = ("temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed",
         "user", "stream", "stream_options")


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise InvalidRequest("'prompt': one prompt per request (send several requests)", code="invalid_prompt")
    raise InvalidRequest("'prompt' must be a string or a list of one string (token arrays are not supported)",
                         code="invalid_prompt")


def from_completions_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body for a legacy completions body; InvalidRequest where not expressible."""
    if body.get("echo") is True:
        raise InvalidRequest("'echo' is not supported", code="unsupported_parameter")
    for name in ("suffix", "logprobs"):
        if body.get(name) is not None:
            raise InvalidRequest(f"'{name}' is not supported", code="unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest("'best_of' other than 1 is not supported", code="unsupported_parameter")
    max_tokens = body.get("max_tokens")
    out: dict[str, Any] = {
        "model": body["model"],
        "messages": [{"role": "user", "content": _prompt(body.get("prompt"))}],
        "max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
    }
    for name in _KEPT:
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def _choice_text(choice: Mapping[str, Any], key: str) -> str:
    part = choice.get(key)
    text = part.get("content") if isinstance(part, dict) else None
    return text if isinstance(text, str) else ""


def to_text_completion(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The ``text_completion`` for a whole ``chat.completion``."""
    listed = answer.get("choices")
    choices: list[Any] = listed if isinstance(listed, list) else []
    out: dict[str, Any] = {
        "id": answer.get("id"),
        "object": "text_completion",
        "created": answer.get("created"),
        "model": answer.get("model"),
        "choices": [
            {"text": _choice_text(c, "message"), "index": c.get("index", i), "logprobs": None,
             "finish_reason": c.get("finish_reason")}
            for i, c in enumerate(choices) if isinstance(c, dict)
        ],
    }
    if answer.get("usage") is not None:
        out["usage"] = answer["usage"]
    return out


def to_text_completion_chunk(data: bytes) -> bytes | None:
    """The ``data:`` event of a text completion stream for one chat chunk payload; None
    for a chunk with nothing to say (a role-only first chunk)."""
    chunk = orjson.loads(data)
    if not isinstance(chunk, dict):
        return None
    listed = chunk.get("choices")
    choices: list[Any] = listed if isinstance(listed, list) else []
    out_choices = []
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        text, reason = _choice_text(choice, "delta"), choice.get("finish_reason")
        if text or reason is not None:
            out_choices.append({"text": text, "index": choice.get("index", i), "logprobs": None,
                                "finish_reason": reason})
    if choices and not out_choices:
        return None
    out: dict[str, Any] = {"id": chunk.get("id"), "object": "text_completion", "created": chunk.get("created"),
                           "model": chunk.get("model"), "choices": out_choices}
    if chunk.get("usage") is not None:  # the usage chunk (shown only to clients who asked)
        out["usage"] = chunk["usage"]
    return b"data: " + orjson.dumps(out) + b"\n\n"
