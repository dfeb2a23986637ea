"""Settings from the environment (contract §3), read once at start-up.

Every problem raises :class:`ConfigError` with one line naming the variable and what it
takes, so ``serve`` can print it and exit. The config file's models live in
:mod:`gateway.core.config`, which also reads ``${NAME}`` (and ``NAME_FILE``) through
:func:`env_or_file`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_VENICE_BASE_URL", "ConfigError", "Settings", "env_or_file", "file_source", "load_settings"]

DEFAULT_VENICE_BASE_URL = "https://api.venice.ai/api/v1"


class ConfigError(ValueError):
    """A setting is missing or wrong; the message is one line for the operator."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything read from the environment, validated."""

    bind_host: str = "0.0.0.0"
    bind_port: int = 3000
    management_host: str = "127.0.0.1"
    management_port: int = 3001
    database_url: str | None = None
    redis_url: str | None = None
    config_path: Path | None = None
    venice_api_key: str | None = None
    venice_base_url: str = DEFAULT_VENICE_BASE_URL
    admin_token: str | None = None
    #: Bearer token ``GET /metrics`` requires (``METRICS_TOKEN``); None: no token needed.
    metrics_token: str | None = None
    #: Whether ``BIND_ADDR`` was given: with the embedded database (development) and no
    #: ``BIND_ADDR``, the data plane listens on 127.0.0.1 only.
    bind_addr_given: bool = False
    #: Who the admin token is in the audit trail; None: a fingerprint of the token.
    admin_token_name: str | None = None
    request_timeout: float = 120.0
    body_limit: int = 1_048_576
    upstream_max_retries: int = 2
    capture_genai_content: bool = False
    otel_service_name: str = "llm-gateway"
    #: Full OTLP/HTTP traces URL (``.../v1/traces``); None: no spans are made at all.
    otel_endpoint: str | None = None
    shutdown_grace: float = 30.0
    #: How long a stored Responses API answer (``store`` true) is kept, in days.
    responses_retention_days: float = 30.0
    #: Requests in flight on /v1/* before 503 overloaded; None: sized from the open-file limit.
    max_in_flight: int | None = None
    #: A client connection that completes no request head for this long is closed (slowloris).
    client_idle_timeout: float = 75.0
    #: The file VENICE_API_KEY came from (re-read when it changes), if it came from one.
    venice_api_key_file: Path | None = None
    cors_origins: tuple[str, ...] = ("*",)
    management_cors_origins: tuple[str, ...] = ()
    home: Path = field(default_factory=lambda: Path("~/.local/share/llm-gateway").expanduser())
    #: Where the billing journal lives (``BILLING_JOURNAL_DIR``); None: ``home/billing-journal``.
    billing_journal_dir: Path | None = None
    #: How often billing ships its journal to the ledger (``BILLING_SHIP_INTERVAL_SECONDS``).
    billing_ship_interval: float = 1.0
    #: The journal's group-commit window (``BILLING_FSYNC_INTERVAL_SECONDS``): what a power
    #: cut may lose of calls already answered (a process crash loses nothing).
    billing_fsync_interval: float = 0.02
    #: How long a budget reservation of a process that died holds before it expires.
    budget_reservation_ttl: float = 600.0
    #: Share of a budget one process may hold as a lease (0: a reservation per call), and
    #: how long one lease admits calls (docs/billing.md, "Leases").
    budget_lease_fraction: float = 0.02
    budget_lease_seconds: float = 1.0
    #: How long a lease past its time, cut down to two calls' room, keeps admitting a
    #: seldom-called budget's calls (0: retired at once).
    budget_lease_standby_seconds: float = 30.0

    @property
    def journal_dir(self) -> Path:
        """The billing journal's root directory."""
        return self.billing_journal_dir or self.home / "billing-journal"


