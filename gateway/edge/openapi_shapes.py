"""The answers' shapes in the OpenAPI documents, as JSON Schema, and the helpers to write them.

Request bodies and query strings are not here: they are the typed models of
:mod:`gateway.admin.input` (and the config file's of :mod:`gateway.core.config`), whose
JSON Schema :func:`model_schema` and :func:`query_parameters` take as is. The answers are
built as plain dicts by the views, so their shapes are declared once, here, and
``tests/test_openapi.py`` holds every answer to them with schemathesis.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from gateway.admin.audit import ACTIONS
from gateway.admin.input import GROUP_BYS
from gateway.auth.keys import BUDGET_PERIODS, KEY_STATES

__all__ = [
    "ACTIVE_CONFIG",
    "AUDIT_ENTRY",
    "CONFIG_SOURCE",
    "RELOAD_OUTCOME",
    "CACHE_PURGED",
    "CACHE_STATS",
    "CHAT_EVENT",
    "CHAT_REQUEST",
    "DATETIME",
    "EMBEDDINGS_REQUEST",
    "ERROR_REF",
    "ERROR_SCHEMA",
    "HEALTH",
    "INPUT_ITEM_LIST",
    "KEY",
    "MODEL_LIST",
    "NEW_KEY",
    "PROVIDERS",
    "READY",
    "RESPONSE_DELETED",
    "RESPONSE_EVENT",
    "RESPONSE_OBJECT",
    "RESPONSE_REQUEST",
    "ROTATED_KEY",
    "SUBJECT_BUDGET",
    "USAGE_REPORT",
    "UUID",
    "error",
    "json_body",
    "list_of",
    "nullable",
    "ref",
    "model_schema",
    "query_parameters",
]

JSON = "application/json"

ERROR_REF = {"$ref": "#/components/schemas/Error"}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def error(description: str) -> dict[str, Any]:
    return json_body(ERROR_REF, description)


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI 3.1 (JSON Schema 2020-12) spelling of "this, or null"."""
    return {"anyOf": [schema, {"type": "null"}]}


UUID = {"type": "string", "format": "uuid"}
DATETIME = {"type": "string", "format": "date-time"}

