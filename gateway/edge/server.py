"""Run both planes until SIGINT/SIGTERM, then shut down in order.

Order (after uvicorn): stop accepting on the data plane and close its idle keep-alive
connections, let in-flight requests and streams finish for up to
``SHUTDOWN_GRACE_SECONDS``, then end what is left (a stream gets one error event, a
request not yet answered a 503 ``shutting_down``: see :mod:`gateway.http.admission`), then
stop the management plane and the actors, last-started first, so billing drains after
everything that tells it. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import asyncpg
from aiohttp import web

from gateway import __version__
from gateway.auth.keys import DEV_KEY, DEV_KEY_RPM, DEV_KEY_WINDOW_SECONDS, KeyStore
from gateway.core.config import GatewayConfig, Settings
from gateway.core.db import embedded_database_url
from gateway.edge.app import DATA_SERVER_OPTIONS, build_data_app, build_management_app, gateway_state
from gateway.edge.reload import install_sighup
from gateway.http.admission import ADMISSION, AdmissionGate, raise_open_file_limit
from gateway.http.parser_errors import ContractAppRunner
from gateway.observability.logfilters import install_log_filters

__all__ = [
    "AddressUnavailable", "check_addresses", "resolve_database_url", "run", "seed_development_key", "serve",
    "settle_heap",
]

T = TypeVar("T")

log = logging.getLogger("gateway.server")

#: SIGTERM: the orchestrator's stop; SIGINT: Ctrl-C. Both drain; a second one forces.
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: After the grace period: how long aborted streams get to write their error event.
ABORT_SECONDS = 2.0
#: Set by ``serve --workers`` for each worker: the supervisor's pid.
SUPERVISOR_PID_ENV = "LLM_GATEWAY_SUPERVISOR_PID"


class AddressUnavailable(Exception):
    """A plane cannot listen on its address; the message is the one line the user sees."""


def _unavailable(variable: str, host: str, port: int, exc: OSError) -> AddressUnavailable:
    where = f"{variable} {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return AddressUnavailable(f"{where} is in use (set {variable} to another port)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return AddressUnavailable(f"{where} is not an address of this machine (set {variable} to one that is)")
    if exc.errno == errno.EACCES:
        return AddressUnavailable(f"{where} needs privileges to listen on (set {variable} to a port above 1023)")
    if isinstance(exc, socket.gaierror):
        return AddressUnavailable(f"{where}: cannot resolve {host!r} (set {variable} to a reachable host)")
    return AddressUnavailable(f"{where} cannot be listened on: {exc.strerror or exc} (set {variable})")


def check_addresses(settings: Settings) -> None:
    """Raise AddressUnavailable unless both planes can listen on their addresses.

    Run before anything starts or is announced (the embedded database, the development
    key): a port already taken is then one line naming the variable, not a bind error
    after the gateway said it was starting. Each address is bound the way the server
    will bind it (``SO_REUSEADDR``, as asyncio does), and released at once.
    """
    for variable, host, port in (
        ("BIND_ADDR", settings.bind_host, settings.bind_port),
        ("MANAGEMENT_BIND_ADDR", settings.management_host, settings.management_port),
    ):
        try:
            for family, kind, proto, _name, address in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds
                    probe.bind(address)
        except OSError as exc:
            raise _unavailable(variable, host, port, exc) from None


async def seed_development_key(pool: asyncpg.Pool) -> None:
    """Seed (or confirm) the development key of an embedded database, and say so."""
    window = f"{DEV_KEY_RPM} requests per {DEV_KEY_WINDOW_SECONDS} s"
    if await KeyStore(pool).ensure(
        DEV_KEY, "development", requests=DEV_KEY_RPM, window_seconds=DEV_KEY_WINDOW_SECONDS
    ):
        print(f"seeded development key: {DEV_KEY} ({window})", flush=True)
    else:
        print(f"development key: {DEV_KEY}", flush=True)


def resolve_database_url(settings: Settings) -> tuple[str, bool]:
    """``DATABASE_URL``, or the embedded server's URL; True when embedded."""
    if settings.database_url:
        return settings.database_url, False
    return embedded_database_url(settings.home), True


