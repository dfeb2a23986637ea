"""Redis clients pack their commands with hiredis, byte for byte as redis-py's own packer."""

from __future__ import annotations

import random

import pytest
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from gateway.core.redis import connection_pool, packed_by_hiredis, redis_client


def _random_argument(rnd: random.Random) -> object:
    kind = rnd.randrange(6)
    if kind == 0:
        return rnd.randint(-(2**70), 2**70)
    if kind == 1:
        return rnd.choice([0.0, -0.0, 1.5, 1e-9, 123456.789, 2.0**60, float("inf"), float("-inf"), rnd.random()])
    if kind == 2:
        return "".join(rnd.choice("ab c\r\n$*ü中\x00") for _ in range(rnd.randrange(12)))
    if kind == 3:
        return bytes(rnd.randrange(256) for _ in range(rnd.randrange(12)))
    if kind == 4:
        return "x" * rnd.choice([0, 1, 6000, 7000])  # around redis-py's buffer cut-off
    return rnd.choice(["EVALSHA", "GET", "SCRIPT LOAD", b"CLIENT SETNAME", "ZADD"])


def test_hiredis_packs_every_command_as_redis_py_does() -> None:
    ours, theirs = packed_by_hiredis(Connection)(), Connection()
    rnd = random.Random(7)
    for _ in range(3000):
        name = rnd.choice(["EVALSHA", "GET", "SCRIPT LOAD", b"SCRIPT LOAD", b"GET", "CONFIG  GET", "A\tB"])
        command = (name, *(_random_argument(rnd) for _ in range(rnd.randrange(9))))
        assert b"".join(ours.pack_command(*command)) == b"".join(theirs.pack_command(*command)), command
    pipeline = [("EVALSHA", "f" * 40, 2, "k1", "k2", 60, 1), ("GET", "k"), ("SCRIPT LOAD", "return 1")]
    assert b"".join(ours.pack_commands(pipeline)) == b"".join(theirs.pack_commands(pipeline))
    assert b"".join(ours.pack_commands(iter(pipeline))) == b"".join(theirs.pack_commands(pipeline))


def test_what_hiredis_does_not_take_as_redis_py_does_is_packed_by_redis_py() -> None:
    ours, theirs = packed_by_hiredis(Connection)(), Connection()
    for command in [("SET", "k", memoryview(b"v" * 10)), ("SET", "k", bytearray(b"v")), ("SET", memoryview(b"k"), 1)]:
        assert ours.pack_command(*command) == theirs.pack_command(*command)
        assert ours.pack_commands([command, ("GET", "k")]) == theirs.pack_commands([command, ("GET", "k")])
    for refused in [("SET", "k", True), ("SET", "k", None), ("SET", "k", [1])]:
        with pytest.raises(DataError):
            theirs.pack_command(*refused)
        with pytest.raises(DataError):
            ours.pack_command(*refused)  # redis-py's refusal, not hiredis packing True as "1"


@pytest.mark.parametrize(
    ("url", "base"),
    [("redis://127.0.0.1:6379/0", Connection), ("rediss://127.0.0.1:6380/0", SSLConnection),
     ("unix:///tmp/redis.sock", UnixDomainSocketConnection)],
)
def test_a_pool_keeps_the_connection_class_its_url_chose(url: str, base: type) -> None:
    for pool in (connection_pool(url), connection_pool(url, blocking=True, max_connections=2)):
        assert issubclass(pool.connection_class, base)
        assert pool.connection_class.pack_command is not base.pack_command
    assert packed_by_hiredis(base) is packed_by_hiredis(base)


async def test_a_packed_client_talks_to_redis_and_closes_its_pool(redis_url: str) -> None:
    client = redis_client(redis_url, socket_timeout=1.0)
    try:
        key = f"packing-test-{random.random()}"
        pipe = client.pipeline(transaction=False)
        pipe.set(key, "ü" * 3, ex=10).incrbyfloat(f"{key}:f", 1.25).get(key).delete(key, f"{key}:f")
        assert await pipe.execute() == [True, 1.25, "ü".encode() * 3, 2]
        assert await client.eval("return ARGV[1] .. KEYS[1]", 1, "k", "v") == b"vk"
    finally:
        await client.aclose()
    assert client.auto_close_connection_pool
