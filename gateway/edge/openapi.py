"""The OpenAPI 3.1 documents of both planes, kept by hand and served at ``GET /openapi.json``.

Hand-kept because the routes are few and their contract matters more than their code;
``tests/test_openapi.py`` keeps each document true: every route registered on a plane
must be documented there and every documented operation must be registered, and
schemathesis calls every operation with generated input and finds no server error.
A new route therefore needs its entry here, in the same commit.

Each document is built once per app and served as prebuilt bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from gateway.admin.audit import ACTIONS
from gateway.admin.cache import KEY_PATTERN, MAX_GROUP_LEN
from gateway.admin.input import DEFAULT_BUDGET_PERIOD, GROUP_BYS, MAX_GRACE, MAX_PAGE
from gateway.auth.keys import BUDGET_PERIODS, KEY_STATES, MAX_BUDGET_USD, MAX_INT, MAX_NAME_LEN

__all__ = ["data_plane_document", "document_handler", "management_document"]

OPENAPI_VERSION = "3.1.0"
API_VERSION = "0.1.0"

JSON = "application/json"
_ERROR_REF = {"$ref": "#/components/schemas/Error"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json_body(_ERROR_REF, description)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI 3.1 (JSON Schema 2020-12) spelling of "this, or null"."""
    return {"anyOf": [schema, {"type": "null"}]}


_INT = {"type": "integer", "minimum": 1, "maximum": MAX_INT}
_UUID = {"type": "string", "format": "uuid"}
_DATETIME = {"type": "string", "format": "date-time"}
_TEXT_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_LEN, "pattern": r"\S"}

# ----------------------------------------------------------------------- shared schemas
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_HEALTH = {
    "type": "object", "required": ["status"],
    "properties": {"status": {"const": "ok"}},
}


def _common_paths(tag: str) -> dict[str, Any]:
    return {
        "/healthz": {"get": {
            "operationId": f"{tag}Healthz", "summary": "Alive while the process runs (no dependency checked)",
            "tags": ["health"], "security": [],
            "responses": {"200": _json_body(_ref("Health"), "alive")},
        }},
        "/openapi.json": {"get": {
            "operationId": f"{tag}OpenApi", "summary": "This document", "tags": ["meta"], "security": [],
            "responses": {"200": _json_body({"type": "object"}, "the OpenAPI document of this plane")},
        }},
    }


# ----------------------------------------------------------------------- management
_HTML = {"text/html": {"schema": {"type": "string"}}}
#: The console's pages (gateway/admin/console): HTML for a browser with a session, not
#: an API; listed so the document names every route of the plane.
_CONSOLE_PAGES = (
    ("/ui", "consoleRoot", "Redirect to /ui/"),
    ("/ui/", "consoleOverview", "Overview: today and 7 days, top spenders, open breakers"),
    ("/ui/keys", "consoleKeys", "Keys: search, filter, create"),
    ("/ui/keys/{id}", "consoleKey", "One key: edit, rotate, revoke, its usage and audit"),
    ("/ui/subjects", "consoleSubjects", "Spend against budget per subject and key"),
    ("/ui/usage", "consoleUsage", "Usage over a range, grouped by day, model, key, subject or provider"),
    ("/ui/usage.csv", "consoleUsageCsv", "The Usage page's numbers as CSV"),
    ("/ui/providers", "consoleProviders", "Deployments with circuit state, latency and error rate"),
    ("/ui/cache", "consoleCache", "Response cache sizes, hit rate, purge"),
    ("/ui/audit", "consoleAudit", "The audit trail, filterable"),
    ("/ui/static/{name}", "consoleAsset", "The console's CSS and script (cached for a year: the URL has a hash)"),
    ("/ui/login", "consoleSignInForm", "The sign-in form"),
    ("/ui/oidc/start", "consoleSignOnStart", "Single sign-on: off to the identity provider (admin.oidc)"),
    ("/ui/oidc/callback", "consoleSignOnCallback", "Single sign-on: back from the identity provider"),
)
_PUBLIC_CONSOLE = ("/ui", "/ui/static/{name}", "/ui/login", "/ui/oidc/start", "/ui/oidc/callback")


