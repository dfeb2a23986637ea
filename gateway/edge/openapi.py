"""The OpenAPI 3.1 documents of both planes, served at ``GET /openapi.json``.

Each document is the plane's route table (path, method, operation id, answers) joined
with the declared shapes: the admin API's request bodies and query strings are the very
models that validate them (:data:`gateway.admin.input.BODIES` and ``QUERIES``), so the
document cannot promise a field the gateway refuses or miss one it takes; the answers'
shapes are in :mod:`gateway.edge.openapi_shapes`. ``tests/test_openapi.py`` keeps each
document true: every route registered on a plane must be in its table here and every
operation in the table must be registered, and schemathesis calls every operation with
generated input and finds no server error. A new route therefore needs its entry here,
in the same commit.

Each document is built once per app and served as prebuilt bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from gateway import __version__
from gateway.admin.cache import KEY_PATTERN, MAX_GROUP_LEN
from gateway.admin.input import BODIES, QUERIES
from gateway.admin.request_logs import RequestLogDetail, RequestLogSummary
from gateway.edge.openapi_shapes import (
    ACTIVE_CONFIG,
    ANTHROPIC_ERROR,
    ANTHROPIC_ERRORS,
    ANTHROPIC_EVENT,
    ANTHROPIC_MESSAGE,
    AUDIT_ENTRY,
    CACHE_PURGED,
    CACHE_STATS,
    CHAT_EVENT,
    CHAT_REQUEST,
    COMPLETION_REQUEST,
    CONFIG_SOURCE,
    COUNT_TOKENS_REQUEST,
    EMBEDDINGS_REQUEST,
    ERROR_SCHEMA,
    HEALTH,
    INPUT_ITEM_LIST,
    JSON,
    KEY,
    MESSAGES_REQUEST,
    MODEL_LIST,
    NEW_KEY,
    PROVIDERS,
    READY,
    RELOAD_OUTCOME,
    RESPONSE_DELETED,
    RESPONSE_EVENT,
    RESPONSE_OBJECT,
    RESPONSE_REQUEST,
    ROTATED_KEY,
    SUBJECT_BUDGET,
    USAGE_REPORT,
    UUID,
    error,
    json_body,
    list_of,
    model_schema,
    query_parameters,
    ref,
)

__all__ = ["data_plane_document", "document_handler", "management_document"]

OPENAPI_VERSION = "3.1.0"
API_VERSION = __version__


def _common_paths(tag: str) -> dict[str, Any]:
    return {
        "/healthz": {"get": {
            "operationId": f"{tag}Healthz", "summary": "Alive while the process runs (no dependency checked)",
            "tags": ["health"], "security": [],
            "responses": {"200": json_body(ref("Health"), "alive")},
        }},
        "/openapi.json": {"get": {
            "operationId": f"{tag}OpenApi", "summary": "This document", "tags": ["meta"], "security": [],
            "responses": {"200": json_body({"type": "object"}, "the OpenAPI document of this plane")},
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
    ("/ui/requests", "consoleRequests", "Stored calls (request logs), filterable"),
    ("/ui/requests/{request_id}", "consoleRequest", "One stored call; its bodies for an admin session"),
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


_ADMIN_ERRORS = {
    "401": error("missing or wrong admin token, or an ended console session (invalid_admin_token)"),
    "403": error("no ADMIN_TOKEN configured: admin API disabled (admin_disabled); with a console session: "
                 "a change without its X-CSRF-Token (csrf_failed) or by a viewer (read_only)"),
    "503": error("PostgreSQL is unreachable (database_unavailable); nothing was changed; Retry-After"),
}
_BAD_REQUEST = {"400": error("invalid_json, unknown_field, missing_field, invalid_field or invalid_query")}
_TOO_LARGE = {"413": error("body over the limit (request_too_large)")}
_NOT_FOUND = {"404": error("no key with that id or prefix (key_not_found)")}

_NO_BUDGET = {"404": error("the subject has no budget (budget_not_found)")}
_SUBJECT_PARAM = {
    "name": "subject_id", "in": "path", "required": True,
    "description": "the subject (tenant) UUID shared by its keys", "schema": UUID,
}
_BAD_SUBJECT = {"400": error("subject_id is not a UUID (invalid_field), or a bad query (invalid_query)")}

_KEY_ID_PARAM = {
    "name": "id", "in": "path", "required": True,
    "description": "the key's id (UUID) or its 12-character prefix",
    "schema": {"type": "string"},
}


def _query_param(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}



def _admin_op(op_id: str, summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "operationId": op_id, "summary": summary, "tags": ["admin"],
        "responses": {**responses, **_ADMIN_ERRORS}, **extra,
    }


def management_document() -> dict[str, Any]:
    """The management plane: health, this document, and the admin API."""
    key_response = {"200": json_body(ref("Key"), "the key (never its hash)")}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llm-gateway management plane", "version": API_VERSION,
            "description": (
                "Keys, subject budgets, audit, usage, providers, request logs and the response cache. "
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
                    {"201": json_body(ref("NewKey"), "created"), **_BAD_REQUEST, **_TOO_LARGE},
                    requestBody={"required": True, "content": {JSON: {"schema": ref("KeyCreate")}}},
                ),
                "get": _admin_op(
                    "listKeys", "Keys, newest first",
                    {"200": json_body(ref("KeyList"), "a page of keys"), **_BAD_REQUEST},
                    parameters=query_parameters(QUERIES["keys"]),
                ),
            },
            "/admin/keys/{id}": {
                "parameters": [_KEY_ID_PARAM],
                "get": _admin_op("getKey", "One key", {**key_response, **_NOT_FOUND}),
                "patch": _admin_op(
                    "updateKey", "Change a key's name, limits, allowlist, budget or expiry (every replica within a second)",
                    {**key_response, **_BAD_REQUEST, **_NOT_FOUND, **_TOO_LARGE},
                    requestBody={"required": True, "content": {JSON: {"schema": ref("KeyPatch")}}},
                ),
            },
            "/admin/keys/{id}/revoke": {
                "parameters": [_KEY_ID_PARAM],
                "post": _admin_op(
                    "revokeKey", "Revoke a key (idempotent)",
                    {**key_response, **_BAD_REQUEST, **_NOT_FOUND, **_TOO_LARGE},
                    requestBody={"required": False, "content": {JSON: {"schema": ref("Revoke")}}},
                ),
            },
            "/admin/keys/{id}/rotate": {
                "parameters": [_KEY_ID_PARAM],
                "post": _admin_op(
                    "rotateKey", "New key with the same subject and limits; the old one revoked or kept for a grace period",
                    {
                        "201": json_body(ref("RotatedKey"), "the new key (raw, once) and the old one"),
                        "409": error("the key is revoked or expired (key_state_conflict)"),
                        **_BAD_REQUEST, **_NOT_FOUND, **_TOO_LARGE,
                    },
                    requestBody={"required": False, "content": {JSON: {"schema": ref("Rotate")}}},
                ),
            },
            "/admin/budgets": {"get": _admin_op(
                "listBudgets", "Subject budgets, in subject order",
                {"200": json_body(ref("SubjectBudgetList"), "a page of subject budgets"), **_BAD_REQUEST},
                parameters=query_parameters(QUERIES["budgets"]),
            )},
            "/admin/budgets/{subject_id}": {
                "parameters": [_SUBJECT_PARAM],
                "get": _admin_op(
                    "getBudget", "One subject's budget",
                    {"200": json_body(ref("SubjectBudget"), "the budget"), **_BAD_SUBJECT, **_NO_BUDGET},
                ),
                "put": _admin_op(
                    "setBudget", "Set or replace a subject's budget (every replica within about a second)",
                    {
                        "200": json_body(ref("SubjectBudget"), "replaced"),
                        "201": json_body(ref("SubjectBudget"), "set: the subject had no budget"),
                        **_BAD_REQUEST, **_TOO_LARGE,
                    },
                    requestBody={"required": True, "content": {JSON: {"schema": ref("BudgetSet")}}},
                ),
                "delete": _admin_op(
                    "clearBudget", "Remove a subject's budget; its keys keep their own budgets",
                    {"200": json_body(ref("SubjectBudget"), "the budget removed"), **_BAD_SUBJECT, **_NO_BUDGET},
                ),
            },
            "/admin/audit": {"get": _admin_op(
                "listAudit", "Admin changes, newest first",
                {"200": json_body(ref("AuditList"), "a page of the audit trail"), **_BAD_REQUEST},
                parameters=query_parameters(QUERIES["audit"]),
            )},
            "/admin/usage": {"get": _admin_op(
                "usageReport", "Requests, tokens and cost from the ledger, grouped",
                {"200": json_body(ref("UsageReport"), "the report"), **_BAD_REQUEST},
                parameters=query_parameters(QUERIES["usage"]),
            )},
            "/admin/requests": {"get": _admin_op(
                "listRequestLogs", "Stored calls (request_logs:), newest first, without their bodies",
                {"200": json_body(ref("RequestLogList"), "a page of stored calls"), **_BAD_REQUEST},
                parameters=query_parameters(QUERIES["requests"]),
            )},
            "/admin/requests/{request_id}": {
                "parameters": [{
                    "name": "request_id", "in": "path", "required": True, "schema": {"type": "string"},
                    "description": "the call's x-request-id (its newest call) or its call_id",
                }],
                "get": _admin_op(
                    "getRequestLog", "One stored call with its request and response bodies (admin role only)",
                    {
                        "200": json_body(ref("RequestLogDetail"), "the call and its bodies"),
                        "403": error("a viewer session may not read bodies (admin_role_required), "
                                     "or the admin API is disabled (admin_disabled)"),
                        "404": error("no stored call with that id, or past its retention (request_log_not_found)"),
                        **_BAD_REQUEST,
                    },
                ),
            },
            "/admin/providers": {"get": _admin_op(
                "listProviders", "Providers and deployments with circuit state, latency and error rate",
                {"200": json_body(ref("Providers"), "providers and deployments")},
            )},
            "/admin/config": {"get": _admin_op(
                "showConfig", "The active config: source, hash, load time, last reload; secrets masked",
                {"200": json_body(ref("ActiveConfig"), "the active config"), **_BAD_REQUEST},
            )},
            "/admin/config/reload": {"post": _admin_op(
                "reloadConfig", "Re-read GATEWAY_CONFIG and swap it in (as SIGHUP does); every worker too",
                {
                    "200": json_body(ref("ReloadOutcome"), "applied"),
                    "422": error("the file was refused, nothing changed (invalid_config)"),
                    "503": error("a worker did not confirm the reload (reload_incomplete)"),
                    **_BAD_REQUEST,
                },
            )},
            "/admin/cache": {
                "get": _admin_op(
                    "cacheStats", "Response cache: entries and bytes held, counters, per-group policies",
                    {"200": json_body(ref("CacheStats"), "sizes and counters"), **_BAD_REQUEST},
                ),
                "delete": _admin_op(
                    "purgeCache", "Forget cached answers (here, in Redis and on every replica)",
                    {"200": json_body(ref("CachePurged"), "entries removed"), **_BAD_REQUEST},
                    parameters=[
                        _query_param("key", {"type": "string", "pattern": KEY_PATTERN},
                                     "one entry: a response's x-gateway-cache-key"),
                        _query_param("subject", UUID, "entries stored by this subject's requests"),
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
                "Error": ERROR_SCHEMA, "Health": HEALTH, "Key": KEY, "NewKey": NEW_KEY,
                "RotatedKey": ROTATED_KEY, "KeyList": list_of(ref("Key"), UUID),
                "SubjectBudget": SUBJECT_BUDGET, "SubjectBudgetList": list_of(ref("SubjectBudget"), UUID),
                **{name: model_schema(model) for name, model in BODIES.items()},
                "AuditEntry": AUDIT_ENTRY, "AuditList": list_of(ref("AuditEntry"), {"type": "integer"}),
                "UsageReport": USAGE_REPORT, "Providers": PROVIDERS,
                "RequestLog": model_schema(RequestLogSummary), "RequestLogDetail": model_schema(RequestLogDetail),
                "RequestLogList": list_of(ref("RequestLog"), UUID),
                "CacheStats": CACHE_STATS, "CachePurged": CACHE_PURGED,
                "ConfigSource": CONFIG_SOURCE, "ReloadOutcome": RELOAD_OUTCOME, "ActiveConfig": ACTIVE_CONFIG,
            },
        },
    }


# ----------------------------------------------------------------------- data plane
_KEY_ERRORS = {
    "401": error("missing, malformed, unknown, revoked or expired key (invalid_api_key)"),
    "402": error("the key's or subject's budget is spent (budget_exceeded)"),
    "403": error("model outside the key's allowlist (model_not_allowed)"),
    "429": error("a rate limit is hit (rate_limit_exceeded); Retry-After"),
}
_UPSTREAM_ERRORS = {
    "404": error("no route for the model (model_not_found)"),
    "413": error("body over REQUEST_BODY_LIMIT_BYTES (request_too_large)"),
    "502": error("transport failure after retries (upstream_unavailable)"),
    "503": error("no healthy deployment, or overloaded (circuit_open / overloaded); Retry-After"),
    "504": error("the provider took longer than its timeout (upstream_timeout)"),
}
_PROVIDER_ANSWER = {
    "default": {
        "description": "an HTTP error answered by the provider itself, relayed with its status and body",
        "content": {JSON: {"schema": {}}},
    },
}

#: The methods ``/passthrough/{provider}/{path}`` relays (gateway/edge/passthrough.py).
PASSTHROUGH_METHODS = ("get", "post", "put", "patch", "delete")


def _passthrough_item() -> dict[str, Any]:
    parameters = [
        {"name": "provider", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "a configured provider's name"},
        {"name": "path", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "the path under the provider's base URL, sent with the query and body unchanged"},
    ]
    return {method: {
        "operationId": f"passthrough{method.capitalize()}",
        "summary": "The provider's own API, relayed unchanged with its credential added server-side",
        "tags": ["passthrough"], "parameters": parameters,
        "responses": {
            **_KEY_ERRORS, **_UPSTREAM_ERRORS,
            "default": {"description": "the provider's answer (status, headers, body or stream) as it sent it"},
            "403": error("the key's allowlist holds no passthrough/{provider} (provider_not_allowed)"),
            "404": error("no such provider (provider_not_found)"),
        },
    } for method in PASSTHROUGH_METHODS}


def _responses_paths() -> dict[str, Any]:
    """``/v1/responses`` and its stored responses (gateway/edge/responses.py)."""
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    not_found = error("no stored response with this id for the key's subject (response_not_found)")
    return {
        "/v1/responses": {"post": {
            "operationId": "createResponse",
            "summary": "OpenAI Responses API, stream false or true, any provider behind it; stored unless store is false",
            "tags": ["openai"],
            "requestBody": {"required": True, "content": {JSON: {"schema": ref("ResponseRequest")}}},
            "responses": {
                "200": {
                    "description": "a response, or with stream true the typed SSE events ending response.completed",
                    "content": {JSON: {"schema": ref("Response")}, "text/event-stream": {"schema": ref("ResponseEvent")}},
                },
                "400": error("malformed body (invalid_json, invalid_model, invalid_input, unsupported_tool, "
                             "previous_response_not_found, ...)"),
                **_KEY_ERRORS, **_UPSTREAM_ERRORS, **_PROVIDER_ANSWER,
            },
        }},
        "/v1/responses/{response_id}": {
            "get": {
                "operationId": "getResponse", "summary": "A stored response", "tags": ["openai"],
                "parameters": [response_id],
                "responses": {"200": json_body(ref("Response"), "the stored response"), "404": not_found,
                              "401": _KEY_ERRORS["401"], "429": _KEY_ERRORS["429"]},
            },
            "delete": {
                "operationId": "deleteResponse", "summary": "Delete a stored response", "tags": ["openai"],
                "parameters": [response_id],
                "responses": {"200": json_body(RESPONSE_DELETED, "deleted"), "404": not_found,
                              "401": _KEY_ERRORS["401"], "429": _KEY_ERRORS["429"]},
            },
        },
        "/v1/responses/{response_id}/input_items": {"get": {
            "operationId": "listInputItems", "summary": "The input items a stored response answered",
            "tags": ["openai"],
            "parameters": [
                response_id,
                {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "after", "in": "query", "schema": {"type": "string"}},
            ],
            "responses": {"200": json_body(INPUT_ITEM_LIST, "a page of input items"), "404": not_found,
                          "400": error("bad order, limit or after (invalid_order, invalid_limit, invalid_after)"),
                          "401": _KEY_ERRORS["401"], "429": _KEY_ERRORS["429"]},
        }},
    }


def data_plane_document() -> dict[str, Any]:
    """The data plane: health, readiness, chat completions, Anthropic messages, models, embeddings."""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llm-gateway data plane", "version": API_VERSION,
            "description": "OpenAI-compatible, and Anthropic's Messages API at /v1/messages. "
                           "A key is sent as Authorization: Bearer KEY or x-api-key: KEY.",
        },
        "security": [{"bearerKey": []}, {"headerKey": []}],
        "paths": {
            **_common_paths("data"),
            "/readyz": {"get": {
                "operationId": "readyz", "summary": "Ready when the database answers and every actor runs",
                "tags": ["health"], "security": [],
                "responses": {
                    "200": json_body(ref("Ready"), "ready"),
                    "503": json_body(ref("Ready"), "not ready, with what is wrong"),
                },
            }},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "summary": "OpenAI chat completions, stream false or true",
                "tags": ["openai"],
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("ChatCompletionRequest")}}},
                "responses": {
                    "200": {
                        "description": "the provider's answer, or with stream true an SSE stream ending data: [DONE]",
                        "content": {JSON: {"schema": {"type": "object"}}, "text/event-stream": {"schema": ref("ChatCompletionEvent")}},
                    },
                    "400": error("malformed body (invalid_json, invalid_model, invalid_messages, invalid_stream)"),
                    **_KEY_ERRORS, **_UPSTREAM_ERRORS, **_PROVIDER_ANSWER,
                },
            }},
            "/v1/completions": {"post": {
                "operationId": "createCompletion", "summary": "OpenAI legacy completions (through chat), stream false or true",
                "tags": ["openai"],
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("CompletionRequest")}}},
                "responses": {
                    "200": {
                        "description": "a text_completion, or with stream true an SSE stream ending data: [DONE]",
                        "content": {JSON: {"schema": {"type": "object"}}, "text/event-stream": {"schema": ref("ChatCompletionEvent")}},
                    },
                    "400": error("malformed body (invalid_json, invalid_model, invalid_prompt, invalid_stream, "
                                  "unsupported_parameter)"),
                    **_KEY_ERRORS, **_UPSTREAM_ERRORS, **_PROVIDER_ANSWER,
                },
            }},
            "/v1/messages": {"post": {
                "operationId": "createMessage",
                "summary": "Anthropic Messages API, stream false or true, any provider behind it",
                "tags": ["anthropic"],
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("MessagesRequest")}}},
                "responses": {
                    "200": {
                        "description": "a message, or with stream true Anthropic's named SSE events",
                        "content": {JSON: {"schema": ref("AnthropicMessage")},
                                    "text/event-stream": {"schema": ref("AnthropicEvent")}},
                    },
                    **ANTHROPIC_ERRORS,
                },
            }},
            "/v1/messages/count_tokens": {"post": {
                "operationId": "countMessageTokens",
                "summary": "Input tokens of a Messages request, without generating",
                "tags": ["anthropic"],
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("CountTokensRequest")}}},
                "responses": {
                    "200": json_body({"type": "object", "required": ["input_tokens"],
                                       "properties": {"input_tokens": {"type": "integer", "minimum": 0}}},
                                      "the Anthropic deployment's own count, or the gateway's estimate"),
                    **ANTHROPIC_ERRORS,
                },
            }},
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "The model names this key may use", "tags": ["openai"],
                "responses": {"200": json_body(ref("ModelList"), "OpenAI list of models"), "401": _KEY_ERRORS["401"]},
            }},
            "/v1/embeddings": {"post": {
                "operationId": "createEmbedding", "summary": "Proxied to an OpenAI-compatible provider",
                "tags": ["openai"],
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("EmbeddingRequest")}}},
                "responses": {
                    "200": json_body({"type": "object"}, "the provider's answer"),
                    "400": error("malformed body (invalid_json, invalid_model, invalid_input)"),
                    **_KEY_ERRORS, **_UPSTREAM_ERRORS, **_PROVIDER_ANSWER,
                },
            }},
            **_responses_paths(),
            "/passthrough/{provider}/{path}": _passthrough_item(),
        },
        "components": {
            "securitySchemes": {
                "bearerKey": {"type": "http", "scheme": "bearer", "description": "a gateway key (llmg_...)"},
                "headerKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
            "schemas": {
                "Error": ERROR_SCHEMA, "Health": HEALTH, "Ready": READY,
                "ChatCompletionRequest": CHAT_REQUEST, "ChatCompletionEvent": CHAT_EVENT, "EmbeddingRequest": EMBEDDINGS_REQUEST,
                "ModelList": MODEL_LIST, "MessagesRequest": MESSAGES_REQUEST, "CompletionRequest": COMPLETION_REQUEST,
                "CountTokensRequest": COUNT_TOKENS_REQUEST, "AnthropicMessage": ANTHROPIC_MESSAGE,
                "AnthropicEvent": ANTHROPIC_EVENT, "AnthropicError": ANTHROPIC_ERROR,
                "ResponseRequest": RESPONSE_REQUEST, "Response": RESPONSE_OBJECT, "ResponseEvent": RESPONSE_EVENT,
            },
        },
    }


def document_handler(document: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A ``GET /openapi.json`` handler serving ``document``, encoded once."""
    body = orjson.dumps(document)

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return openapi_json