async def serve(
    settings: Settings, config: GatewayConfig, dsn: str, *, embedded: bool, migrate: bool = True,
    worker_socket: str | None = None,
) -> None:
    """Serve until a signal; returns after an orderly shutdown.

    As one of ``serve --workers N`` (``worker_socket`` set), the data port is shared with
    the other workers (SO_REUSEPORT) and the management plane listens only on that
    private unix socket, for the supervisor to aggregate.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals_seen = 0
    runners: list[web.AppRunner] = []

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info("received %s: draining", signal.Signals(signum).name)
            stop.set()
        else:
            # Skip the wait, not the shutdown: dropping the connections cancels their
            # handlers (handler_cancellation), and the actors still stop in order.
            log.warning("second signal: closing in-flight requests")
            for runner in runners:
                if runner.server is not None:
                    for connection in runner.server.connections:
                        connection.force_close()

    for sig in HANDLED_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    raise_open_file_limit()
    install_log_filters()

    # A worker watches its supervisor from its first moment, not once it serves: a
    # supervisor killed while the worker still starts must not leave it orphaned.
    serving = asyncio.Event()
    main = loop.create_task(
        _serve_until_stopped(settings, config, dsn, embedded, migrate, worker_socket, stop, serving, runners)
    )
    orphan_watch: asyncio.Task[None] | None = None
    if worker_socket is not None:
        orphan_watch = loop.create_task(_stop_when_orphaned(stop, main, serving, supervisor_pid()))
    try:
        await main
    except asyncio.CancelledError:
        if not (stop.is_set() and not serving.is_set()):
            raise  # cancelled from outside, not by the orphan watch during start-up
        log.warning("stopped while starting: the supervisor is gone")
    finally:
        if orphan_watch is not None:
            orphan_watch.cancel()
    log.info("stopped")


async def _serve_until_stopped(
    settings: Settings, config: GatewayConfig, dsn: str, embedded: bool, migrate: bool,
    worker_socket: str | None, stop: asyncio.Event, serving: asyncio.Event, runners: list[web.AppRunner],
) -> None:
    async with gateway_state(settings, config, dsn, run_migrations=migrate) as state:
        install_sighup(asyncio.get_running_loop(), state)
        if embedded:
            await seed_development_key(state.pool)
            print(_dev_bind_notice(settings, config), flush=True)
        data_app = build_data_app(state)
        data_runner = ContractAppRunner(
            data_app,
            handle_signals=False,
            shutdown_timeout=settings.shutdown_grace,
            access_log=None,
            # aiohttp closes a connection that completes no request head within this
            # (from its start, or since its last answer): bounds slowloris and idle sockets.
            keepalive_timeout=settings.client_idle_timeout,
            **DATA_SERVER_OPTIONS,  # type: ignore[arg-type]
        )
        mgmt_runner = ContractAppRunner(
            build_management_app(state), handle_signals=False, shutdown_timeout=5, access_log=None
        )
        await data_runner.setup()
        await mgmt_runner.setup()
        runners += (data_runner, mgmt_runner)
        try:
            try:
                await web.TCPSite(
                    data_runner, settings.bind_host, settings.bind_port, backlog=1024,
                    reuse_port=worker_socket is not None,
                ).start()
            except OSError as exc:  # taken since check_addresses looked
                raise _unavailable("BIND_ADDR", settings.bind_host, settings.bind_port, exc) from None
            if worker_socket is not None:
                await web.UnixSite(mgmt_runner, worker_socket).start()
            else:
                try:
                    await web.TCPSite(mgmt_runner, settings.management_host, settings.management_port).start()
                except OSError as exc:
                    raise _unavailable(
                        "MANAGEMENT_BIND_ADDR", settings.management_host, settings.management_port, exc
                    ) from None
            print(
                f"llm-gateway {__version__} serving data plane on http://{settings.bind_host}:{settings.bind_port}"
                f" and management plane on http://{settings.management_host}:{settings.management_port}",
                flush=True,
            )
            settle_heap()
            serving.set()
            await stop.wait()
            state.draining = True
            await _drain(data_runner, data_app[ADMISSION], settings.shutdown_grace)
        finally:
            # One by one, data plane first: clients drain while operators can still look.
            await data_runner.cleanup()
            await mgmt_runner.cleanup()


#: Allocations (net of deallocations) between two youngest-generation collections; the
#: interpreter's default is 700.
GC_YOUNG_THRESHOLD = 10_000


def settle_heap() -> int:
    """Keep the garbage collector off what start-up built; how many objects it froze.

    Everything alive once both planes listen (modules, config, pydantic models, metrics,
    pools: well over 100,000 objects) lives until exit, yet every full collection walked
    it all: with the test harness in one process, 100-300 ms per full collection and
    about 150 us of collector time per request, 11 us with this.
    ``gc.freeze()`` moves them to a generation the collector never scans. And a
    request allocates hundreds of short-lived containers, so at the default threshold
    (700) the youngest generation was collected every request or two, promoting what
    a request still held into the older generations; at ``GC_YOUNG_THRESHOLD`` most of it
    has been freed by reference counting before a collection looks. Cycles are still
    collected, only less often (at most that many allocations late).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()


