"""Shared fixtures: a real PostgreSQL database per run, Redis, the fake provider over
loopback, and gateways both in-process (fast) and as real ``llm-gateway serve``
processes (for signals, restarts and several replicas).

PostgreSQL: ``TEST_PG_ADMIN_DSN`` (default the local server on 127.0.0.1:5432); where
none answers, the embedded ``pgserver`` one. Each run creates ``llmg_test_<random>``
and drops it at the end. Redis: ``TEST_REDIS_URL`` (default 127.0.0.1:6379); tests that
need it skip with a reason where it does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.auth.keys import KeyPolicy, KeyStore
from gateway.billing.reservations import PostgresReservations, RedisReservations, connect_reservation_pool
from gateway.core.config import GatewayConfig, load_config, load_settings
from gateway.core.db import migrate
from gateway.edge.app import DATA_SERVER_OPTIONS, build_data_app, build_management_app, gateway_state
from gateway.testing.fake_provider import FakeConfig, make_app
from tests import budget_stores

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


#: Ports :func:`free_port` handed out in this process: never handed out twice (the kernel
#: may give a port back as soon as it is released, and two servers started together then
#: got the same one).
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before by this process. Something else
    may still take it before its user binds it (an ephemeral port of an outgoing
    connection): a server started on it must be ready to try another."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# ----------------------------------------------------------------------------- PostgreSQL
def _admin_dsn_answers(dsn: str) -> bool:
    async def probe() -> bool:
        try:
            conn = await asyncpg.connect(dsn, timeout=3)
        except Exception:
            return False
        await conn.close()
        return True

    return asyncio.run(probe())


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """A superuser DSN: the local server, or an embedded one started for this run."""
    dsn = os.environ.get("TEST_PG_ADMIN_DSN", DEFAULT_ADMIN_DSN)
    if _admin_dsn_answers(dsn):
        yield dsn
        return
    pgserver = pytest.importorskip("pgserver", reason="no PostgreSQL answers and pgserver is missing")
    data_dir = Path(tempfile.mkdtemp(prefix="llmg-pg-", dir="/tmp"))
    server = pgserver.get_server(str(data_dir), cleanup_mode="stop")
    yield server.get_uri("postgres")
    server.cleanup()
    shutil.rmtree(data_dir, ignore_errors=True)


def _with_db(admin_dsn: str, name: str) -> str:
    base, _, _ = admin_dsn.rpartition("/")
    query = ""
    if "?" in admin_dsn:
        query = "?" + admin_dsn.split("?", 1)[1]
    return f"{base}/{name}{query}"


@pytest.fixture(scope="session")
def database_url(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh, migrated database for this test run; dropped at the end."""
    name = f"llmg_test_{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        conn = await asyncpg.connect(pg_admin_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        conn = await asyncpg.connect(_with_db(pg_admin_dsn, name))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    async def drop() -> None:
        conn = await asyncpg.connect(pg_admin_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(create())
    yield _with_db(pg_admin_dsn, name)
    asyncio.run(drop())


@pytest.fixture
async def db_pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert pool is not None
    yield pool
    await pool.close()


@pytest.fixture
async def key_factory(db_pool: asyncpg.Pool) -> Callable[..., Any]:
    """``await key_factory(name=..., **policy)`` → (raw key, KeyRecord)."""
    store = KeyStore(db_pool)

    async def create(name: str = "test", *, subject_id: uuid.UUID | None = None, **policy: Any) -> Any:
        return await store.create(name, subject_id=subject_id, policy=KeyPolicy(**policy))

    return create


@pytest.fixture
async def api_key(key_factory: Callable[..., Any]) -> str:
    raw, _ = await key_factory(rate_limit_requests=100_000)
    return str(raw)


# ----------------------------------------------------------------------------- Redis
@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("TEST_REDIS_URL", DEFAULT_REDIS_URL)
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    try:
        with socket.create_connection((host, int(port or 6379)), timeout=1) as s:
            s.sendall(b"PING\r\n")
            if not s.recv(16).startswith(b"+PONG"):
                raise OSError("no PONG")
    except OSError as exc:
        pytest.skip(f"Redis is not reachable at {url}: {exc}")
    return url


# ----------------------------------------------------------------------------- fake provider
@dataclass
class FakeUpstream:
    """A running fake provider and a way to script and inspect it."""

    url: str  # base URL including /v1
    server: TestServer
    session: aiohttp.ClientSession

    async def script(self, *steps: Mapping[str, Any]) -> None:
        async with self.session.post(f"{self.url[:-3]}/_fake/script", json={"steps": list(steps)}) as r:
            assert r.status == 200, await r.text()

    async def stats(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url[:-3]}/_fake/stats") as r:
            return dict(await r.json())


@pytest.fixture
async def fake_factory() -> AsyncIterator[Callable[..., Any]]:
    """``await fake_factory(**FakeConfig fields)`` → a FakeUpstream on 127.0.0.1."""
    started: list[TestServer] = []
    session = aiohttp.ClientSession()

    async def start(**config: Any) -> FakeUpstream:
        server = TestServer(make_app(FakeConfig(**config)), host="127.0.0.1")
        await server.start_server()
        started.append(server)
        return FakeUpstream(url=f"http://127.0.0.1:{server.port}/v1", server=server, session=session)

    yield start
    for server in started:
        await server.close()
    await session.close()


@pytest.fixture
async def fake(fake_factory: Callable[..., Any]) -> FakeUpstream:
    return await fake_factory()  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- gateways
def config_for(fake_url: str, **extra: Any) -> str:
    """YAML for one OpenAI-compatible provider ``fake`` serving every model name."""
    import yaml

    doc: dict[str, Any] = {
        "providers": {"fake": {"type": "openai", "base_url": fake_url, "api_key": "sk-fake-provider-secret"}},
        "models": [{"name": "*", "deployments": [{"provider": "fake", "model": "*"}]}],
    }
    doc.update(extra)
    return yaml.safe_dump(doc)


def pair_config(first_url: str, second_url: str) -> str:
    """YAML for model group ``pair``: deployment m1 on fake ``first``, then m2 on ``second``."""
    return config_for(
        first_url,
        providers={
            "first": {"type": "openai", "base_url": first_url, "api_key": "sk-first-secret-1"},
            "second": {"type": "openai", "base_url": second_url, "api_key": "sk-second-secret-2"},
        },
        models=[{"name": "pair", "deployments": [
            {"provider": "first", "model": "m1", "priority": 0}, {"provider": "second", "model": "m2", "priority": 1},
        ]}],
    )


@dataclass
class Gateway:
    """An in-process gateway: test clients for both planes over real loopback HTTP."""

    data: TestClient
    management: TestClient
    state: Any

    def url(self, path: str = "") -> str:
        return str(self.data.make_url(path))


@pytest.fixture
async def gateway_factory(
    database_url: str, tmp_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    """``await gateway_factory(env={...}, config_yaml=...)`` → Gateway (in-process).

    ``env`` holds contract §3 variables (DATABASE_URL is set for you); ``config_yaml``
    is written to a file and used as GATEWAY_CONFIG.
    """
    stack = contextlib.AsyncExitStack()

    async def start(env: Mapping[str, str] | None = None, config_yaml: str | None = None) -> Gateway:
        # The data directory (and so the billing journal) is the test's own, never $HOME.
        environ = {"DATABASE_URL": database_url, "LLM_GATEWAY_HOME": str(tmp_path / "home"), **(env or {})}
        if config_yaml is not None:
            path = tmp_path / f"gateway-{uuid.uuid4().hex[:6]}.yaml"
            path.write_text(config_yaml)
            environ["GATEWAY_CONFIG"] = str(path)
        settings = load_settings(environ)
        config: GatewayConfig = load_config(settings, environ)
        # env may point DATABASE_URL elsewhere (e.g. through a cuttable proxy).
        dsn = settings.database_url or database_url
        state = await stack.enter_async_context(gateway_state(settings, config, dsn))
        data_server = TestServer(build_data_app(state), host="127.0.0.1")
        # TestServer sets handler_cancellation itself; pass the rest of the real options.
        await data_server.start_server(
            **{k: v for k, v in DATA_SERVER_OPTIONS.items() if k != "handler_cancellation"}
        )
        data = TestClient(data_server)
        management = TestClient(TestServer(build_management_app(state), host="127.0.0.1"))
        await data.start_server()
        await management.start_server()
        stack.push_async_callback(data.close)
        stack.push_async_callback(management.close)
        return Gateway(data=data, management=management, state=state)

    yield start
    await stack.aclose()


@pytest.fixture
async def gateway(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> Gateway:
    """A gateway in front of one fake provider."""
    return await gateway_factory(config_yaml=config_for(fake.url))  # type: ignore[no-any-return]


@dataclass
class GatewayProcess:
    """A real ``llm-gateway serve`` process."""

    proc: subprocess.Popen[bytes]
    port: int
    management_port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the offsets ``cuts`` (each taken modulo its length + 1), in order:
    the reads a stream of ``data`` could arrive in."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


async def until(predicate: Callable[[], Any], timeout: float = 5.0, step: float = 0.01) -> None:
    """Poll ``predicate`` on the loop until it is true; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(step)


async def wait_until_ready(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}")
            try:
                async with session.get(f"{url}/readyz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"gateway at {url} not ready within {timeout}s")


@pytest.fixture
async def process_factory(database_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await process_factory(env={...}, config_yaml=...)`` → a started GatewayProcess."""
    procs: list[GatewayProcess] = []

    async def start(
        env: Mapping[str, str] | None = None, config_yaml: str | None = None, *, ready: bool = True,
        args: tuple[str, ...] = (),
    ) -> GatewayProcess:
        config_path = None
        if config_yaml is not None:
            config_path = tmp_path / f"gateway-{uuid.uuid4().hex[:6]}.yaml"
            config_path.write_text(config_yaml)
        # Our own ports may be taken between free_port() and the gateway's bind: it then
        # exits saying so, and starts again on others (the caller's own ports are kept).
        ports_ours = not {"BIND_ADDR", "MANAGEMENT_BIND_ADDR"} & set(env or {})
        for attempt in range(3):
            port, mport = free_port(), free_port()
            environ = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OTEL_"))},
                "DATABASE_URL": database_url,
                "BIND_ADDR": f"127.0.0.1:{port}",
                "MANAGEMENT_BIND_ADDR": f"127.0.0.1:{mport}",
                "LLM_GATEWAY_HOME": str(tmp_path / "home"),
                "PYTHONUNBUFFERED": "1",
                # The source tree under test, installed or not.
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
                **(env or {}),
            }
            if config_path is not None:
                environ["GATEWAY_CONFIG"] = str(config_path)
            log_path = tmp_path / f"gateway-{port}.log"
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "gateway", "serve", *args],
                    env=environ, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
                )
            gp = GatewayProcess(proc=proc, port=port, management_port=mport, log_path=log_path, env=environ)
            procs.append(gp)
            if not ready:
                return gp
            try:
                await wait_until_ready(gp.url, proc=proc)
            except Exception as exc:
                if ports_ours and attempt < 2 and proc.poll() is not None and " is in use (set " in gp.log():
                    continue
                raise RuntimeError(f"{exc}; log:\n{gp.log()}") from None
            return gp
        raise AssertionError("unreachable")

    yield start
    for gp in procs:
        if gp.proc.poll() is None:
            gp.proc.send_signal(signal.SIGKILL)
            gp.proc.wait(timeout=10)