def _console_paths() -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path, op_id, summary in _CONSOLE_PAGES:
        op: dict[str, Any] = {
            "operationId": op_id, "summary": summary, "tags": ["console"],
            "security": [] if path in _PUBLIC_CONSOLE else [{"consoleSession": []}],
            "responses": {"200": {"description": "the page", "content": _HTML},
                          "303": {"description": "no session: to /ui/login"}},
        }
        if "{" in path:
            name = path[path.index("{") + 1:path.index("}")]
            op["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]
        paths[path] = {"get": op}
    form = {"content": {"application/x-www-form-urlencoded": {"schema": {"type": "object"}}}}
    paths["/ui/login"]["post"] = {
        "operationId": "consoleSignIn", "summary": "Sign in with the admin token: a session cookie",
        "tags": ["console"], "security": [], "requestBody": form,
        "responses": {"303": {"description": "signed in (Set-Cookie)"},
                      "401": {"description": "wrong token", "content": _HTML},
                      "403": {"description": "from another site, or token sign-in disabled", "content": _HTML}},
    }
    paths["/ui/logout"] = {"post": {
        "operationId": "consoleSignOut", "summary": "End the session everywhere (csrf_token field)",
        "tags": ["console"], "security": [{"consoleSession": []}], "requestBody": form,
        "responses": {"303": {"description": "signed out"},
                      "403": {"description": "bad CSRF token", "content": _HTML}},
    }}
    return paths


_POLICY_PROPERTIES: dict[str, Any] = {
    "rate_limit_requests": {**_INT, "description": "requests per window"},
    "rate_limit_window_seconds": {**_INT, "description": "length of the request window"},
    "tokens_per_minute": _nullable(_INT),
    "max_concurrent": _nullable(_INT),
    "budget_usd": _nullable({"type": "number", "minimum": 0, "maximum": float(MAX_BUDGET_USD)}),
    "budget_period": _nullable({"enum": list(BUDGET_PERIODS)}),
    "allowed_models": _nullable({
        "type": "array", "maxItems": 1000,
        "items": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": r"\S"},
        "description": "model names this key may use; '*' wildcards allowed; null: any",
    }),
    "expires_at": _nullable({**_DATETIME, "description": "with a time zone"}),
    "expires_in_days": _nullable({"type": "integer", "minimum": 1, "maximum": 36500}),
}

_KEY = {
    "type": "object",
    "required": [
        "api_key_id", "subject_id", "name", "key_prefix", "state", "rate_limit_requests",
        "rate_limit_window_seconds", "tokens_per_minute", "max_concurrent", "budget_usd", "budget_period",
        "allowed_models", "created_at", "last_used_at", "revoked_at", "expires_at",
    ],
    "properties": {
        "api_key_id": _UUID,
        "subject_id": _UUID,
        "name": {"type": "string"},
        "key_prefix": {"type": "string", "minLength": 12, "maxLength": 12},
        "state": {"enum": list(KEY_STATES)},
        "rate_limit_requests": {"type": "integer"},
        "rate_limit_window_seconds": {"type": "integer"},
        "tokens_per_minute": {"type": ["integer", "null"]},
        "max_concurrent": {"type": ["integer", "null"]},
        "budget_usd": {"type": ["number", "null"]},
        "budget_period": _nullable({"enum": list(BUDGET_PERIODS)}),
        "allowed_models": {"type": ["array", "null"], "items": {"type": "string"}},
        "created_at": _DATETIME,
        "last_used_at": _nullable(_DATETIME),
        "revoked_at": _nullable(_DATETIME),
        "expires_at": _nullable(_DATETIME),
    },
}

_NEW_KEY = {
    "allOf": [_ref("Key"), {
        "type": "object", "required": ["api_key"],
        "properties": {"api_key": {"type": "string", "description": "the raw key: shown this once, never again"}},
    }],
}

_ROTATED_KEY = {
    "allOf": [_ref("NewKey"), {
        "type": "object", "required": ["previous"],
        "properties": {"previous": _ref("Key")},
    }],
}


def _list_of(item: dict[str, Any], id_schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["object", "data", "has_more", "first_id", "last_id"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "has_more": {"type": "boolean"},
            "first_id": _nullable(id_schema),
            "last_id": _nullable(id_schema),
        },
    }


_KEY_CREATE = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {"name": _TEXT_NAME, "subject_id": _nullable(_UUID), **_POLICY_PROPERTIES},
}
_KEY_PATCH = {
    "type": "object", "additionalProperties": False, "minProperties": 1,
    "properties": {"name": _TEXT_NAME, **_POLICY_PROPERTIES},
}
_REASON = _nullable({"type": "string", "minLength": 1, "maxLength": 500, "pattern": r"\S"})
_ROTATE = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "grace_seconds": _nullable({
            "type": "integer", "minimum": 0, "maximum": int(MAX_GRACE.total_seconds()),
            "description": "the old key keeps working this long; 0 or absent: revoked at once",
        }),
        "reason": _REASON,
    },
}
_REVOKE = {"type": "object", "additionalProperties": False, "properties": {"reason": _REASON}}

