"""What the admin API accepts: JSON bodies and query strings, checked into plain values.

Every refusal is a 400 in the contract's shape whose message names the field and what
it takes (``invalid_json``, ``unknown_field``, ``missing_field``, ``invalid_field``,
``invalid_query``), so an operator can fix the call from the answer alone. The bounds
are the database columns' own (see :class:`gateway.auth.keys.KeyPolicy`), checked here so
that no input can reach PostgreSQL and come back as a 500.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from aiohttp import web

from gateway.admin.audit import ACTIONS
from gateway.auth.keys import (
    BUDGET_PERIODS,
    KEY_STATES,
    MAX_BUDGET_USD,
    MAX_INT,
    MAX_NAME_LEN,
    UNCHANGED,
    Unchanged,
)
from gateway.core.errors import InvalidRequest
from gateway.http.bodies import read_json_body

__all__ = [
    "ADMIN_BODY_LIMIT",
    "AuditQuery",
    "BudgetListQuery",
    "BudgetSet",
    "KeyCreate",
    "KeyListQuery",
    "KeyPatch",
    "Rotation",
    "UsageQuery",
    "parse_audit_query",
    "parse_budget_list_query",
    "parse_budget_set",
    "parse_key_create",
    "parse_key_list_query",
    "parse_key_patch",
    "parse_revoke",
    "parse_rotation",
    "parse_usage_query",
    "read_admin_body",
]

#: Admin bodies are a few hundred bytes; anything near this is a mistake or an attack.
#: The effective limit is the smaller of this and REQUEST_BODY_LIMIT_BYTES.
ADMIN_BODY_LIMIT = 64 * 1024
DEFAULT_PAGE = 100
MAX_PAGE = 500
MAX_MODELS = 1000
MAX_REASON_LEN = 500
#: A rotation's grace period: long enough to roll out a new key, short enough to matter.
MAX_GRACE = timedelta(days=30)
MAX_EXPIRES_IN_DAYS = 36_500
GROUP_BYS = ("key", "model", "day")

_POLICY_INTS = ("rate_limit_requests", "rate_limit_window_seconds", "tokens_per_minute", "max_concurrent")
_NULLABLE_INTS = ("tokens_per_minute", "max_concurrent")
_POLICY_FIELDS = (*_POLICY_INTS, "budget_usd", "budget_period", "allowed_models")
_CREATE_FIELDS = ("name", "subject_id", *_POLICY_FIELDS, "expires_at", "expires_in_days")
_PATCH_FIELDS = ("name", *_POLICY_FIELDS, "expires_at", "expires_in_days")
_BUDGET_FIELDS = ("budget_usd", "budget_period")
#: A subject budget's period when none is sent (as ``llm-gateway budgets set``).
DEFAULT_BUDGET_PERIOD = "month"


def _field_error(name: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{name}' must be {what}", code="invalid_field")


# -- bodies -------------------------------------------------------------------------
async def read_admin_body(request: web.Request, limit: int, *, optional: bool = False) -> dict[str, Any]:
    """The JSON object sent (400/413 otherwise); with ``optional``, no body means ``{}``.

    Optional bodies are those of actions (revoke, rotate) whose every field has a default.
    """
    if optional and not request.body_exists:
        return {}
    return await read_json_body(request, limit)


def _check_fields(body: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidRequest(
            f"unknown field '{unknown[0]}' (allowed: {', '.join(allowed)})", code="unknown_field"
        )


def _int(body: Mapping[str, Any], name: str, *, nullable: bool, low: int = 1, high: int = MAX_INT) -> int | None:
    value = body[name]
    if value is None and nullable:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON Schema counts 5.0 as an integer, and so do we
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        null = " or null" if nullable else ""
        raise _field_error(name, f"a whole number from {low} to {high}{null}")
    return value


def _text(body: Mapping[str, Any], name: str, *, max_len: int) -> str:
    value = body[name]
    if not isinstance(value, str) or not value.strip() or len(value) > max_len or "\x00" in value:
        raise _field_error(name, f"a non-blank string of at most {max_len} characters")
    return value


def _uuid(value: Any, name: str) -> uuid.UUID:
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise _field_error(name, "a UUID")


def _datetime(value: Any, name: str) -> datetime:
    if isinstance(value, str) and "\x00" not in value:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if parsed.tzinfo is not None:
                return parsed
    raise _field_error(name, "an ISO 8601 date-time with a time zone (e.g. 2030-01-31T00:00:00Z)")


def _policy(body: Mapping[str, Any]) -> dict[str, Any]:
    """The policy fields present in ``body``, checked; absent fields are not in the result."""
    out: dict[str, Any] = {}
    for name in _POLICY_INTS:
        if name in body:
            out[name] = _int(body, name, nullable=name in _NULLABLE_INTS)
    if "budget_usd" in body:
        value = body["budget_usd"]
        if value is None:
            out["budget_usd"] = None
        elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_USD:
            raise _field_error("budget_usd", f"a number from 0 to {MAX_BUDGET_USD} or null")
        else:
            out["budget_usd"] = Decimal(str(value))
    if "budget_period" in body:
        value = body["budget_period"]
        if value is not None and value not in BUDGET_PERIODS:
            raise _field_error("budget_period", f"one of {', '.join(BUDGET_PERIODS)} or null")
        out["budget_period"] = value
    if "allowed_models" in body:
        value = body["allowed_models"]
        if value is not None and (
            not isinstance(value, list)
            or len(value) > MAX_MODELS
            or not all(isinstance(m, str) and m.strip() and "\x00" not in m and len(m) <= 256 for m in value)
        ):
            raise _field_error("allowed_models", f"a list of at most {MAX_MODELS} model names (wildcards ok) or null")
        out["allowed_models"] = tuple(value) if value is not None else None
    return out


def _expiry(body: Mapping[str, Any], *, now: datetime) -> datetime | Unchanged | None:
    """``expires_at`` or ``expires_in_days`` (not both); UNCHANGED when neither is sent."""
    if "expires_at" in body and "expires_in_days" in body:
        raise InvalidRequest("send 'expires_at' or 'expires_in_days', not both", code="invalid_field")
    if "expires_in_days" in body:
        days = _int(body, "expires_in_days", nullable=True, high=MAX_EXPIRES_IN_DAYS)
        return None if days is None else now + timedelta(days=days)
    if "expires_at" in body:
        return None if body["expires_at"] is None else _datetime(body["expires_at"], "expires_at")
    return UNCHANGED


@dataclass(frozen=True, slots=True)
class KeyCreate:
    """A checked ``POST /admin/keys`` body."""

    name: str
    subject_id: uuid.UUID | None
    policy: dict[str, Any]
    expires_at: datetime | None


def parse_key_create(body: Mapping[str, Any]) -> KeyCreate:
    _check_fields(body, _CREATE_FIELDS)
    if "name" not in body:
        raise InvalidRequest("'name' is required", code="missing_field")
    now = datetime.now(timezone.utc)
    expires_at = _expiry(body, now=now)
    if isinstance(expires_at, datetime) and expires_at <= now:
        raise _field_error("expires_at", "in the future")
    policy = _policy(body)
    if policy.get("budget_usd") is not None and policy.get("budget_period") is None:
        policy["budget_period"] = "month"  # as the CLI does
    return KeyCreate(
        name=_text(body, "name", max_len=MAX_NAME_LEN),
        subject_id=_uuid(body["subject_id"], "subject_id") if body.get("subject_id") is not None else None,
        policy=policy,
        expires_at=expires_at if isinstance(expires_at, datetime) else None,
    )


@dataclass(frozen=True, slots=True)
class KeyPatch:
    """A checked ``PATCH /admin/keys/{id}`` body: only the fields sent."""

    name: str | None
    policy: dict[str, Any]
    #: UNCHANGED: leave alone; None: never expires; a datetime (a past one disables the key).
    expires_at: datetime | Unchanged | None

    @property
    def empty(self) -> bool:
        return self.name is None and not self.policy and isinstance(self.expires_at, Unchanged)


def parse_key_patch(body: Mapping[str, Any]) -> KeyPatch:
    _check_fields(body, _PATCH_FIELDS)
    for name in ("rate_limit_requests", "rate_limit_window_seconds"):
        if body.get(name, 0) is None:
            raise _field_error(name, f"a whole number from 1 to {MAX_INT}")
    patch = KeyPatch(
        name=_text(body, "name", max_len=MAX_NAME_LEN) if "name" in body else None,
        policy=_policy(body),
        expires_at=_expiry(body, now=datetime.now(timezone.utc)),
    )
    if patch.empty:
        raise InvalidRequest(f"nothing to change: send at least one of {', '.join(_PATCH_FIELDS)}", code="missing_field")
    return patch


@dataclass(frozen=True, slots=True)
class Rotation:
    """A checked ``POST /admin/keys/{id}/rotate`` body."""

    grace: timedelta | None = None
    reason: str | None = None


def _reason(body: Mapping[str, Any]) -> str | None:
    if body.get("reason") is None:
        return None
    return _text(body, "reason", max_len=MAX_REASON_LEN)


def parse_rotation(body: Mapping[str, Any]) -> Rotation:
    _check_fields(body, ("grace_seconds", "reason"))
    grace = None
    if body.get("grace_seconds") is not None:
        seconds = _int(body, "grace_seconds", nullable=False, low=0, high=int(MAX_GRACE.total_seconds()))
        grace = timedelta(seconds=seconds) if seconds else None  # 0: revoke at once
    return Rotation(grace=grace, reason=_reason(body))


def parse_revoke(body: Mapping[str, Any]) -> str | None:
    """The optional ``reason`` of a revocation."""
    _check_fields(body, ("reason",))
    return _reason(body)


@dataclass(frozen=True, slots=True)
class BudgetSet:
    """A checked ``PUT /admin/budgets/{subject_id}`` body: the whole budget."""

    budget_usd: Decimal
    budget_period: str


def parse_budget_set(body: Mapping[str, Any]) -> BudgetSet:
    """``budget_usd`` (required, 0 blocks every call) and ``budget_period`` (default month).

    A PUT replaces the budget, so neither may be null: clearing is ``DELETE``.
    """
    _check_fields(body, _BUDGET_FIELDS)
    if "budget_usd" not in body:
        raise InvalidRequest("'budget_usd' is required", code="missing_field")
    value = body["budget_usd"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_USD:
        raise _field_error("budget_usd", f"a number from 0 to {MAX_BUDGET_USD}")
    period = body.get("budget_period", DEFAULT_BUDGET_PERIOD)
    if period not in BUDGET_PERIODS:
        raise _field_error("budget_period", f"one of {', '.join(BUDGET_PERIODS)}")
    return BudgetSet(budget_usd=Decimal(str(value)), budget_period=period)


# -- query strings ------------------------------------------------------------------
def _query_error(name: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"query parameter '{name}' must be {what}", code="invalid_query")


def _query_uuid(query: Mapping[str, str], name: str) -> uuid.UUID | None:
    raw = query.get(name)
    if raw is None:
        return None
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise _query_error(name, "a UUID") from None


def _query_int(query: Mapping[str, str], name: str, default: int | None, low: int, high: int) -> int | None:
    raw = query.get(name)
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or not low <= int(raw) <= high:
        raise _query_error(name, f"a whole number from {low} to {high}")
    return int(raw)


def _query_choice(query: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    raw = query.get(name)
    if raw is not None and raw not in choices:
        raise _query_error(name, f"one of {', '.join(choices)}")
    return raw


def _query_time(query: Mapping[str, str], name: str) -> datetime | None:
    raw = query.get(name)
    if raw is None:
        return None
    try:
        parsed = datetime.fromisoformat(raw)
    except ValueError:
        raise _query_error(name, "an ISO 8601 date or date-time") from None
    # A bare date or a date-time without a zone is taken as UTC.
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def _limit(query: Mapping[str, str]) -> int:
    value = _query_int(query, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    assert value is not None
    return value


@dataclass(frozen=True, slots=True)
class KeyListQuery:
    subject_id: uuid.UUID | None = None
    state: str | None = None
    limit: int = DEFAULT_PAGE
    after: uuid.UUID | None = None


def parse_key_list_query(query: Mapping[str, str]) -> KeyListQuery:
    return KeyListQuery(
        subject_id=_query_uuid(query, "subject_id"),
        state=_query_choice(query, "state", KEY_STATES),
        limit=_limit(query),
        after=_query_uuid(query, "after"),
    )


@dataclass(frozen=True, slots=True)
class BudgetListQuery:
    limit: int = DEFAULT_PAGE
    after: uuid.UUID | None = None


def parse_budget_list_query(query: Mapping[str, str]) -> BudgetListQuery:
    return BudgetListQuery(limit=_limit(query), after=_query_uuid(query, "after"))


@dataclass(frozen=True, slots=True)
class AuditQuery:
    limit: int = DEFAULT_PAGE
    after: int | None = None
    api_key_id: uuid.UUID | None = None
    action: str | None = None


def parse_audit_query(query: Mapping[str, str]) -> AuditQuery:
    return AuditQuery(
        limit=_limit(query),
        after=_query_int(query, "after", None, 1, 2**63 - 1),
        api_key_id=_query_uuid(query, "api_key_id"),
        action=_query_choice(query, "action", ACTIONS),
    )


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """``GET /admin/usage``: grouping, a half-open time range [since, until), one key."""

    group_by: str = "key"
    since: datetime | None = None
    until: datetime | None = None
    api_key_id: uuid.UUID | None = None


def parse_usage_query(query: Mapping[str, str]) -> UsageQuery:
    since, until = _query_time(query, "since"), _query_time(query, "until")
    if since is not None and until is not None and until <= since:
        raise _query_error("until", "later than 'since'")
    return UsageQuery(
        group_by=_query_choice(query, "group_by", GROUP_BYS) or "key",
        since=since,
        until=until,
        api_key_id=_query_uuid(query, "api_key_id"),
    )