# ----------------------------------------------------------------------- shared schemas
ERROR_SCHEMA = {
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

HEALTH = {
    "type": "object", "required": ["status"],
    "properties": {"status": {"const": "ok"}},
}


# ----------------------------------------------------------------------- management answers
KEY = {
    "type": "object",
    "required": [
        "api_key_id", "subject_id", "name", "key_prefix", "state", "rate_limit_requests",
        "rate_limit_window_seconds", "tokens_per_minute", "max_concurrent", "budget_usd", "budget_period",
        "allowed_models", "created_at", "last_used_at", "revoked_at", "expires_at",
    ],
    "properties": {
        "api_key_id": UUID,
        "subject_id": UUID,
        "name": {"type": "string"},
        "key_prefix": {"type": "string", "minLength": 12, "maxLength": 12},
        "state": {"enum": list(KEY_STATES)},
        "rate_limit_requests": {"type": "integer"},
        "rate_limit_window_seconds": {"type": "integer"},
        "tokens_per_minute": {"type": ["integer", "null"]},
        "max_concurrent": {"type": ["integer", "null"]},
        "budget_usd": {"type": ["number", "null"]},
        "budget_period": nullable({"enum": list(BUDGET_PERIODS)}),
        "allowed_models": {"type": ["array", "null"], "items": {"type": "string"}},
        "created_at": DATETIME,
        "last_used_at": nullable(DATETIME),
        "revoked_at": nullable(DATETIME),
        "expires_at": nullable(DATETIME),
    },
}

NEW_KEY = {
    "allOf": [ref("Key"), {
        "type": "object", "required": ["api_key"],
        "properties": {"api_key": {"type": "string", "description": "the raw key: shown this once, never again"}},
    }],
}

ROTATED_KEY = {
    "allOf": [ref("NewKey"), {
        "type": "object", "required": ["previous"],
        "properties": {"previous": ref("Key")},
    }],
}


def list_of(item: dict[str, Any], id_schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["object", "data", "has_more", "first_id", "last_id"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "has_more": {"type": "boolean"},
            "first_id": nullable(id_schema),
            "last_id": nullable(id_schema),
        },
    }


SUBJECT_BUDGET = {
    "type": "object",
    "required": ["subject_id", "budget_usd", "budget_period", "created_at", "updated_at"],
    "properties": {
        "subject_id": UUID,
        "budget_usd": {"type": "number", "minimum": 0},
        "budget_period": {"enum": list(BUDGET_PERIODS)},
        "created_at": DATETIME,
        "updated_at": DATETIME,
    },
}
AUDIT_ENTRY = {
    "type": "object",
    "required": ["id", "at", "actor", "action", "api_key_id", "request_id", "remote", "detail"],
    "properties": {
        "id": {"type": "integer"},
        "at": DATETIME,
        "actor": {"type": "string", "description": "ADMIN_TOKEN_NAME, or token:<first 12 hex of its SHA-256>"},
        "action": {"enum": list(ACTIONS)},
        "api_key_id": nullable(UUID),
        "request_id": {"type": ["string", "null"]},
        "remote": {"type": ["string", "null"]},
        "detail": {"type": "object"},
    },
}

USAGE_NUMBERS = {
    "requests": {"type": "integer", "minimum": 0},
    "input_tokens": {"type": "integer", "minimum": 0},
    "output_tokens": {"type": "integer", "minimum": 0},
    "cost_usd": {"type": "number", "minimum": 0},
}
USAGE_REPORT = {
    "type": "object",
    "required": ["object", "group_by", "since", "until", "api_key_id", "data", "totals"],
    "properties": {
        "object": {"const": "usage_report"},
        "group_by": {"enum": list(GROUP_BYS)},
        "since": nullable(DATETIME),
        "until": nullable(DATETIME),
        "api_key_id": nullable(UUID),
        "data": {"type": "array", "items": {
            "type": "object", "required": ["group", *USAGE_NUMBERS],
            "properties": {
                "group": {"type": "string", "description": "api_key_id, model name, or YYYY-MM-DD (UTC)"},
                **USAGE_NUMBERS,
            },
        }},
        "totals": {"type": "object", "required": list(USAGE_NUMBERS), "properties": USAGE_NUMBERS},
    },
}

PROVIDERS = {
    "type": "object",
    "required": ["providers", "deployments"],
    "properties": {
        "providers": {"type": "array", "items": {
            "type": "object", "required": ["name", "type", "base_url"],
            "properties": {
                "name": {"type": "string"}, "type": {"type": "string"},
                "base_url": {"type": ["string", "null"], "description": "without credentials"},
                "health_check": nullable({
                    "type": "object", "description": "active health probes (null: none configured)",
                    "properties": {
                        "healthy": {"type": "boolean"}, "consecutive_failures": {"type": "integer"},
                        "consecutive_successes": {"type": "integer"}, "probes": {"type": "integer"},
                        "last_checked": nullable({"type": "number"}),
                        "last_latency_seconds": nullable({"type": "number"}),
                        "last_error": nullable({"type": "string"}),
                        "interval_seconds": {"type": "number"}, "timeout_seconds": {"type": "number"},
                    },
                }),
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
                "healthy": {"type": "boolean", "description": "false while its provider's health probes fail"},
                "provider": {"type": "string"},
                "model": {"type": "string"},
                "model_groups": {"type": "array", "items": {
                    "type": "object", "required": ["name", "priority", "weight"],
                    "properties": {
                        "name": {"type": "string"}, "priority": {"type": "integer"}, "weight": {"type": "number"},
                    },
                }},
                "price": nullable({
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

CACHE_STATS = {
    "type": "object",
    "required": ["entries", "bytes", "max_bytes", "vectors", "shared", "counters", "policies"],
    "properties": {
        "entries": {"type": "integer"}, "bytes": {"type": "integer"}, "max_bytes": {"type": "integer"},
        "vectors": {"type": "integer"}, "shared": {"type": "boolean"},
        "shared_keys_known": {"type": "integer"}, "shared_index_live": {"type": "boolean"},
        "counters": {"type": "object", "additionalProperties": {"type": "number"}},
        "embedder": nullable({"type": "string"}),
        "policies": {"type": "object", "additionalProperties": {"type": "object"}},
        "client_opt_in": {"type": "boolean"},
    },
}
CACHE_PURGED = {
    "type": "object",
    "required": ["purged"],
    "properties": {"purged": {
        "type": "object", "required": ["memory", "shared"],
        "properties": {"memory": {"type": "integer", "minimum": 0}, "shared": {"type": "integer", "minimum": -1}},
    }},
}

CONFIG_SOURCE = {
    "type": "object",
    "required": ["source", "hash", "loaded_at", "generation"],
    "properties": {
        "source": {"type": "string", "description": "the GATEWAY_CONFIG file, or 'default'"},
        "hash": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
        "loaded_at": {"type": "number", "description": "Unix time"},
        "generation": {"type": "integer", "minimum": 1},
    },
}
RELOAD_OUTCOME = {
    "type": "object",
    "required": ["ok", "trigger", "at", "error", "changed", "needs_restart", "active"],
    "properties": {
        "ok": {"type": "boolean"}, "trigger": {"enum": ["admin", "sighup"]}, "at": {"type": "number"},
        "error": nullable({"type": "string"}), "changed": {"type": "boolean"},
        "needs_restart": {"type": "array", "items": {"type": "string"}},
        "active": {"$ref": "#/components/schemas/ConfigSource"},
        "workers": {"type": "array", "items": {"type": "object"}},
    },
}
ACTIVE_CONFIG = {
    "type": "object",
    "required": ["active", "last_reload", "config"],
    "properties": {
        "active": {"$ref": "#/components/schemas/ConfigSource"},
        "last_reload": nullable({"$ref": "#/components/schemas/ReloadOutcome"}),
        "config": {"type": "object", "description": "the config file's content, secrets masked"},
    },
}

# ----------------------------------------------------------------------- data plane
CHAT_REQUEST = {
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
CHAT_EVENT = {
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
EMBEDDINGS_REQUEST = {
    "type": "object", "required": ["model", "input"],
    "properties": {"model": {"type": "string", "minLength": 1}, "input": {}},
}
MODEL_LIST = {
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
READY = {
    "type": "object", "required": ["status", "checks"],
    "properties": {
        "status": {"enum": ["ok", "degraded", "unavailable"]},
        "checks": {
            "type": "object", "additionalProperties": {"type": "string"},
            "description": "every check (server, database, actor:NAME, key_invalidation, rate_limits) "
                           "with its state: ok, or what is wrong",
        },
        "degraded": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}



def _tidy(schema: Any) -> Any:
    """pydantic's JSON Schema without what only clutters a document: titles, ``default: null``."""
    if isinstance(schema, dict):
        return {
            k: _tidy(v) for k, v in schema.items()
            if k != "title" and not (k == "default" and v is None)
        }
    if isinstance(schema, list):
        return [_tidy(v) for v in schema]
    return schema


def model_schema(model: Any) -> dict[str, Any]:
    """A request body's schema, from the model that validates it."""
    schema: dict[str, Any] = _tidy(TypeAdapter(model).json_schema())
    schema.pop("description", None)  # the class docstring names the route: the operation says that
    return schema


def query_parameters(model: Any) -> list[dict[str, Any]]:
    """One OpenAPI query parameter per field of a query-string model (all optional)."""
    params = []
    for name, prop in _tidy(TypeAdapter(model).json_schema())["properties"].items():
        description = prop.pop("description", "")
        prop.pop("default", None)
        # ``X | None`` means "may be left out"; a query string cannot send a null.
        branches = [b for b in prop.pop("anyOf", []) if b != {"type": "null"}]
        schema = {**branches[0], **prop} if branches else prop
        params.append({"name": name, "in": "query", "required": False, "schema": schema, "description": description})
    return params


# -- Anthropic's Messages API (/v1/messages): its own request, answer and error shapes --------
def anthropic_error(description: str) -> dict[str, Any]:
    return json_body(ref("AnthropicError"), description)


ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}
TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
ANTHROPIC_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]},
    },
}}
ANTHROPIC_SYSTEM = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]}
MESSAGES_REQUEST = {
    "type": "object", "required": ["model", "max_tokens", "messages"],
    "description": "Anthropic Messages API (image, tool_use and tool_result blocks, tools, tool_choice, "
                   "stop_sequences, temperature, top_p, top_k, metadata are accepted too; see docs/protocols.md)",
    "properties": {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": ANTHROPIC_MESSAGES,
        "system": ANTHROPIC_SYSTEM,
        "stream": {"type": "boolean"},
    },
}
COUNT_TOKENS_REQUEST = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "messages": ANTHROPIC_MESSAGES,
        "system": ANTHROPIC_SYSTEM,
    },
}
ANTHROPIC_MESSAGE = {
    "type": "object", "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object", "required": ["type"]}},
        "model": {"type": "string"}, "stop_reason": {"type": ["string", "null"]},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"]},
    },
}
ANTHROPIC_EVENT = {
    "type": "object", "required": ["event", "data"],
    "properties": {
        "event": {"enum": ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                           "message_delta", "message_stop", "ping", "error"]},
        "data": {
            "type": "string",
            "description": "the event's object as JSON, its type the event's name; a failure after the first "
                           "byte is one event: error ({\"type\": \"error\", \"error\": {...}})",
        },
        "id": {"type": "string"},
    },
}
ANTHROPIC_ERRORS = {
    "400": anthropic_error("malformed body (invalid_request_error)"),
    "401": anthropic_error("missing, malformed, unknown, revoked or expired key (authentication_error)"),
    "402": anthropic_error("the key's or subject's budget is spent (billing_error)"),
    "403": anthropic_error("model outside the key's allowlist (permission_error)"),
    "404": anthropic_error("no route for the model (not_found_error)"),
    "413": anthropic_error("body over REQUEST_BODY_LIMIT_BYTES (request_too_large)"),
    "429": anthropic_error("a rate limit is hit (rate_limit_error); Retry-After"),
    "502": anthropic_error("transport failure after retries (api_error)"),
    "504": anthropic_error("the provider took longer than its timeout (api_error)"),
    "529": anthropic_error("no healthy deployment, or overloaded (overloaded_error); Retry-After"),
    "default": {
        "description": "an HTTP error answered by the provider itself, with its status, in Anthropic's shape",
        "content": {JSON: {"schema": {}}},
    },
}