_SUBJECT_BUDGET = {
    "type": "object",
    "required": ["subject_id", "budget_usd", "budget_period", "created_at", "updated_at"],
    "properties": {
        "subject_id": _UUID,
        "budget_usd": {"type": "number", "minimum": 0},
        "budget_period": {"enum": list(BUDGET_PERIODS)},
        "created_at": _DATETIME,
        "updated_at": _DATETIME,
    },
}
_BUDGET_SET = {
    "type": "object", "additionalProperties": False, "required": ["budget_usd"],
    "properties": {
        "budget_usd": {
            "type": "number", "minimum": 0, "maximum": float(MAX_BUDGET_USD),
            "description": "USD per period for all the subject's keys together; 0 refuses every call",
        },
        "budget_period": {
            "enum": list(BUDGET_PERIODS), "default": DEFAULT_BUDGET_PERIOD,
            "description": "day and month are UTC calendar periods; total is all time",
        },
    },
}

_AUDIT_ENTRY = {
    "type": "object",
    "required": ["id", "at", "actor", "action", "api_key_id", "request_id", "remote", "detail"],
    "properties": {
        "id": {"type": "integer"},
        "at": _DATETIME,
        "actor": {"type": "string", "description": "ADMIN_TOKEN_NAME, or token:<first 12 hex of its SHA-256>"},
        "action": {"enum": list(ACTIONS)},
        "api_key_id": _nullable(_UUID),
        "request_id": {"type": ["string", "null"]},
        "remote": {"type": ["string", "null"]},
        "detail": {"type": "object"},
    },
}

_USAGE_NUMBERS = {
    "requests": {"type": "integer", "minimum": 0},
    "input_tokens": {"type": "integer", "minimum": 0},
    "output_tokens": {"type": "integer", "minimum": 0},
    "cost_usd": {"type": "number", "minimum": 0},
}
_USAGE_REPORT = {
    "type": "object",
    "required": ["object", "group_by", "since", "until", "api_key_id", "data", "totals"],
    "properties": {
        "object": {"const": "usage_report"},
        "group_by": {"enum": list(GROUP_BYS)},
        "since": _nullable(_DATETIME),
        "until": _nullable(_DATETIME),
        "api_key_id": _nullable(_UUID),
        "data": {"type": "array", "items": {
            "type": "object", "required": ["group", *_USAGE_NUMBERS],
            "properties": {
                "group": {"type": "string", "description": "api_key_id, model name, or YYYY-MM-DD (UTC)"},
                **_USAGE_NUMBERS,
            },
        }},
        "totals": {"type": "object", "required": list(_USAGE_NUMBERS), "properties": _USAGE_NUMBERS},
    },
}

