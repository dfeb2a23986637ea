"""PostgreSQL: the connection pool, migrations, and the embedded server of contract §1."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import warnings
from pathlib import Path

import asyncpg

__all__ = [
    "DatabaseUnavailable",
    "EmbeddedUnavailable",
    "connect_pool",
    "embedded_database_url",
    "migrate",
    "migrations_dir",
]

log = logging.getLogger("gateway.db")

# Any fixed number works; it only has to be the same in every replica.
MIGRATION_LOCK_ID = 0x6C6C6D67  # "llmg"

#: Errors that mean "the database is not answering", as opposed to a bad query.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncio.TimeoutError,
    ConnectionError,
)


class DatabaseUnavailable(RuntimeError):
    """The database could not be reached."""


class EmbeddedUnavailable(RuntimeError):
    """No embedded PostgreSQL can run on this machine."""


def migrations_dir() -> Path:
    """Where ``sql/*.sql`` lives: the source tree, or the installed data files."""
    override = os.environ.get("LLM_GATEWAY_SQL_DIR")
    candidates = [Path(override)] if override else []
    candidates += [
        Path(__file__).resolve().parents[2] / "sql",
        Path(sys.prefix) / "share" / "llm-gateway" / "sql",
    ]
    for c in candidates:
        if c.is_dir() and any(c.glob("*.sql")):
            return c
    raise FileNotFoundError("migrations not found (looked in: " + ", ".join(map(str, candidates)) + ")")


async def connect_pool(dsn: str, *, min_size: int = 2, max_size: int = 10, timeout: float = 5.0) -> asyncpg.Pool:
    """A pool whose failures to connect come out as DatabaseUnavailable."""
    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, timeout=timeout, command_timeout=30
        )
    except CONNECTION_ERRORS as exc:
        raise DatabaseUnavailable(f"cannot connect to the database: {exc}") from None
    except asyncpg.PostgresError as exc:
        raise DatabaseUnavailable(f"database refused the connection: {exc}") from None
    assert pool is not None
    return pool


async def migrate(conn: asyncpg.Connection, directory: Path | None = None) -> list[str]:
    """Apply every ``*.sql`` not yet recorded, in name order, each in its own transaction.

    Replicas starting together serialise on an advisory lock, so each file runs once.
    Returns the names applied by this call.
    """
    directory = directory or migrations_dir()
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_ID)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations"
            " (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")}
        for path in sorted(directory.glob("*.sql")):
            if path.name in done:
                continue
            async with conn.transaction():
                await conn.execute(path.read_text())
                await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", path.name)
            log.info("migration applied: %s", path.name)
            applied.append(path.name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_ID)
    return applied


def embedded_data_dir(home: Path) -> Path:
    """The embedded server's directory; as root, never under a home directory.

    pgserver chmods every parent of its data directory (g+rx, o+rx) when run as root;
    doing that to /root would open it to every user, so root gets /var/lib instead.
    """
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "LLM_GATEWAY_HOME" not in os.environ:
        return Path("/var/lib/llm-gateway/pgdata")
    return home / "pgdata"


def embedded_database_url(home: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL and return its URL."""
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime directory when it is imported, which
            # warns on stderr wherever XDG_RUNTIME_DIR is unset (root, containers, cron)
            # and then uses /tmp/runtime-$UID anyway: nothing the user can or must act on.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            import pgserver  # type: ignore[import-untyped]
    except ImportError:
        raise EmbeddedUnavailable(
            "no embedded PostgreSQL on this machine (pgserver not installed); set DATABASE_URL"
        ) from None
    logging.getLogger("pgserver").setLevel(logging.WARNING)  # it logs every subprocess at INFO
    data_dir = embedded_data_dir(home)
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        # "stop": the server stops with the last process using it, like any child process.
        server = pgserver.get_server(str(data_dir), cleanup_mode="stop")
        return str(server.get_uri("postgres"))
    except Exception as exc:  # noqa: BLE001 - pgserver raises plain exceptions from its subprocesses
        raise EmbeddedUnavailable(f"embedded PostgreSQL failed to start ({exc}); set DATABASE_URL") from None
