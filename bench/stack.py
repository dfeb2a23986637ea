"""The processes under test, started and stopped by the benchmark on loopback.

A :class:`Stack` owns everything one run starts: a fresh PostgreSQL database (created on
the admin server, dropped after), one fake provider per upstream profile, the gateway
(``python -m gateway serve``) with a real key, and one bare relay per profile. Processes
are pinned apart with ``taskset`` when the machine has two cores or more: the gateway
and the bare relay (the things measured) on one CPU, the fake providers and the driver
on the other, so the process measured never competes with its own load.

The gateway's database traffic goes through a counting TCP proxy, which is how the
report can say how many database round trips a request costs (a cached key costs none).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import yaml

__all__ = [
    "REPO",
    "ByteCounter",
    "Proc",
    "ProcWatch",
    "Profile",
    "Stack",
    "StackOptions",
    "free_port",
    "raised_fd_limit",
]

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Profile:
    """One fake upstream's behaviour; the gateway serves it as model ``bench-<name>``."""

    name: str
    latency_ms: int = 0
    chunks: int | None = None
    chunk_delay_ms: int = 0

    @property
    def model(self) -> str:
        return f"bench-{self.name}"

    @property
    def stream_seconds(self) -> float:
        """How long one of its streams lasts (its chunks' delays): S3 spreads the starts of
        its streams over that, so they do not start and end together in waves."""
        return (self.chunks or 1) * self.chunk_delay_ms / 1000

    def args(self) -> list[str]:
        out = ["--latency-ms", str(self.latency_ms), "--chunk-delay-ms", str(self.chunk_delay_ms)]
        if self.chunks is not None:
            out += ["--chunks", str(self.chunks)]
        return out


# ----------------------------------------------------------------------------- processes
@dataclass
class Proc:
    """A child process we started (and only we stop), with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, wait up to ``grace``, then SIGKILL: by pid, never by name.

        Waits without blocking the loop: the gateway's database traffic runs through
        this process's proxy, and its shutdown (flushes) needs it to keep serving.
        """
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=5)


class ProcWatch:
    """CPU time and resident memory of one process, read from ``/proc``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def rss(self) -> int:
        """Resident set size in bytes (0 if the process is gone)."""
        try:
            with open(f"/proc/{self.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            return 0

    def cpu_seconds(self) -> float:
        """User + system CPU time consumed so far."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return 0.0
        # After the command name: state is field 3, utime 14, stime 15 (1-based) → 11, 12 here.
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def restart(self, w: Window) -> None:
        """Count ``w``'s CPU and wall time from now (the run's warm-up is over)."""
        w.start_cpu = self.cpu_seconds()
        w.started = time.perf_counter()

    @contextlib.asynccontextmanager
    async def window(self, interval: float = 0.05) -> Any:
        """Sample RSS every ``interval`` while the block runs; yields a :class:`Window`."""
        w = Window(start_rss=self.rss(), start_cpu=self.cpu_seconds(), started=time.perf_counter())
        w.peak_rss = w.start_rss

        async def sample() -> None:
            while True:
                await asyncio.sleep(interval)
                w.peak_rss = max(w.peak_rss, self.rss())

        task = asyncio.get_running_loop().create_task(sample())
        try:
            yield w
        finally:
            task.cancel()
            w.end_rss = self.rss()
            w.peak_rss = max(w.peak_rss, w.end_rss)
            w.cpu = self.cpu_seconds() - w.start_cpu
            w.wall = time.perf_counter() - w.started


@dataclass
class Window:
    """What :meth:`ProcWatch.window` saw: CPU and wall time from the block's start, or from
    :meth:`ProcWatch.restart` (the end of a run's warm-up); memory over the whole block."""

    start_rss: int
    start_cpu: float
    started: float
    peak_rss: int = 0
    end_rss: int = 0
    cpu: float = 0.0
    wall: float = 0.0


