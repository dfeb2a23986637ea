"""Token counts the gateway estimates when a provider reports none.

One rule, used wherever an estimate stands in for a provider's own count: the relay's
usage of a stream cut before its usage chunk, and the offline ``mock`` provider's
figures. A token is a whitespace-separated word, and each message costs 3 more, the
per-message overhead OpenAI's chat format adds. Real tokenizers give 1.3 to 4 tokens
per English word, so an estimate is a floor, not a bill; a provider's own usage always
wins where it sends one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["anthropic_input_tokens", "count_tokens", "prompt_tokens"]

#: OpenAI's chat format adds about three tokens per message (role and separators).
PER_MESSAGE_TOKENS: Final[int] = 3


def count_tokens(text: str) -> int:
    """Return the deterministic token count of ``text``: its words, at least 1."""
    return max(1, len(text.split()))


def _content_tokens(content: Any) -> int:
    """Count the tokens of a string content, or of each text part of a list content."""
    if isinstance(content, str):
        return count_tokens(content)
    if isinstance(content, list):
        return sum(
            count_tokens(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def prompt_tokens(messages: Sequence[Any]) -> int:
    """Count prompt tokens: every string content / text part, plus 3 per message."""
    total = 0
    for message in messages:
        total += PER_MESSAGE_TOKENS
        if isinstance(message, dict):
            total += _content_tokens(message.get("content"))
    return total


def _messages(body: Mapping[str, Any]) -> list[Any]:
    """Return the body's ``messages`` list, or an empty list when it is not one."""
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


def anthropic_input_tokens(body: Mapping[str, Any]) -> int:
    """Count the input tokens of an Anthropic Messages body (``system`` + messages)."""
    return prompt_tokens(_messages(body)) + _content_tokens(body.get("system"))