def chat_body(content: str = "hello there", *, model: str = "test-model", stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sse_payloads(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


__all__ = ["auth", "chat_body", "config_for", "free_port", "sse_payloads", "wait_until_ready", "web"]


# ----------------------------------------------------------------------------- outages
@pytest.fixture
async def pg_proxy(pg_admin_dsn: str) -> AsyncIterator[Any]:
    """A cuttable TCP proxy in front of the test PostgreSQL (TCP servers only)."""
    from urllib.parse import urlsplit

    from tests.chaos import TcpProxy

    parts = urlsplit(pg_admin_dsn)
    if not parts.hostname or parts.hostname.startswith("/"):
        pytest.skip("the test PostgreSQL is not reachable over TCP")
    proxy = await TcpProxy.start(parts.hostname, parts.port or 5432)
    yield proxy
    await proxy.close()


def via_proxy(dsn: str, proxy_port: int) -> str:
    """``dsn`` rewritten to go through a proxy on 127.0.0.1:proxy_port."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit((parts.scheme, f"{user}127.0.0.1:{proxy_port}", parts.path, parts.query, ""))


@pytest.fixture
async def redis_proxy(redis_url: str) -> AsyncIterator[Any]:
    """A cuttable TCP proxy in front of the test Redis; ``redis_via(proxy)`` is its URL."""
    from urllib.parse import urlsplit

    from tests.chaos import TcpProxy

    parts = urlsplit(redis_url)
    proxy = await TcpProxy.start(parts.hostname or "127.0.0.1", parts.port or 6379)
    yield proxy
    await proxy.close()


def redis_via(redis_url: str, proxy_port: int) -> str:
    """``redis_url`` rewritten to go through a proxy on 127.0.0.1:proxy_port."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(redis_url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{proxy_port}", parts.path, parts.query, ""))


@pytest.fixture
async def make_store(database_url: str, db_pool: asyncpg.Pool, redis_url: str) -> AsyncIterator[Callable[..., Any]]:
    """Budget stores on the test PostgreSQL and Redis (tests/budget_stores.py), closed after the test."""
    stores: list[Any] = []

    async def make(kind: str, faults: budget_stores.Faults) -> PostgresReservations | RedisReservations:
        store: PostgresReservations | RedisReservations
        if kind == "postgresql":
            own = budget_stores.CountingPool(await connect_reservation_pool(database_url, max_size=4), faults)
            store = PostgresReservations(db_pool, own_pool=own)  # type: ignore[arg-type]
        else:
            client = budget_stores.CountingRedis.from_url(redis_url)
            client.faults = faults
            store = RedisReservations(client, db_pool, prefix=f"test-{uuid.uuid4().hex[:8]}:budget")
            client.reserve_sha = store._reserve_script.sha
            # Loaded beforehand: on a Redis whose script cache is empty (a fresh server, a
            # SCRIPT FLUSH) redis-py's first EVALSHA answers NOSCRIPT and is sent again,
            # which the counts would take for a second round trip.
            for script in (store._reserve_script, store._settle_script, store._resize_script):
                await client.script_load(script.script)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()