def _dev_bind_notice(settings: Settings, config: GatewayConfig) -> str:
    """What start-up says about who can reach the public development key."""
    if not settings.bind_addr_given:
        return (
            f"development mode (embedded database): data plane on {settings.bind_host} only;"
            " set BIND_ADDR (e.g. 0.0.0.0:3000) to listen on the network"
        )
    real = sorted(name for name, provider in config.providers.items() if provider.type != "mock")
    if settings.bind_host not in ("127.0.0.1", "::1", "localhost") and real:
        return (
            f"WARNING: the development key is public and the data plane listens on {settings.bind_host}:"
            f" anyone who can reach it can spend provider account(s) {', '.join(real)}"
        )
    return f"development mode (embedded database): data plane on {settings.bind_host}"


async def _drain(runner: web.AppRunner, gate: AdmissionGate, grace: float) -> None:
    """Stop taking requests, wait up to ``grace`` for those in flight, then end the rest."""
    gate.draining = True  # a request on a kept-alive connection now gets 503 shutting_down
    for site in list(runner.sites):
        await site.stop()
    if runner.server is not None:
        runner.server.pre_shutdown()  # idle keep-alive connections close now, busy ones after
    if gate.in_flight:
        log.info("waiting up to %gs for %d request(s) in flight", grace, gate.in_flight)
    if await gate.wait_idle(grace):
        return
    log.warning("grace period over: ending %d request(s) still in flight", gate.abort())
    await gate.wait_idle(ABORT_SECONDS)


def supervisor_pid() -> int:
    """The pid of this worker's supervisor, as it handed it over (else the parent now).

    Read from the environment rather than ``os.getppid()`` at some later moment: a
    supervisor that died before that moment would leave pid 1 (or a subreaper) recorded
    as the parent, and the worker would never notice it was orphaned.
    """
    handed = os.environ.get(SUPERVISOR_PID_ENV, "")
    return int(handed) if handed.isdigit() else os.getppid()


async def _stop_when_orphaned(
    stop: asyncio.Event, main: asyncio.Task[None], serving: asyncio.Event, supervisor: int,
    interval: float = 0.5,
) -> None:
    """A worker of ``serve --workers`` drains and exits if its supervisor dies.

    A supervisor killed outright (SIGKILL, OOM) cannot pass SIGTERM on; without this its
    workers would keep the port and the database connections forever. While the worker
    still starts (nothing to drain yet) its start-up is cancelled outright.
    """
    while not stop.is_set():
        if os.getppid() != supervisor:
            log.warning("supervisor %d is gone: draining", supervisor)
            stop.set()
            if not serving.is_set():
                main.cancel()
            return
        await asyncio.sleep(interval)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where available (15-40 % faster under load here)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