def env_or_file(environ: Mapping[str, str], name: str) -> str | None:
    """``NAME`` from the environment, or the contents of the file named by ``NAME_FILE``."""
    value = environ.get(name)
    if value not in (None, ""):
        return value
    path = environ.get(f"{name}_FILE")
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"{name}_FILE: cannot read {path}: {exc.strerror}") from None
    return None


def file_source(environ: Mapping[str, str], name: str) -> Path | None:
    """The ``NAME_FILE`` path when ``NAME`` itself is unset, so the value can be re-read."""
    if environ.get(name) not in (None, ""):
        return None
    path = environ.get(f"{name}_FILE")
    return Path(path) if path else None


def _addr(environ: Mapping[str, str], name: str, default: str) -> tuple[str, int]:
    raw = environ.get(name) or default
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name}: expected HOST:PORT, got {raw!r}")
    return host.strip("[]"), int(port)


def _number(environ: Mapping[str, str], name: str, default: float, *, integer: bool, minimum: float) -> Any:
    raw = environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "a whole number" if integer else "a number"
        raise ConfigError(f"{name}: expected {kind} >= {minimum:g}, got {raw!r}") from None
    # float() takes "nan" and "inf": a NaN timeout would compare false everywhere.
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name}: expected a value >= {minimum:g}, got {raw!r}")
    return value


def _fraction(environ: Mapping[str, str], name: str, default: float) -> float:
    value: float = _number(environ, name, default, integer=False, minimum=0.0)
    if value > 0.5:
        raise ConfigError(f"{name}: expected a share of a budget from 0 to 0.5, got {environ.get(name)!r}")
    return value


def _bool(environ: Mapping[str, str], name: str) -> bool:
    raw = (environ.get(name) or "false").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}: expected true or false, got {raw!r}")


#: A browser's Origin: scheme://host[:port], no path (a trailing "/" would never match).
_ORIGIN = re.compile(r"https?://[^/\s,]+")


