"""A provider's API key, and rotating it without a restart.

A key set inline (``api_key: sk-...`` or ``${NAME}`` from the environment) is fixed for
the life of the process. A key read from a file (``api_key_file:``, or ``${NAME}`` with
``NAME_FILE`` set, as Docker and Kubernetes secrets are mounted) is re-read when the
file changes: its modification time, size or inode is checked at most once a second, on
the request path (one ``stat``, a few microseconds), and the new content is used from
the next request on. So an operator rotates a provider key by replacing the file's
content (best atomically: write a new file, rename it over the old one).

A file that disappears, cannot be read or is empty keeps the last good key in use and
logs one warning per change (never the key itself).

Cloud credentials whose refresh is blocking I/O (Google's token endpoint or metadata
server, AWS's credential chain) are held by :class:`RefreshedInThread`: refreshed in a
worker thread, one refresh at a time, only when the holder says the value is stale.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["CHECK_EVERY_SECONDS", "Credential", "RefreshedInThread"]

_T = TypeVar("_T")

log = logging.getLogger("gateway.providers")

#: How often, at most, a key file is looked at again.
CHECK_EVERY_SECONDS = 1.0


class Credential:
    """The current value of one provider key; re-read from its file when that changes."""

    __slots__ = ("_check_every", "_clock", "_next_check", "_path", "_provider", "_stamp", "_value")

    def __init__(
        self,
        value: str | None,
        path: Path | None = None,
        *,
        provider: str = "",
        check_every: float = CHECK_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._value = value
        self._path = path
        self._provider = provider
        self._check_every = check_every
        self._clock = clock
        self._stamp = self._stat() if path is not None else None
        self._next_check = clock() + check_every

    @property
    def rotatable(self) -> bool:
        """True when the key comes from a file and may change while running."""
        return self._path is not None

    def current(self) -> str | None:
        """The key to send now (re-read first if its file changed since the last look)."""
        if self._path is None:
            return self._value
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self._check_every
            self._refresh()
        return self._value

    def _stat(self) -> tuple[int, int, int] | None:
        assert self._path is not None
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        assert self._path is not None
        try:
            fresh = self._path.read_text().strip()
        except OSError as exc:
            log.warning("provider %s: key file %s unreadable (%s); keeping the current key",
                        self._provider, self._path, exc.strerror)
            return
        if not fresh:
            log.warning("provider %s: key file %s is empty; keeping the current key", self._provider, self._path)
            return
        if fresh != self._value:
            self._value = fresh
            log.info("provider %s: key re-read from %s", self._provider, self._path)


class RefreshedInThread(Generic[_T]):
    """A credential refreshed by blocking I/O: in a worker thread, one refresh at a time.

    ``refresh(previous)`` (run in the thread; ``previous`` is None the first time) returns
    the fresh value; ``stale(value)`` says, on the event loop and cheaply, whether the value
    in hand must be refreshed before use. Callers that find it stale together share one
    refresh; an exception from ``refresh`` reaches each of them and keeps the old value.
    """

    __slots__ = ("_lock", "_refresh", "_stale", "_value")

    def __init__(self, refresh: Callable[[_T | None], _T], stale: Callable[[_T | None], bool]) -> None:
        self._refresh = refresh
        self._stale = stale
        self._value: _T | None = None
        self._lock = asyncio.Lock()

    async def current(self) -> _T:
        """The value, refreshed first when stale."""
        value = self._value
        if value is not None and not self._stale(value):
            return value
        async with self._lock:
            if self._value is None or self._stale(self._value):
                self._value = await asyncio.to_thread(self._refresh, self._value)
            return self._value
