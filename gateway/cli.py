"""The ``llm-gateway`` command: serve, migrate, keys, usage, budgets.

Every command reads ``DATABASE_URL``; an expected failure (bad input, unreachable
database, bad configuration) prints one line to stderr and exits non-zero, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import NoReturn
from urllib.parse import urlsplit

import asyncpg

from gateway import __version__
from gateway.admin.input import MAX_GRACE
from gateway.auth.keys import (
    DEFAULT_KEY_RPM,
    DEFAULT_KEY_WINDOW_SECONDS,
    KeyNotFound,
    KeyPolicy,
    KeyRecord,
    KeyStore,
)
from gateway.billing.budgets import SubjectBudgetStore
from gateway.billing.reports import GROUPS, UsageQuery, format_table, parse_time, usage_report
from gateway.core.config import ConfigError, GatewayConfig, Settings, load_config, load_settings
from gateway.core.db import DatabaseUnavailable, EmbeddedUnavailable, connect_pool, migrate
from gateway.edge.server import AddressUnavailable, check_addresses, resolve_database_url, run, serve
from gateway.edge.workers import per_worker_limits_refusal, supervise_workers
from gateway.observability.logs import LOG_FORMATS, LogSetup, configure_logging

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_FAILURE = 1


#: Limits are PostgreSQL integers; larger ones would fail in the database with a cryptic message.
_MAX_LIMIT = 2**31 - 1
#: Longest expiry accepted (a hundred years); far larger ones overflow the date type.
_MAX_DAYS = 36_500
#: ``budget_usd`` is numeric(14, 6): amounts must stay below 10^8.
_MAX_BUDGET = Decimal(10) ** 8


_SERVE_DESCRIPTION = """\
Apply the database migrations, then serve the data plane (BIND_ADDR: the
OpenAI-compatible API for clients) and the management plane (MANAGEMENT_BIND_ADDR:
/metrics and /admin/*) until SIGINT or SIGTERM, then drain in-flight requests for up
to SHUTDOWN_GRACE_SECONDS.

With no DATABASE_URL it starts an embedded PostgreSQL and seeds the development key;
with no provider configured the built-in mock provider answers every model offline."""

_ENVIRONMENT_EPILOG = """\
Configuration comes from environment variables: BIND_ADDR, MANAGEMENT_BIND_ADDR,
DATABASE_URL, REDIS_URL, GATEWAY_CONFIG (the config file), VENICE_API_KEY, ADMIN_TOKEN,
LOG_LEVEL, LOG_FORMAT and more; README's "Configuration" section lists every one with
its default (conf/gateway.example.yaml shows the config file)."""


class CommandError(Exception):
    """An expected failure: its message is the one line the user sees."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, not a usage block plus the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _bounded_int(text: str, maximum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 < value <= maximum:
        raise argparse.ArgumentTypeError(f"expected a positive number up to {maximum}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _bounded_int(text, _MAX_LIMIT)


def _days(text: str) -> int:
    return _bounded_int(text, _MAX_DAYS)


def _budget(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected an amount in USD, got {text!r}") from None
    if not value.is_finite() or value < 0 or value >= _MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"expected a non-negative amount below {_MAX_BUDGET}, got {text!r}")
    return value


def _grace_seconds(text: str) -> int:
    limit = int(MAX_GRACE.total_seconds())
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of seconds, got {text!r}") from None
    if not 0 <= value <= limit:
        raise argparse.ArgumentTypeError(f"expected 0 to {limit} seconds (30 days), got {text!r}")
    return value


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a UUID, got {text!r}") from None


def _models(text: str) -> tuple[str, ...]:
    models = tuple(m.strip() for m in text.split(",") if m.strip())
    if not models:
        raise argparse.ArgumentTypeError("expected a comma-separated list of model names")
    return models


def _time(name: str) -> Callable[[str], datetime]:
    def parse(text: str) -> datetime:
        try:
            return parse_time(text, name)
        except ValueError:
            # argparse names the option itself.
            raise argparse.ArgumentTypeError(f"expected an ISO 8601 date or date-time, got {text!r}") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="llm-gateway", description="An OpenAI-compatible LLM gateway.", epilog=_ENVIRONMENT_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"llm-gateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve_cmd = commands.add_parser(
        "serve", help="apply migrations, then serve both planes",
        description=_SERVE_DESCRIPTION, epilog=_ENVIRONMENT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve_cmd.add_argument("--no-migrate", action="store_true", help="skip migrations (run them as a release step)")
    serve_cmd.add_argument("--workers", type=_positive_int, default=1,
                           help="data-plane processes sharing BIND_ADDR (SO_REUSEPORT); default 1")
    serve_cmd.add_argument("--per-worker-limits", action="store_true",
                           help="with --workers N and rate limits in memory (no REDIS_URL): accept that "
                                "each worker enforces every limit on its own (N x the limit)")
    serve_cmd.add_argument("--worker-socket", help=argparse.SUPPRESS)  # set by --workers for its children
    serve_cmd.add_argument("--log-format", default=os.environ.get("LOG_FORMAT", "json"), choices=LOG_FORMATS,
                           help="json: one object per line (default); text: for humans")
    serve_cmd.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"),
                           choices=["debug", "info", "warning", "error"],
                           help="least severe log line written to stderr (default info, or LOG_LEVEL)")

    commands.add_parser("migrate", help="apply sql/*.sql once each, in name order")

    keys = commands.add_parser("keys", help="create, list, revoke and rotate gateway keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = key_commands.add_parser(
        "create", help="create a key and print it once",
        description="Create a key and print it once. With no limit options a key may make "
                    f"{DEFAULT_KEY_RPM} requests per {DEFAULT_KEY_WINDOW_SECONDS} seconds, with no token, "
                    "concurrency or budget limit.",
    )
    create.add_argument("--name", required=True)
    create.add_argument("--subject", type=_uuid, help="subject (tenant) UUID; new if omitted")
    create.add_argument("--rpm", type=_positive_int, default=DEFAULT_KEY_RPM,
                        help=f"requests per window (default {DEFAULT_KEY_RPM})")
    create.add_argument("--window-seconds", type=_positive_int, default=DEFAULT_KEY_WINDOW_SECONDS,
                        help=f"window length in seconds (default {DEFAULT_KEY_WINDOW_SECONDS})")
    create.add_argument("--tpm", type=_positive_int, help="tokens per minute")
    create.add_argument("--max-concurrent", type=_positive_int, help="concurrent requests in flight")
    create.add_argument("--budget-usd", type=_budget, help="spend cap in USD per period")
    create.add_argument("--budget-period", choices=["day", "month", "total"], help="budget period (default month)")
    create.add_argument("--models", type=_models, help="comma-separated allowlist of model names (wildcards ok)")
    create.add_argument("--expires-in-days", type=_days)
    create.add_argument("--json", action="store_true")
    listing = key_commands.add_parser("list", help="list keys (never a hash or raw key)")
    listing.add_argument("--json", action="store_true")
    revoke = key_commands.add_parser("revoke", help="revoke a key by id or prefix")
    revoke.add_argument("key")
    rotate = key_commands.add_parser("rotate", help="issue a new key with the same subject and limits")
    rotate.add_argument("key")
    rotate.add_argument("--grace-seconds", type=_grace_seconds, default=0, metavar="N",
                        help="the old key keeps working N more seconds (at most 30 days); 0: revoked now (default)")
    rotate.add_argument("--json", action="store_true")

    usage = commands.add_parser("usage", help="usage and spend from the ledger")
    usage.add_argument("--key", help="only this key (id or prefix)")
    usage.add_argument("--subject", type=_uuid, help="only this subject")
    usage.add_argument("--since", type=_time("--since"), help="from this ISO date/time, inclusive (UTC if no offset)")
    usage.add_argument("--until", type=_time("--until"), help="to this ISO date/time, exclusive (UTC if no offset)")
    usage.add_argument("--group-by", choices=GROUPS, default="key")
    usage.add_argument("--json", action="store_true")

    budgets = commands.add_parser("budgets", help="set, list and clear subject budgets")
    budget_commands = budgets.add_subparsers(dest="budgets_command", required=True, metavar="ACTION")
    budget_set = budget_commands.add_parser("set", help="create or replace a subject's budget")
    budget_set.add_argument("--subject", type=_uuid, required=True)
    budget_set.add_argument("--usd", type=_budget, required=True, help="spend cap in USD per period")
    budget_set.add_argument("--period", choices=["day", "month", "total"], default="month")
    budget_set.add_argument("--json", action="store_true")
    budget_list = budget_commands.add_parser("list", help="list subject budgets")
    budget_list.add_argument("--json", action="store_true")
    budget_clear = budget_commands.add_parser("clear", help="remove a subject's budget")
    budget_clear.add_argument("--subject", type=_uuid, required=True)
    return parser


async def _with_store(settings: Settings, action: Callable[[KeyStore], Awaitable[int]]) -> int:
    dsn, _embedded = resolve_database_url(settings)
    pool = await connect_pool(dsn, min_size=1, max_size=2)
    try:
        async with pool.acquire() as conn:
            await migrate(conn)
        return await action(KeyStore(pool))
    finally:
        await pool.close()


async def _with_pool(settings: Settings, action: Callable[[asyncpg.Pool], Awaitable[int]]) -> int:
    dsn, _embedded = resolve_database_url(settings)
    pool = await connect_pool(dsn, min_size=1, max_size=2)
    try:
        async with pool.acquire() as conn:
            await migrate(conn)
        return await action(pool)
    finally:
        await pool.close()


async def _usage(args: argparse.Namespace, settings: Settings) -> int:
    async def act(pool: asyncpg.Pool) -> int:
        key_id = (await KeyStore(pool).get(args.key)).api_key_id if args.key else None
        try:
            query = UsageQuery(
                group_by=args.group_by, since=args.since, until=args.until,
                api_key_id=key_id, subject_id=args.subject,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        report = await usage_report(pool, query)
        print(json.dumps(report.to_json()) if args.json else format_table(report))
        return 0

    return await _with_pool(settings, act)


async def _budgets(args: argparse.Namespace, settings: Settings) -> int:
    async def act(pool: asyncpg.Pool) -> int:
        store = SubjectBudgetStore(pool)
        if args.budgets_command == "set":
            budget = await store.set(args.subject, args.usd, args.period)
            print(json.dumps(budget.to_json()) if args.json
                  else f"subject {budget.subject_id}: {budget.budget_usd} USD per {budget.budget_period}")
        elif args.budgets_command == "list":
            budgets = await store.list()
            if args.json:
                print(json.dumps([b.to_json() for b in budgets]))
            else:
                print(f"{'SUBJECT':36}  {'USD':>14}  PERIOD")
                for b in budgets:
                    print(f"{b.subject_id!s:36}  {b.budget_usd:>14}  {b.budget_period}")
        elif args.budgets_command == "clear":
            if not await store.clear(args.subject):
                raise CommandError(f"subject {args.subject} has no budget")
            print(f"cleared the budget of subject {args.subject}")
        return 0

    return await _with_pool(settings, act)


def _print_key(raw: str, record: KeyRecord, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"api_key": raw, **record.to_json()}))
        return
    print(raw)
    print(f"  id {record.api_key_id}  prefix {record.key_prefix}  subject {record.subject_id}", file=sys.stderr)
    print("  store it now: it is not shown again", file=sys.stderr)


def _key_table(records: list[KeyRecord]) -> str:
    header = f"{'ID':36}  {'PREFIX':12}  {'STATE':8}  {'RPM/WINDOW':>11}  NAME"
    lines = [header]
    for r in records:
        p = r.policy
        lines.append(
            f"{r.api_key_id!s:36}  {r.key_prefix:12}  {r.state:8}  "
            f"{p.rate_limit_requests:>5}/{p.rate_limit_window_seconds:<5}  {r.name}"
        )
    return "\n".join(lines)


async def _keys(args: argparse.Namespace, settings: Settings) -> int:
    async def act(store: KeyStore) -> int:
        if args.keys_command == "create":
            try:
                policy = KeyPolicy(
                    rate_limit_requests=args.rpm,
                    rate_limit_window_seconds=args.window_seconds,
                    tokens_per_minute=args.tpm,
                    max_concurrent=args.max_concurrent,
                    budget_usd=args.budget_usd,
                    budget_period=args.budget_period or ("month" if args.budget_usd is not None else None),
                    allowed_models=args.models,
                )
                raw, record = await store.create(
                    args.name, subject_id=args.subject, policy=policy,
                    expires_in=timedelta(days=args.expires_in_days) if args.expires_in_days else None,
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            _print_key(raw, record, args.json)
        elif args.keys_command == "list":
            records = await store.list()
            print(json.dumps([r.to_json() for r in records]) if args.json else _key_table(records))
        elif args.keys_command == "revoke":
            record = await store.revoke(args.key)
            print(f"revoked {record.api_key_id} ({record.key_prefix})")
        elif args.keys_command == "rotate":
            grace = timedelta(seconds=args.grace_seconds) if args.grace_seconds else None
            try:
                raw, record = await store.rotate(args.key, grace=grace)
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            old = await store.get(args.key)
            if args.json:
                # As POST /admin/keys/{id}/rotate answers: the new key and the old one.
                print(json.dumps({"api_key": raw, **record.to_json(), "previous": old.to_json()}))
            else:
                _print_key(raw, record, False)
                if old.state == "active" and old.expires_at is not None:
                    print(f"  the old key {old.key_prefix} keeps working until {old.expires_at.isoformat()}",
                          file=sys.stderr)
        return 0

    return await _with_store(settings, act)


async def _migrate(settings: Settings) -> int:
    dsn, _ = resolve_database_url(settings)
    pool = await connect_pool(dsn, min_size=1, max_size=1)
    try:
        async with pool.acquire() as conn:
            applied = await migrate(conn)
    finally:
        await pool.close()
    print(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else ""))
    return 0


def _configure_logging(level: str, fmt: str = "text") -> LogSetup:
    return configure_logging(level, fmt, stream=sys.stderr)


def _secrets(settings: Settings, config: GatewayConfig) -> list[str | None]:
    """Every secret value the configuration holds, so no log line can show one."""
    found: list[str | None] = [settings.admin_token, settings.venice_api_key]
    found += [provider.api_key for provider in config.providers.values()]
    found += [value for provider in config.providers.values() for _, value in provider.headers]
    for url in (settings.database_url, settings.redis_url):
        if url:
            found.append(urlsplit(url).password)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings()
        if args.command == "serve":
            logs = _configure_logging(args.log_level, args.log_format)
            logs.add_secrets([settings.admin_token, settings.venice_api_key])
            config = load_config(settings)
            logs.add_secrets(_secrets(settings, config))
            if args.worker_socket is None:  # a worker shares its port with its siblings
                check_addresses(settings)  # before the embedded database or any line on stdout
            dsn, embedded = resolve_database_url(settings)
            if args.workers > 1:
                refusal = per_worker_limits_refusal(settings, config, args.workers)
                if refusal is not None and not args.per_worker_limits:
                    raise ConfigError(refusal)
                run(supervise_workers(
                    settings, config, dsn, embedded=embedded, workers=args.workers, migrate=not args.no_migrate
                ))
            else:
                run(serve(
                    settings, config, dsn, embedded=embedded, migrate=not args.no_migrate,
                    worker_socket=args.worker_socket,
                ))
            return 0
        _configure_logging("warning")
        if args.command == "migrate":
            return run(_migrate(settings))
        if args.command == "keys":
            return run(_keys(args, settings))
        if args.command == "usage":
            return run(_usage(args, settings))
        if args.command == "budgets":
            return run(_budgets(args, settings))
    except ConfigError as exc:
        print(f"llm-gateway: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (DatabaseUnavailable, EmbeddedUnavailable) as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except AddressUnavailable as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyNotFound as exc:
        print(f"llm-gateway: no key with id or prefix {exc.args[0]!r}", file=sys.stderr)
        return EXIT_FAILURE
    except CommandError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except asyncpg.PostgresError as exc:
        # str() of a server error may add DETAIL/HINT lines: the first line says it.
        print(f"llm-gateway: database error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


