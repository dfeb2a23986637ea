"""Redis clients for the gateway: redis-py's asyncio client, its commands packed by hiredis.

redis-py's asyncio connection packs every command into the wire protocol in Python
(``Connection.pack_command``: each argument encoded, its length formatted, the pieces
joined), about 370 bytecode instructions for one of the limiter's ``EVALSHA``s and 5,500
of a request's 32,500 with its rate limits in Redis (``python -m bench.opcodes``). Its
synchronous client packs with ``hiredis.pack_command`` when hiredis is installed; these
clients do the same on asyncio. The bytes are the same (``tests/test_redis_packing.py``
checks them against redis-py's own packer); a command with an argument hiredis does not
take as redis-py does (a ``memoryview``, a ``bytearray``, anything redis-py's encoder
would refuse) is packed by redis-py, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hiredis
import redis.asyncio as aioredis

__all__ = ["connection_pool", "packed_by_hiredis", "redis_client"]

#: Argument types hiredis packs exactly as redis-py's encoder does (bool, a subclass of
#: int that redis-py refuses, is not among them: ``type`` is checked, not ``isinstance``).
_PLAIN = frozenset({str, bytes, int, float})


def _split_name(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A command name of several words (``"SCRIPT LOAD"``) goes out as separate words,
    split as redis-py's packer splits it (a text name at any whitespace, a bytes one when
    it holds a space)."""
    first = args[0]
    if isinstance(first, str):
        # One word of letters (most names) has nothing to split: no new tuple for it.
        return args if first.isalpha() else (*first.encode().split(), *args[1:])
    if isinstance(first, bytes) and b" " in first:
        return (*first.split(), *args[1:])
    return args


class _PackedByHiredis:
    """Mixed in before a redis-py asyncio connection class (:func:`packed_by_hiredis`)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if not _PLAIN.issuperset(map(type, args)):
            return super().pack_command(*args)  # type: ignore[misc, no-any-return]
        return [hiredis.pack_command(_split_name(args))]

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        listed = [tuple(command) for command in commands]
        if not all(_PLAIN.issuperset(map(type, command)) for command in listed):
            return super().pack_commands(listed)  # type: ignore[misc, no-any-return]
        return [b"".join([hiredis.pack_command(_split_name(command)) for command in listed])]


_PACKED: dict[type, type] = {}


def packed_by_hiredis(connection_class: type) -> type:
    """``connection_class`` (TCP, TLS or Unix socket: whatever the URL chose) packing its
    commands with hiredis."""
    packed = _PACKED.get(connection_class)
    if packed is None:
        packed = _PACKED[connection_class] = type(connection_class.__name__, (_PackedByHiredis, connection_class), {})
    return packed


def connection_pool(url: str, *, blocking: bool = False, **options: Any) -> aioredis.ConnectionPool:
    """``ConnectionPool.from_url`` (``BlockingConnectionPool`` with ``blocking``) whose
    connections pack with hiredis."""
    pool_class = aioredis.BlockingConnectionPool if blocking else aioredis.ConnectionPool
    pool = pool_class.from_url(url, **options)
    pool.connection_class = packed_by_hiredis(pool.connection_class)
    return pool


def redis_client(url: str, **options: Any) -> aioredis.Redis:
    """``Redis.from_url(url, **options)``: the client owns its pool and closes it with it."""
    return aioredis.Redis.from_pool(connection_pool(url, **options))
