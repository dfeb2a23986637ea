"""A bounded cache of key prefixes known not to work, each remembered for a while.

The auth actor gives every entry the same time to live, so insertion order is expiry
order: an ordered dict whose oldest entries are dropped from the front on each insert
keeps both the expiry and the size bound O(1) per insert (amortised), with no scan of
the whole cache. A flood of made-up keys therefore costs bounded memory
(``max_entries``) and constant time per miss. ``get`` checks each entry's own expiry,
so an entry never outlives its time even where times to live differ.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["NegativeCache"]


class NegativeCache:
    """prefix → the reason it was refused, until its expiry; at most ``max_entries``."""

    def __init__(self, max_entries: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError("NegativeCache needs max_entries >= 1")
        self.max_entries = max_entries
        self._clock = clock
        #: prefix → (expiry on ``clock``, reason), oldest insert first.
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prefix: object) -> bool:
        return isinstance(prefix, str) and self.get(prefix) is not None

    def get(self, prefix: str) -> str | None:
        """Why ``prefix`` was refused, while that is still remembered."""
        entry = self._entries.get(prefix)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[prefix]
            return None
        return entry[1]

    def add(self, prefix: str, reason: str, ttl: float) -> None:
        """Remember ``prefix`` as refused for ``ttl`` seconds; drop what expired or overflows."""
        now = self._clock()
        entries = self._entries
        entries.pop(prefix, None)  # a re-insert moves to the end with its new expiry
        entries[prefix] = (now + ttl, reason)
        while len(entries) > self.max_entries or next(iter(entries.values()))[0] <= now:
            entries.popitem(last=False)
            if not entries:
                break

    def discard(self, prefix: str) -> None:
        self._entries.pop(prefix, None)

    def clear(self) -> None:
        self._entries.clear()
