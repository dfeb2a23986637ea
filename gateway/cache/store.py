"""Stored answers: the entry, its wire form for Redis, and the byte-bounded LRU.

An entry is an answer exactly as the provider sent it: the whole JSON body, or the raw
SSE events of a complete stream (usage chunk included, since the gateway always asks
for it; each replay shows it or not as the replaying client asked). It carries who may
read it (``scope``), who stored it (``subject``, for purges) and when it expires.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import orjson

__all__ = ["ByteLRU", "CacheEntry", "decode_entry", "encode_entry"]

#: What an entry costs beyond its body (dataclass, key strings, dict slot), roughly.
ENTRY_OVERHEAD = 512
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One stored answer and what it may be served to."""

    key: str  # the exact key (hex)
    scope: str  # "key:<id>" | "subject:<id>" | "global": who may read it
    subject: str  # the subject whose request stored it (purge by subject)
    group: str  # the routed model group
    stream: bool
    body: bytes  # the whole answer, or the stream's raw events
    content_type: str
    created_at: float  # unix seconds
    expires_at: float  # unix seconds
    response_id: str | None = None
    model: str | None = None
    finish_reasons: tuple[str, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def size(self) -> int:
        return len(self.body) + ENTRY_OVERHEAD

    def fresh(self, now: float) -> bool:
        return now < self.expires_at

    def events(self) -> list[bytes]:
        """A stream entry's events, each ending with its blank line."""
        return [part + b"\n\n" for part in self.body.split(b"\n\n") if part.strip()]


def encode_entry(entry: CacheEntry) -> bytes:
    """One line of JSON metadata, a newline, then the body (no base64, no copy of it in JSON)."""
    meta = {
        "v": _FORMAT, "key": entry.key, "scope": entry.scope, "subject": entry.subject,
        "group": entry.group, "stream": entry.stream, "ct": entry.content_type,
        "created": entry.created_at, "expires": entry.expires_at, "id": entry.response_id,
        "model": entry.model, "finish": list(entry.finish_reasons),
        "pt": entry.prompt_tokens, "ct_tokens": entry.completion_tokens,
    }
    return orjson.dumps(meta) + b"\n" + entry.body


def decode_entry(raw: bytes) -> CacheEntry | None:
    """The entry, or None for anything this version cannot read (treated as a miss)."""
    head, sep, body = raw.partition(b"\n")
    if not sep:
        return None
    try:
        meta = orjson.loads(head)
        if meta.get("v") != _FORMAT:
            return None
        return CacheEntry(
            key=meta["key"], scope=meta["scope"], subject=meta["subject"], group=meta["group"],
            stream=bool(meta["stream"]), body=body, content_type=meta["ct"],
            created_at=float(meta["created"]), expires_at=float(meta["expires"]),
            response_id=meta.get("id"), model=meta.get("model"),
            finish_reasons=tuple(meta.get("finish") or ()),
            prompt_tokens=int(meta.get("pt") or 0), completion_tokens=int(meta.get("ct_tokens") or 0),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class ByteLRU:
    """Entries by key, least recently used first out, bounded by the bytes they hold.

    Owned by the cache actor; :attr:`view` is a read-only mapping handlers read directly.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self.view: Mapping[str, CacheEntry] = MappingProxyType(self._entries)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: CacheEntry) -> list[str]:
        """Insert (or replace) ``entry``; returns the keys evicted to stay in bounds."""
        if entry.size > self.max_bytes:
            return [entry.key] if self.pop(entry.key) else []
        self.pop(entry.key)
        self._entries[entry.key] = entry
        self.bytes += entry.size
        evicted: list[str] = []
        while self.bytes > self.max_bytes:
            key, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            evicted.append(key)
        return evicted

    def touch(self, key: str) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def pop(self, key: str) -> CacheEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def expire(self, now: float | None = None) -> list[str]:
        when = time.time() if now is None else now
        gone = [k for k, e in self._entries.items() if not e.fresh(when)]
        for key in gone:
            self.pop(key)
        return gone

    def select(self, *, subject: str | None = None, group: str | None = None) -> list[str]:
        """Keys of entries stored by ``subject`` and/or in ``group``."""
        return [
            k for k, e in self._entries.items()
            if (subject is None or e.subject == subject) and (group is None or e.group == group)
        ]

    def clear(self) -> list[str]:
        keys = list(self._entries)
        self._entries.clear()
        self.bytes = 0
        return keys