def _origins(environ: Mapping[str, str], name: str, default: str) -> tuple[str, ...]:
    raw = environ.get(name, default)
    origins = tuple(o.strip() for o in raw.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ConfigError(f"{name}: expected '*' or origins like https://app.example.com, got {origin!r}")
    return origins


def _otlp_traces_url(environ: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL from the standard variables, or None when not exporting.

    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as is; ``OTEL_EXPORTER_OTLP_ENDPOINT``
    is a base URL that gets ``/v1/traces``, as the OpenTelemetry specification says.
    """
    if (environ.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
        return None
    if (environ.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower() == "none":
        return None
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        url = environ.get(name)
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{name}: expected an http(s) URL of an OTLP/HTTP receiver, got {url!r}")
        return url if name.endswith("TRACES_ENDPOINT") else f"{url.rstrip('/')}/v1/traces"
    return None


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate the environment; raises ConfigError naming the variable."""
    env = os.environ if environ is None else environ
    bind_addr_given = bool(env.get("BIND_ADDR"))
    # Development (embedded database, seeded public dev key): loopback unless told otherwise,
    # so the dev key cannot spend a real provider account from across the network.
    dev_mode = not env_or_file(env, "DATABASE_URL")
    bind_host, bind_port = _addr(env, "BIND_ADDR", "127.0.0.1:3000" if dev_mode else "0.0.0.0:3000")
    mgmt_host, mgmt_port = _addr(env, "MANAGEMENT_BIND_ADDR", "127.0.0.1:3001")
    config_raw = env.get("GATEWAY_CONFIG")
    config_path: Path | None
    if config_raw:
        config_path = Path(config_raw)
        if not config_path.is_file():
            raise ConfigError(f"GATEWAY_CONFIG: no such file {config_raw!r}")
    else:
        default = Path("conf/gateway.yaml")
        config_path = default if default.is_file() else None
    retries_raw = env.get("UPSTREAM_MAX_RETRIES") or env.get("VENICE_MAX_RETRIES")
    retries_name = "UPSTREAM_MAX_RETRIES" if env.get("UPSTREAM_MAX_RETRIES") else "VENICE_MAX_RETRIES"
    management_cors = _origins(env, "MANAGEMENT_CORS_ORIGINS", "")
    if "*" in management_cors:
        raise ConfigError("MANAGEMENT_CORS_ORIGINS: '*' is refused on the management plane; list origins")
    database_url = env_or_file(env, "DATABASE_URL")
    if database_url and not database_url.startswith(("postgres://", "postgresql://")):
        raise ConfigError("DATABASE_URL: expected a postgresql:// URL")
    redis_url = env_or_file(env, "REDIS_URL")
    if redis_url and not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("REDIS_URL: expected a redis:// URL")
    home_raw = env.get("LLM_GATEWAY_HOME")
    return Settings(
        bind_host=bind_host,
        bind_port=bind_port,
        management_host=mgmt_host,
        management_port=mgmt_port,
        database_url=database_url,
        redis_url=redis_url,
        config_path=config_path,
        venice_api_key=env_or_file(env, "VENICE_API_KEY"),
        venice_base_url=env.get("VENICE_BASE_URL") or DEFAULT_VENICE_BASE_URL,
        admin_token=env_or_file(env, "ADMIN_TOKEN"),
        metrics_token=env_or_file(env, "METRICS_TOKEN"),
        bind_addr_given=bind_addr_given,
        admin_token_name=env.get("ADMIN_TOKEN_NAME") or None,
        request_timeout=_number(env, "REQUEST_TIMEOUT_SECONDS", 120.0, integer=False, minimum=0.001),
        body_limit=_number(env, "REQUEST_BODY_LIMIT_BYTES", 1_048_576, integer=True, minimum=1),
        upstream_max_retries=_number(
            {retries_name: retries_raw or ""}, retries_name, 2, integer=True, minimum=0
        ),
        capture_genai_content=_bool(env, "CAPTURE_GENAI_CONTENT"),
        otel_service_name=env.get("OTEL_SERVICE_NAME") or "llm-gateway",
        otel_endpoint=_otlp_traces_url(env),
        shutdown_grace=_number(env, "SHUTDOWN_GRACE_SECONDS", 30.0, integer=False, minimum=0),
        responses_retention_days=_number(env, "RESPONSES_RETENTION_DAYS", 30.0, integer=False, minimum=0.0001),
        max_in_flight=_number(env, "MAX_IN_FLIGHT", 0, integer=True, minimum=1) or None,
        client_idle_timeout=_number(env, "CLIENT_IDLE_TIMEOUT_SECONDS", 75.0, integer=False, minimum=0.1),
        venice_api_key_file=file_source(env, "VENICE_API_KEY"),
        cors_origins=_origins(env, "CORS_ALLOWED_ORIGINS", "*"),
        management_cors_origins=management_cors,
        home=Path(home_raw).expanduser() if home_raw else Settings().home,
        billing_journal_dir=Path(journal_raw).expanduser() if (journal_raw := env.get("BILLING_JOURNAL_DIR")) else None,
        billing_ship_interval=_number(env, "BILLING_SHIP_INTERVAL_SECONDS", 1.0, integer=False, minimum=0.001),
        billing_fsync_interval=_number(env, "BILLING_FSYNC_INTERVAL_SECONDS", 0.02, integer=False, minimum=0.0),
        budget_reservation_ttl=_number(env, "BUDGET_RESERVATION_TTL_SECONDS", 600.0, integer=False, minimum=1),
        budget_lease_fraction=_fraction(env, "BUDGET_LEASE_FRACTION", 0.02),
        budget_lease_seconds=_number(env, "BUDGET_LEASE_SECONDS", 1.0, integer=False, minimum=0.01),
        budget_lease_standby_seconds=_number(env, "BUDGET_LEASE_STANDBY_SECONDS", 30.0, integer=False, minimum=0.0),
    )