COMPLETION_REQUEST = {
    "type": "object", "required": ["model", "prompt"],
    "description": "OpenAI legacy completions; one prompt per request; echo, suffix, logprobs and best_of > 1 are refused",
    "properties": {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}]},
        "stream": {"type": "boolean"},
    },
}


RESPONSE_REQUEST = {
    "type": "object", "required": ["model", "input"],
    "description": "OpenAI's Responses API. Only the fields the gateway checks are listed; the rest follow "
                   "OpenAI's documentation (docs/protocols.md says what is translated for chat deployments)",
    "properties": {
        "model": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "input": {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": {"type": "object"}}]},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "metadata": {"type": ["object", "null"]},
        "text": {"type": ["object", "null"]},
        "store": {"type": ["boolean", "null"]},
        "stream": {"type": ["boolean", "null"]},
        "previous_response_id": {"type": ["string", "null"], "minLength": 1},
    },
}
RESPONSE_OBJECT = {
    "type": "object", "required": ["id", "object", "status", "output"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "status": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object"}}, "usage": {"type": ["object", "null"]},
    },
}
RESPONSE_EVENT = {
    "type": "object", "required": ["type", "sequence_number"],
    "description": "one typed event (event: TYPE, data: this), sequence_number 0, 1, 2, ...",
    "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer", "minimum": 0}},
}
INPUT_ITEM_LIST = {
    "type": "object", "required": ["object", "data", "has_more"],
    "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
        "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
        "has_more": {"type": "boolean"},
    },
}
RESPONSE_DELETED = {
    "type": "object", "required": ["id", "object", "deleted"],
    "properties": {"id": {"type": "string"}, "object": {"const": "response"}, "deleted": {"const": True}},
}
