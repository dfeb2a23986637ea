"""The gateway's own errors, one class per row of the contract's error table.

    GatewayError                    any error the gateway answers itself
    ├── InvalidRequest              400 invalid_request_error (code varies)
    │   └── GuardrailBlocked        400 guardrail_blocked (names the policy)
    ├── RequestTooLarge             413 request_too_large
    ├── RequestTimeout              408 request_timeout
    ├── AuthenticationFailed        401 invalid_api_key
    ├── BudgetExceeded              402 budget_exceeded
    ├── ModelNotAllowed             403 model_not_allowed
    ├── ModelNotFound               404 model_not_found
    ├── RateLimited                 429 rate_limit_exceeded (Retry-After)
    ├── UpstreamUnavailable         502 upstream_unavailable
    │   └── UpstreamAuthFailed      502 upstream_auth_failed (the provider refused OUR credential)
    ├── ServiceUnavailable          503 (Retry-After)
    │   ├── CircuitOpen             503 circuit_open
    │   └── Overloaded              503 overloaded
    ├── UpstreamTimeout             504 upstream_timeout
    │   (the management plane's own:)
    ├── AdminUnauthorized           401 invalid_admin_token (WWW-Authenticate: Bearer)
    ├── AdminDisabled               403 admin_disabled (no ADMIN_TOKEN configured)
    ├── MetricsUnauthorized         401 invalid_metrics_token (METRICS_TOKEN set, not sent)
    ├── NotFound                    404 not_found (code varies: key_not_found, ...)
    └── Conflict                    409 conflict (code varies: key_state_conflict, ...)

These are the domain's errors: what went wrong, with the contract row (status, type,
code) each one answers as. Nothing here knows HTTP; :mod:`gateway.http.errors` renders
every one to ``{"error": {"message", "type", "code"}}`` (or an SSE error event) in one
place. An error answered by a provider is not a GatewayError: it is relayed with its
own status and body.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AdminDisabled",
    "AdminUnauthorized",
    "AuthenticationFailed",
    "BudgetExceeded",
    "CircuitOpen",
    "Conflict",
    "GatewayError",
    "GuardrailBlocked",
    "InvalidRequest",
    "MetricsUnauthorized",
    "ModelNotAllowed",
    "ModelNotFound",
    "NotFound",
    "Overloaded",
    "RateLimited",
    "RequestTimeout",
    "RequestTooLarge",
    "ServiceUnavailable",
    "UpstreamAuthFailed",
    "UpstreamTimeout",
    "UpstreamUnavailable",
]


class GatewayError(Exception):
    """An error the gateway answers itself, in the OpenAI error shape."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    default_message: ClassVar[str] = "internal error"

    def __init__(
        self,
        message: str | None = None,
        *,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.error_code = code if code is not None else self.code
        self.retry_after = retry_after
        self.headers = headers or {}
        super().__init__(self.message)


class InvalidRequest(GatewayError):
    """The request body is malformed; ``code`` says how."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    default_message = "invalid request"


class GuardrailBlocked(InvalidRequest):
    """A guardrail policy refused the call; names the policy, never the matched text."""

    code = "guardrail_blocked"
    default_message = "blocked by a guardrail policy"

    def __init__(self, policy: str, direction: str = "input") -> None:
        where = "the request" if direction == "input" else "the answer"
        super().__init__(f"{where} was blocked by guardrail policy {policy!r}")
        self.policy = policy
        self.direction = direction


class RequestTooLarge(GatewayError):
    """The body is over ``REQUEST_BODY_LIMIT_BYTES``."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    default_message = "request body too large"


class RequestTimeout(GatewayError):
    """The client did not finish sending its body within ``CLIENT_IDLE_TIMEOUT_SECONDS``."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    default_message = "request body not received in time"


class AuthenticationFailed(GatewayError):
    """Missing, malformed, unknown, revoked or expired key: one message for all."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    default_message = "invalid API key"


class BudgetExceeded(GatewayError):
    """The key's or subject's budget for the period is spent."""

    status = 402
    type = "insufficient_quota"
    code = "budget_exceeded"
    default_message = "budget exceeded"


class ModelNotAllowed(GatewayError):
    """The model is outside the key's allowlist."""

    status = 403
    type = "permission_error"
    code = "model_not_allowed"
    default_message = "model not allowed for this key"


class ModelNotFound(GatewayError):
    """No route matches the requested model."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    default_message = "model not found"


class RateLimited(GatewayError):
    """A rate limit or quota is hit; the client may retry after ``retry_after``."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    default_message = "rate limit exceeded"


class UpstreamUnavailable(GatewayError):
    """The provider could not be reached, after retries."""

    status = 502
    type = "upstream_error"
    code = "upstream_unavailable"
    default_message = "upstream unavailable"


class UpstreamAuthFailed(UpstreamUnavailable):
    """The provider refused the gateway's own credential (its 401/403).

    Not the client's key: relaying the provider's 401 would tell the client *its* key is
    bad. The operator must fix the provider's ``api_key``; the client gets a 502.
    """

    code = "upstream_auth_failed"
    default_message = "the gateway could not authenticate with the provider"


class UpstreamTimeout(GatewayError):
    """The provider took longer than its timeout."""

    status = 504
    type = "timeout_error"
    code = "upstream_timeout"
    default_message = "upstream timed out"


class ServiceUnavailable(GatewayError):
    """The gateway cannot take this request now; try again after ``retry_after``."""

    status = 503
    type = "service_unavailable"
    code = "service_unavailable"
    default_message = "service unavailable"


class CircuitOpen(ServiceUnavailable):
    """Every deployment of the model is unhealthy (circuit open)."""

    code = "circuit_open"
    default_message = "no healthy deployment for this model"


class Overloaded(ServiceUnavailable):
    """An actor's mailbox is full: the gateway sheds load rather than queueing."""

    code = "overloaded"
    default_message = "gateway overloaded"


class AdminUnauthorized(GatewayError):
    """The admin token is missing or wrong (one answer for both)."""

    status = 401
    type = "authentication_error"
    code = "invalid_admin_token"
    default_message = "invalid admin token"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="llm-gateway admin"'})


class MetricsUnauthorized(GatewayError):
    """``METRICS_TOKEN`` is set and the scrape did not send it (one answer for missing and wrong)."""

    status = 401
    type = "authentication_error"
    code = "invalid_metrics_token"
    default_message = "invalid metrics token"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="llm-gateway metrics"'})


class AdminDisabled(GatewayError):
    """No ``ADMIN_TOKEN`` is configured: the admin API is off."""

    status = 403
    type = "permission_error"
    code = "admin_disabled"
    default_message = "admin API disabled"


class NotFound(GatewayError):
    """The addressed thing (a key, ...) does not exist; ``code`` says what."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"
    default_message = "not found"


class Conflict(GatewayError):
    """The thing exists but its state forbids the change; ``code`` says why."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"
    default_message = "conflict with the current state"