class ByteCounter:
    """A loopback TCP proxy that counts what its clients send (database round trips).

    Each chunk read from a client is, for PostgreSQL's protocol, one burst of pipelined
    messages awaiting an answer: close enough to one round trip.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.bytes_sent = 0
        self.writes = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        tasks = [
            asyncio.ensure_future(self._pipe(reader, up_writer, count=True)),
            asyncio.ensure_future(self._pipe(up_reader, writer, count=False)),
        ]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
                self._tasks.discard(t)
            writer.close()
            up_writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if count:
                    self.bytes_sent += len(data)
                    self.writes += 1
                writer.write(data)
                await writer.drain()

    def snapshot(self) -> tuple[int, int]:
        return self.writes, self.bytes_sent

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.sleep(0)


# ----------------------------------------------------------------------------- the stack
def gateway_env_assignment(text: str) -> tuple[str, str]:
    """``--gateway-env NAME=VALUE`` (argparse ``type``): one entry of
    :attr:`StackOptions.gateway_env`."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--gateway-env {text!r}: expected NAME=VALUE")
    return name, value


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """``--no-budget`` and ``--gateway-env``, as the single-purpose measures take them."""
    parser.add_argument("--no-budget", action="store_true", help="the bench key without its budget")
    parser.add_argument("--gateway-env", action="append", default=[], type=gateway_env_assignment,
                        metavar="NAME=VALUE", help="extra environment for the gateway (repeat)")


@dataclass
class StackOptions:
    profiles: Sequence[Profile]
    pin: bool = True
    admin_dsn: str = field(default_factory=lambda: os.environ.get("BENCH_PG_ADMIN_DSN", DEFAULT_ADMIN_DSN))
    redis_url: str | None = None
    bare: bool = True
    keep_logs: bool = False
    #: Extra environment for the gateway (``--gateway-env LOG_LEVEL=warning``), for A/B runs.
    gateway_env: dict[str, str] = field(default_factory=dict)
    #: Extra environment for the bare relays (``bench.opcodes`` counts their instructions).
    bare_env: dict[str, str] = field(default_factory=dict)
    #: ``serve --workers N``; with N > 1 the gateway is not pinned (its workers need every CPU).
    gateway_workers: int = 1
    #: Give the bench key its USD 1,000,000 budget (a reservation on every call); False
    #: (``--no-budget``) measures what the budget costs.
    key_budget: bool = True
    #: The source tree the gateway (and the fakes, relay and key command) run from: another
    #: checkout measures another build with this bench (``bench.server_cpu``'s A/B pairs).
    repo: Path = REPO


def key_create_argv(*, budget: bool) -> list[str]:
    """``keys create`` for the bench key: limits generous enough to be checked, never hit,
    and (``budget``) a USD 1,000,000 budget, so every call holds a reservation."""
    argv = [
        sys.executable, "-m", "gateway", "keys", "create", "--name", "bench", "--json",
        "--rpm", "100000000", "--window-seconds", "60", "--tpm", "1000000000",
        "--max-concurrent", "100000",
    ]
    if budget:
        argv += ["--budget-usd", "1000000", "--budget-period", "total"]
    return argv


def _with_db(dsn: str, name: str) -> str:
    base, _, rest = dsn.rpartition("/")
    query = "?" + rest.split("?", 1)[1] if "?" in rest else ""
    return f"{base}/{name}{query}"