_PROVIDERS = {
    "type": "object",
    "required": ["providers", "deployments"],
    "properties": {
        "providers": {"type": "array", "items": {
            "type": "object", "required": ["name", "type", "base_url"],
            "properties": {
                "name": {"type": "string"}, "type": {"type": "string"},
                "base_url": {"type": ["string", "null"], "description": "without credentials"},
            },
        }},
        "deployments": {"type": "array", "items": {
            "type": "object",
            "required": [
                "id", "provider", "model", "model_groups", "price", "circuit_state", "latency_ms",
                "error_rate", "recent_requests",
            ],
            "properties": {
                "id": {"type": "string", "description": "provider/model"},
                "provider": {"type": "string"},
                "model": {"type": "string"},
                "model_groups": {"type": "array", "items": {
                    "type": "object", "required": ["name", "priority", "weight"],
                    "properties": {
                        "name": {"type": "string"}, "priority": {"type": "integer"}, "weight": {"type": "number"},
                    },
                }},
                "price": _nullable({
                    "type": "object", "required": ["input_per_mtok", "output_per_mtok"],
                    "properties": {"input_per_mtok": {"type": "number"}, "output_per_mtok": {"type": "number"}},
                }),
                "circuit_state": {"enum": ["closed", "half-open", "open", "unknown"]},
                "latency_ms": {"type": ["number", "null"]},
                "error_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
                "recent_requests": {"type": ["integer", "null"]},
            },
        }},
    },
}

_CACHE_STATS = {
    "type": "object",
    "required": ["entries", "bytes", "max_bytes", "vectors", "shared", "counters", "policies"],
    "properties": {
        "entries": {"type": "integer"}, "bytes": {"type": "integer"}, "max_bytes": {"type": "integer"},
        "vectors": {"type": "integer"}, "shared": {"type": "boolean"},
        "shared_keys_known": {"type": "integer"}, "shared_index_live": {"type": "boolean"},
        "counters": {"type": "object", "additionalProperties": {"type": "number"}},
        "embedder": _nullable({"type": "string"}),
        "policies": {"type": "object", "additionalProperties": {"type": "object"}},
        "client_opt_in": {"type": "boolean"},
    },
}
_CACHE_PURGED = {
    "type": "object",
    "required": ["purged"],
    "properties": {"purged": {
        "type": "object", "required": ["memory", "shared"],
        "properties": {"memory": {"type": "integer", "minimum": 0}, "shared": {"type": "integer", "minimum": -1}},
    }},
}

_ADMIN_ERRORS = {
    "401": _error("missing or wrong admin token, or an ended console session (invalid_admin_token)"),
    "403": _error("no ADMIN_TOKEN configured: admin API disabled (admin_disabled); with a console session: "
                  "a change without its X-CSRF-Token (csrf_failed) or by a viewer (read_only)"),
    "503": _error("PostgreSQL is unreachable (database_unavailable); nothing was changed; Retry-After"),
}
_BAD_REQUEST = {"400": _error("invalid_json, unknown_field, missing_field, invalid_field or invalid_query")}
_TOO_LARGE = {"413": _error("body over the limit (request_too_large)")}
_NOT_FOUND = {"404": _error("no key with that id or prefix (key_not_found)")}

_NO_BUDGET = {"404": _error("the subject has no budget (budget_not_found)")}
_SUBJECT_PARAM = {
    "name": "subject_id", "in": "path", "required": True,
    "description": "the subject (tenant) UUID shared by its keys", "schema": _UUID,
}
_BAD_SUBJECT = {"400": _error("subject_id is not a UUID (invalid_field), or a bad query (invalid_query)")}

_KEY_ID_PARAM = {
    "name": "id", "in": "path", "required": True,
    "description": "the key's id (UUID) or its 12-character prefix",
    "schema": {"type": "string"},
}


def _query_param(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_LIMIT_PARAM = _query_param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}, "page size (default 100)")


def _admin_op(op_id: str, summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "operationId": op_id, "summary": summary, "tags": ["admin"],
        "responses": {**responses, **_ADMIN_ERRORS}, **extra,
    }


