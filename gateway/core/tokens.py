"""Token counts the gateway estimates when a provider reports none.

One rule, used wherever an estimate stands in for a provider's own count: the relay's
usage of a stream cut before its usage chunk, and the offline ``mock`` provider's
figures. A token is a whitespace-separated word, and each message costs 3 more, the
per-message overhead OpenAI's chat format adds. Real tokenizers give 1.3 to 4 tokens
per English word, so an estimate is a floor, not a bill; a provider's own usage always
wins where it sends one.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import threading
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, Final

__all__ = ["anthropic_input_tokens", "count_tokens", "estimate_text_tokens", "prompt_tokens", "tokenizer_name"]

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



# -- a real tokenizer, for estimates a client reads (``/v1/messages/count_tokens``) -------
#: The WordPiece vocabulary shipped for the semantic cache (bert-base-uncased's 30,522
#: pieces, the MiniLM embedder's), used when the ``semantic`` extra is installed.
_TOKENIZER_FILE: Final[str] = "data/minilm-tokenizer.json.gz"
_tokenizer: Any = None
_tokenizer_lock = threading.Lock()


@functools.cache
def _has_tokenizers() -> bool:
    """``tokenizers`` (of the ``semantic`` extra) is installed: the WordPiece estimate is on."""
    return importlib.util.find_spec("tokenizers") is not None


def _wordpiece() -> Any:
    """The shipped WordPiece tokenizer (loaded once, ~0.1 s), or None without ``tokenizers``."""
    global _tokenizer
    if _tokenizer is None and _has_tokenizers():
        with _tokenizer_lock:
            if _tokenizer is None:
                from tokenizers import Tokenizer

                raw = resources.files("gateway").joinpath(_TOKENIZER_FILE).read_bytes()
                tokenizer = Tokenizer.from_str(gzip.decompress(raw).decode("utf-8"))
                tokenizer.no_padding()  # the file pads and truncates for the embedder: counts must not
                tokenizer.no_truncation()
                _tokenizer = tokenizer
    return _tokenizer


def tokenizer_name() -> str:
    """Which estimate :func:`estimate_text_tokens` gives: ``wordpiece`` or ``chars/4``."""
    return "wordpiece" if _has_tokenizers() else "chars/4"


def estimate_text_tokens(text: str) -> int:
    """Tokens of ``text`` by the shipped WordPiece tokenizer, or ~4 characters a token
    without it. Blocking (CPU): call it off the event loop for long texts."""
    if not text:
        return 0
    tokenizer = _wordpiece()
    if tokenizer is None:
        return (len(text) + 3) // 4
    return len(tokenizer.encode(text, add_special_tokens=False).ids)