class Stack:
    """Everything one benchmark run starts; an async context manager that undoes it all."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        cpus = sorted(os.sched_getaffinity(0))
        self.pinned = options.pin and len(cpus) >= 2 and shutil.which("taskset") is not None
        # On a shared machine the idlest CPU goes to what is measured.
        cpus = idlest_first(cpus) if self.pinned else cpus
        #: Gateway and bare relay here; fakes, driver and profiler on the other CPU.
        self.server_cpu = cpus[0]
        self.load_cpu = cpus[1] if len(cpus) >= 2 else cpus[0]
        self.workdir = Path(tempfile.mkdtemp(prefix="llmg-bench-"))
        self.procs: list[Proc] = []
        self.fakes: dict[str, str] = {}  # profile name -> base URL (no /v1)
        self.bares: dict[str, str] = {}
        self.bare_procs: dict[str, Proc] = {}
        self.gateway: Proc | None = None
        self.gateway_url = ""
        self.management_url = ""
        self.api_key = ""
        self.db_name = f"llmg_bench_{secrets.token_hex(5)}"
        self.database_url = ""
        self.db_counter: ByteCounter | None = None
        self._db_created = False
        self.failed = False
        #: The driver's CPUs before it pinned itself, given back at close: a second Stack in
        #: the same process (alternated passes) must see every CPU again, or it finds one and
        #: runs the gateway beside the driver and the fakes, unpinned.
        self._driver_cpus: set[int] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def __aenter__(self) -> Stack:
        try:
            await self._start()
        except BaseException:
            self.failed = True
            await self.close()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.failed = self.failed or et is not None
        await self.close()

    async def _start(self) -> None:
        self._pin_driver()
        await self._create_database()
        for profile in self.options.profiles:
            port = free_port()
            self._spawn(
                f"fake-{profile.name}",
                [sys.executable, "-m", "gateway.testing.fake_provider", "--port", str(port), "--uvloop", *profile.args()],
                cpu=self.load_cpu,
            )
            self.fakes[profile.name] = f"http://127.0.0.1:{port}"
        await asyncio.gather(*(self._wait_http(f"{url}/v1/models", name) for name, url in self.fakes.items()))
        self.api_key = await self._create_key()
        await self._start_gateway()
        if self.options.bare:
            for profile in self.options.profiles:
                port = free_port()
                self.bare_procs[profile.name] = self._spawn(
                    f"bare-{profile.name}",
                    [sys.executable, "-m", "bench.bare_relay", str(port), self.fakes[profile.name]],
                    cpu=self.server_cpu, env={**self._base_env(), **self.options.bare_env},
                )
                self.bares[profile.name] = f"http://127.0.0.1:{port}"
            await asyncio.gather(
                *(self._wait_port(url, name) for name, url in self.bares.items())
            )

    def _pin_driver(self) -> None:
        """The driver (this process) shares the load CPU with the fake providers."""
        if self.pinned and self._driver_cpus is None:
            self._driver_cpus = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {self.load_cpu})

    async def close(self) -> None:
        for proc in reversed(self.procs):
            await proc.stop()
        if self._driver_cpus is not None:
            os.sched_setaffinity(0, self._driver_cpus)
            self._driver_cpus = None
        if self.db_counter is not None:
            await self.db_counter.close()
        if self._db_created:
            with contextlib.suppress(Exception):
                conn = await asyncpg.connect(self.options.admin_dsn, timeout=10)
                try:
                    await conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
                finally:
                    await conn.close()
            self._db_created = False
        if not (self.options.keep_logs or self.failed):
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- pieces ---------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], *, cpu: int | None, env: dict[str, str] | None = None) -> Proc:
        if self.pinned and cpu is not None:
            argv = ["taskset", "-c", str(cpu), *argv]
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                argv, cwd=str(self.options.repo), env=env or self._base_env(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OTEL_"))}
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = str(self.options.repo) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    async def _create_database(self) -> None:
        try:
            conn = await asyncpg.connect(self.options.admin_dsn, timeout=10)
        except (OSError, asyncpg.PostgresError) as exc:
            raise RuntimeError(f"PostgreSQL at {self.options.admin_dsn} does not answer: {exc}") from None
        try:
            await conn.execute(f'CREATE DATABASE "{self.db_name}"')
            self._db_created = True
        finally:
            await conn.close()
        self.database_url = _with_db(self.options.admin_dsn, self.db_name)

    async def _create_key(self) -> str:
        """A real key through the CLI, with limits generous enough to be checked, never hit."""
        env = {**self._base_env(), "DATABASE_URL": self.database_url}
        argv = key_create_argv(budget=self.options.key_budget)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=str(self.options.repo), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"keys create failed: {err.decode(errors='replace').strip()}")
        return str(json.loads(out)["api_key"])

    def gateway_config(self) -> dict[str, Any]:
        """Providers and models for every profile, breaker and limits on, prices set."""
        return {
            "providers": {
                p.name: {"type": "openai", "base_url": f"{self.fakes[p.name]}/v1", "api_key": "sk-bench-upstream"}
                for p in self.options.profiles
            },
            "models": [
                {
                    "name": p.model,
                    "deployments": [
                        {"provider": p.name, "model": p.model, "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
                    ],
                }
                for p in self.options.profiles
            ],
            "circuit_breaker": {"fail_max": 5, "reset_timeout_seconds": 30},
            # No rate_limits section: the default per-IP guard, although all load comes from
            # 127.0.0.1 with valid keys (S1 and S4 report their 429s, which must be zero).
        }

    async def _start_gateway(self) -> None:
        database_url = self.database_url
        parts = urlsplit(database_url)
        if parts.hostname and "host=" not in parts.query:  # TCP, not a unix socket: count its traffic
            self.db_counter = ByteCounter(parts.hostname, parts.port or 5432)
            await self.db_counter.start()
            database_url = _via(database_url, self.db_counter.port)
        config_path = self.workdir / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(self.gateway_config()))
        port, mport = free_port(), free_port()
        env = {
            **self._base_env(),
            "DATABASE_URL": database_url,
            "GATEWAY_CONFIG": str(config_path),
            "BIND_ADDR": f"127.0.0.1:{port}",
            "MANAGEMENT_BIND_ADDR": f"127.0.0.1:{mport}",
            "LLM_GATEWAY_HOME": str(self.workdir / "home"),
            "ADMIN_TOKEN": secrets.token_hex(16),
        }
        env.update(self.options.gateway_env)
        if self.options.redis_url:
            env["REDIS_URL"] = self.options.redis_url
        elif "REDIS_URL" not in self.options.gateway_env:  # a variant's own REDIS_URL is kept
            env.pop("REDIS_URL", None)
        argv = [sys.executable, "-m", "gateway", "serve"]
        workers = self.options.gateway_workers
        if workers > 1:
            argv += ["--workers", str(workers)]
            if "REDIS_URL" not in env:
                # Memory limits per worker: fine for a benchmark whose keys never hit them.
                argv.append("--per-worker-limits")
        self.gateway = self._spawn("gateway", argv, cpu=self.server_cpu if workers == 1 else None, env=env)
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.management_url = f"http://127.0.0.1:{mport}"
        await self._wait_http(f"{self.gateway_url}/readyz", "gateway", timeout=30)

    async def _wait_http(self, url: str, name: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        proc = next((p for p in self.procs if p.name.endswith(name)), None)
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if proc is not None and not proc.alive():
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
                try:
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.05)
        tail = proc.log_tail() if proc is not None else ""
        raise RuntimeError(f"{name} at {url} not ready within {timeout:.0f}s\n{tail}")

    async def _wait_port(self, url: str, name: str, timeout: float = 20.0) -> None:
        host, port = _host_port(url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return
        raise RuntimeError(f"bare relay {name} did not listen within {timeout:.0f}s")

    # -- what scenarios read -------------------------------------------------------------
    def features(self) -> list[str]:
        """The gateway's actors and modules present in this tree (what the run had on)."""
        found = ["auth", *sorted(p.stem for p in (REPO / "actors").glob("*.py") if p.stem not in ("__init__", "runtime", "auth"))]
        return found

    def environment(self) -> dict[str, Any]:
        return {
            "pinned": self.pinned,
            "gateway_cpu": self.server_cpu if self.pinned else None,
            "load_cpu": self.load_cpu if self.pinned else None,
            "redis": bool(self.options.redis_url),
            "key_budget": self.options.key_budget,
            "gateway_env": dict(self.options.gateway_env),
            "features": self.features(),
        }


def _cpu_idle() -> dict[int, int]:
    idle: dict[int, int] = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu":
                idle[int(name[3:])] = int(values[3]) + int(values[4])  # idle + iowait
    return idle


def idlest_first(cpus: list[int], sample: float = 0.5) -> list[int]:
    """``cpus`` ordered by how idle each was over the next ``sample`` seconds."""
    try:
        before = _cpu_idle()
        time.sleep(sample)
        after = _cpu_idle()
    except (OSError, ValueError, IndexError):
        return cpus
    return sorted(cpus, key=lambda c: after.get(c, 0) - before.get(c, 0), reverse=True)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def _via(dsn: str, port: int) -> str:
    """``dsn`` rewritten to reach its server through a proxy on 127.0.0.1:``port``."""
    parts = urlsplit(dsn)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


@contextlib.contextmanager
def raised_fd_limit(wanted: int = 16384) -> Iterator[None]:
    """Raise this process's open-file limit (children inherit it): S4 holds thousands."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    try:
        yield
    finally:
        if target != soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