def management_document() -> dict[str, Any]:
    """The management plane: health, this document, and the admin API."""
    key_response = {"200": _json_body(_ref("Key"), "the key (never its hash)")}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llm-gateway management plane", "version": API_VERSION,
            "description": (
                "Keys, subject budgets, audit, usage, providers and the response cache. "
                "/admin/* needs Authorization: Bearer $ADMIN_TOKEN, or a console session "
                "(cookie, plus X-CSRF-Token on a change; a viewer may only read). "
                "/ui/ is the admin console (HTML)."
            ),
        },
        "security": [{"adminToken": []}, {"consoleSession": []}],
        "paths": {
            **_common_paths("management"),
            **_console_paths(),
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus metrics (text exposition format)",
                "tags": ["health"], "security": [],
                "responses": {"200": {"description": "the metrics of this replica",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}}},
            }},
            "/admin/keys": {
                "post": _admin_op(
                    "createKey", "Create a key; the raw key is in this answer only",
                    {"201": _json_body(_ref("NewKey"), "created"), **_BAD_REQUEST, **_TOO_LARGE},
                    requestBody={"required": True, "content": {JSON: {"schema": _ref("KeyCreate")}}},
                ),
                "get": _admin_op(
                    "listKeys", "Keys, newest first",
                    {"200": _json_body(_ref("KeyList"), "a page of keys"), **_BAD_REQUEST},
                    parameters=[
                        _query_param("subject_id", _UUID, "only this subject's keys"),
                        _query_param("state", {"enum": list(KEY_STATES)}, "only keys in this state"),
                        _LIMIT_PARAM,
                        _query_param("after", _UUID, "last_id of the previous page"),
                    ],
                ),
            },
            "/admin/keys/{id}": {
                "parameters": [_KEY_ID_PARAM],
                "get": _admin_op("getKey", "One key", {**key_response, **_NOT_FOUND}),
                "patch": _admin_op(
                    "updateKey", "Change a key's name, limits, allowlist, budget or expiry (every replica within a second)",
                    {**key_response, **_BAD_REQUEST, **_NOT_FOUND, **_TOO_LARGE},
                    requestBody={"required": True, "content": {JSON: {"schema": _ref("KeyPatch")}}},
                ),
            },
            "/admin/keys/{id}/revoke": {
                "parameters": [_KEY_ID_PARAM],
                "post": _admin_op(
                    "revokeKey", "Revoke a key (idempotent)",
                    {**key_response, **_BAD_REQUEST, **_NOT_FOUND, **_TOO_LARGE},
                    requestBody={"required": False, "content": {JSON: {"schema": _ref("Revoke")}}},
                ),
            },
            "/admin/keys/{id}/rotate": {
                "parameters": [_KEY_ID_PARAM],
                "post": _admin_op(
                    "rotateKey", "New key with the same subject and limits; the old one revoked or kept for a grace period",
                    {
                        "201": _json_body(_ref("RotatedKey"), "the new key (raw, once) and the old one"),
                        "409": _error("the key is revoked or expired (key_state_conflict)"),
                        **_BAD_REQUEST, **_NOT_FOUND, **_TOO_LARGE,
                    },
                    requestBody={"required": False, "content": {JSON: {"schema": _ref("Rotate")}}},
                ),
            },
            "/admin/budgets": {"get": _admin_op(
                "listBudgets", "Subject budgets, in subject order",
                {"200": _json_body(_ref("SubjectBudgetList"), "a page of subject budgets"), **_BAD_REQUEST},
                parameters=[_LIMIT_PARAM, _query_param("after", _UUID, "last_id of the previous page")],
            )},
            "/admin/budgets/{subject_id}": {
                "parameters": [_SUBJECT_PARAM],
                "get": _admin_op(
                    "getBudget", "One subject's budget",
                    {"200": _json_body(_ref("SubjectBudget"), "the budget"), **_BAD_SUBJECT, **_NO_BUDGET},
                ),
                "put": _admin_op(
                    "setBudget", "Set or replace a subject's budget (every replica within about a second)",
                    {
                        "200": _json_body(_ref("SubjectBudget"), "replaced"),
                        "201": _json_body(_ref("SubjectBudget"), "set: the subject had no budget"),
                        **_BAD_REQUEST, **_TOO_LARGE,
                    },
                    requestBody={"required": True, "content": {JSON: {"schema": _ref("BudgetSet")}}},
                ),
                "delete": _admin_op(
                    "clearBudget", "Remove a subject's budget; its keys keep their own budgets",
                    {"200": _json_body(_ref("SubjectBudget"), "the budget removed"), **_BAD_SUBJECT, **_NO_BUDGET},
                ),
            },
            "/admin/audit": {"get": _admin_op(
                "listAudit", "Admin changes, newest first",
                {"200": _json_body(_ref("AuditList"), "a page of the audit trail"), **_BAD_REQUEST},
                parameters=[
                    _LIMIT_PARAM,
                    _query_param("after", {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
                                 "last_id of the previous page"),
                    _query_param("api_key_id", _UUID, "only changes to this key"),
                    _query_param("action", {"enum": list(ACTIONS)}, "only this action"),
                ],
            )},
            "/admin/usage": {"get": _admin_op(
                "usageReport", "Requests, tokens and cost from the ledger, grouped",
                {"200": _json_body(_ref("UsageReport"), "the report"), **_BAD_REQUEST},
                parameters=[
                    _query_param("group_by", {"enum": list(GROUP_BYS)}, "default key"),
                    _query_param("since", {"type": "string"}, "ISO 8601 date or date-time (UTC if no zone), inclusive"),
                    _query_param("until", {"type": "string"}, "ISO 8601 date or date-time (UTC if no zone), exclusive"),
                    _query_param("api_key_id", _UUID, "only this key"),
                ],
            )},
            "/admin/providers": {"get": _admin_op(
                "listProviders", "Providers and deployments with circuit state, latency and error rate",
                {"200": _json_body(_ref("Providers"), "providers and deployments")},
            )},
            "/admin/cache": {
                "get": _admin_op(
                    "cacheStats", "Response cache: entries and bytes held, counters, per-group policies",
                    {"200": _json_body(_ref("CacheStats"), "sizes and counters"), **_BAD_REQUEST},
                ),
                "delete": _admin_op(
                    "purgeCache", "Forget cached answers (here, in Redis and on every replica)",
                    {"200": _json_body(_ref("CachePurged"), "entries removed"), **_BAD_REQUEST},
                    parameters=[
                        _query_param("key", {"type": "string", "pattern": KEY_PATTERN},
                                     "one entry: a response's x-gateway-cache-key"),
                        _query_param("subject", _UUID, "entries stored by this subject's requests"),
                        _query_param("group", {"type": "string", "minLength": 1, "maxLength": MAX_GROUP_LEN},
                                     "entries of this model group (with subject: both)"),
                        _query_param("all", {"enum": ["true"]}, "everything"),
                    ],
                ),
            },
        },
        "components": {
            "securitySchemes": {
                "adminToken": {"type": "http", "scheme": "bearer", "description": "ADMIN_TOKEN"},
                "consoleSession": {"type": "apiKey", "in": "cookie", "name": "llmg_console",
                                   "description": "a console session (sign in at /ui/login); "
                                                  "changes also need X-CSRF-Token"},
            },
            "schemas": {
                "Error": _ERROR_SCHEMA, "Health": _HEALTH, "Key": _KEY, "NewKey": _NEW_KEY,
                "RotatedKey": _ROTATED_KEY, "KeyList": _list_of(_ref("Key"), _UUID), "KeyCreate": _KEY_CREATE,
                "KeyPatch": _KEY_PATCH, "Rotate": _ROTATE, "Revoke": _REVOKE,
                "SubjectBudget": _SUBJECT_BUDGET, "SubjectBudgetList": _list_of(_ref("SubjectBudget"), _UUID),
                "BudgetSet": _BUDGET_SET,
                "AuditEntry": _AUDIT_ENTRY, "AuditList": _list_of(_ref("AuditEntry"), {"type": "integer"}),
                "UsageReport": _USAGE_REPORT, "Providers": _PROVIDERS,
                "CacheStats": _CACHE_STATS, "CachePurged": _CACHE_PURGED,
            },
        },
    }


# ----------------------------------------------------------------------- data plane
_KEY_ERRORS = {
    "401": _error("missing, malformed, unknown, revoked or expired key (invalid_api_key)"),
    "402": _error("the key's or subject's budget is spent (budget_exceeded)"),
    "403": _error("model outside the key's allowlist (model_not_allowed)"),
    "429": _error("a rate limit is hit (rate_limit_exceeded); Retry-After"),
}
_UPSTREAM_ERRORS = {
    "404": _error("no route for the model (model_not_found)"),
    "413": _error("body over REQUEST_BODY_LIMIT_BYTES (request_too_large)"),
    "502": _error("transport failure after retries (upstream_unavailable)"),
    "503": _error("no healthy deployment, or overloaded (circuit_open / overloaded); Retry-After"),
    "504": _error("the provider took longer than its timeout (upstream_timeout)"),
}
_PROVIDER_ANSWER = {
    "default": {
        "description": "an HTTP error answered by the provider itself, relayed with its status and body",
        "content": {JSON: {"schema": {}}},
    },
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "description": "OpenAI chat completions; only model, messages and stream are checked, the rest passes through",
    "properties": {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"], "properties": {"role": {"type": "string"}},
        }},
        "stream": {"type": "boolean"},
    },
}
#: One server-sent event of a relayed stream (each event is described, as OpenAPI 3.2 does).
_CHAT_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "a chat.completion.chunk object as JSON; [DONE] last; or one {\"error\": ...} if the upstream failed mid-stream",
        },
        "event": {"type": "string"},
        "id": {"type": "string"},
    },
}
_EMBEDDINGS_REQUEST = {
    "type": "object", "required": ["model", "input"],
    "properties": {"model": {"type": "string", "minLength": 1}, "input": {}},
}
_MODEL_LIST = {
    "type": "object", "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": "model"},
                "created": {"type": "integer"}, "owned_by": {"type": "string"},
            },
        }},
    },
}
_READY = {
    "type": "object", "required": ["status", "checks"],
    "properties": {
        "status": {"enum": ["ok", "unavailable"]},
        "checks": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def data_plane_document() -> dict[str, Any]:
    """The data plane: health, readiness, chat completions, models, embeddings."""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llm-gateway data plane", "version": API_VERSION,
            "description": "OpenAI-compatible. A key is sent as Authorization: Bearer KEY or x-api-key: KEY.",
        },
        "security": [{"bearerKey": []}, {"headerKey": []}],
        "paths": {
            **_common_paths("data"),
            "/readyz": {"get": {
                "operationId": "readyz", "summary": "Ready when the database answers and every actor runs",
                "tags": ["health"], "security": [],
                "responses": {
                    "200": _json_body(_ref("Ready"), "ready"),
                    "503": _json_body(_ref("Ready"), "not ready, with what is wrong"),
                },
            }},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "summary": "OpenAI chat completions, stream false or true",
                "tags": ["openai"],
                "requestBody": {"required": True, "content": {JSON: {"schema": _ref("ChatCompletionRequest")}}},
                "responses": {
                    "200": {
                        "description": "the provider's answer, or with stream true an SSE stream ending data: [DONE]",
                        "content": {JSON: {"schema": {"type": "object"}}, "text/event-stream": {"schema": _ref("ChatCompletionEvent")}},
                    },
                    "400": _error("malformed body (invalid_json, invalid_model, invalid_messages, invalid_stream)"),
                    **_KEY_ERRORS, **_UPSTREAM_ERRORS, **_PROVIDER_ANSWER,
                },
            }},
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "The model names this key may use", "tags": ["openai"],
                "responses": {"200": _json_body(_ref("ModelList"), "OpenAI list of models"), "401": _KEY_ERRORS["401"]},
            }},
            "/v1/embeddings": {"post": {
                "operationId": "createEmbedding", "summary": "Proxied to an OpenAI-compatible provider",
                "tags": ["openai"],
                "requestBody": {"required": True, "content": {JSON: {"schema": _ref("EmbeddingRequest")}}},
                "responses": {
                    "200": _json_body({"type": "object"}, "the provider's answer"),
                    "400": _error("malformed body (invalid_json, invalid_model, invalid_input)"),
                    **_KEY_ERRORS, **_UPSTREAM_ERRORS, **_PROVIDER_ANSWER,
                },
            }},
        },
        "components": {
            "securitySchemes": {
                "bearerKey": {"type": "http", "scheme": "bearer", "description": "a gateway key (llmg_...)"},
                "headerKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
            "schemas": {
                "Error": _ERROR_SCHEMA, "Health": _HEALTH, "Ready": _READY,
                "ChatCompletionRequest": _CHAT_REQUEST, "ChatCompletionEvent": _CHAT_EVENT, "EmbeddingRequest": _EMBEDDINGS_REQUEST,
                "ModelList": _MODEL_LIST,
            },
        },
    }


def document_handler(document: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A ``GET /openapi.json`` handler serving ``document``, encoded once."""
    body = orjson.dumps(document)

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return openapi_json
