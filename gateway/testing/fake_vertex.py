"""A fake Vertex AI endpoint and Google OAuth2 token endpoint, on one aiohttp app.

``POST /token`` runs the service-account JWT-bearer grant as Google's does: the
``assertion`` must be an RS256 JWT whose signature verifies with the service account's
public key, issued by its ``client_email``, for Google's token endpoint (``aud``), with the
``cloud-platform`` scope and not expired; it answers ``{"access_token", "expires_in",
"token_type"}``. ``POST /v1/projects/{project}/locations/{location}/publishers/google/
models/{model}:generateContent`` (and ``:streamGenerateContent?alt=sse``) need
``Authorization: Bearer`` with an issued, unexpired token (else Google's 401
UNAUTHENTICATED) and the fake's project and location (else 403 / 400), then answer as
the Gemini fake does (gateway/testing/fake_gemini.py). Text embedding models answer
``:predict``: ``instances[].content`` (with ``task_type`` / ``title``), ``parameters``
``outputDimensionality`` / ``autoTruncate``, at most 250 instances, other fields a 400
INVALID_ARGUMENT; ``predictions[].embeddings`` ``{values, statistics: {token_count,
truncated}}`` and ``metadata.billableCharacterCount``. Claude models answer at
``publishers/anthropic/models/{model}:rawPredict`` / ``:streamRawPredict`` with the
Messages API's shapes (gateway/testing/fake_llm.py), requiring Vertex's
``anthropic_version: vertex-2023-10-16`` and no ``model`` in the body.

The GCE metadata server is here too (for Application Default Credentials on GCE, GKE,
Cloud Run): ``GET /`` answers the ``Metadata-Flavor: Google`` ping, and
``/computeMetadata/v1/`` the project id, the default service account's info and its
access token (issued and accepted like the token endpoint's), each only to a request
carrying ``Metadata-Flavor: Google``, as the real server wants.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from gateway.core.tokens import count_tokens
from gateway.testing.fake_gemini import answer_model_call, google_error
from gateway.testing.fake_llm import anthropic_message, anthropic_stream_events
from gateway.testing.fake_vendor import STATE_KEY, VendorState, json_response, unit_vector

__all__ = ["VertexFake", "make_app"]

_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
#: The audience Google's token endpoint requires of a service-account assertion, whatever
#: ``token_uri`` the key file names (google-auth always writes this one).
_AUDIENCE = "https://oauth2.googleapis.com/token"


@dataclass(slots=True)
class VertexFake:
    """What the fake accepts: one service account, one project and location."""

    public_key: rsa.RSAPublicKey
    client_email: str = "gateway@fake-project.iam.gserviceaccount.com"
    project: str = "fake-project"
    location: str = "europe-west4"
    models: tuple[str, ...] = ("gemini-2.5-flash",)
    embedding_models: tuple[str, ...] = ("text-embedding-005",)
    token_lifetime: int = 3599
    state: VendorState = field(default_factory=VendorState)
    #: Issued token → when it expires (Unix seconds).
    expiries: dict[str, float] = field(default_factory=dict)


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _verified_claims(assertion: str, fake: VertexFake, audience: str) -> dict[str, Any] | str:
    """The JWT's claims when its signature and claims hold; else why not."""
    try:
        header_part, claims_part, signature_part = assertion.split(".")
        header, claims = orjson.loads(_b64(header_part)), orjson.loads(_b64(claims_part))
    except (ValueError, orjson.JSONDecodeError):
        return "malformed assertion"
    if header.get("alg") != "RS256":
        return "unsupported algorithm"
    try:
        fake.public_key.verify(_b64(signature_part), f"{header_part}.{claims_part}".encode(),
                               padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return "Invalid JWT Signature."
    if claims.get("iss") != fake.client_email or claims.get("aud") != audience:
        return "Invalid JWT: issuer or audience"
    if _SCOPE not in str(claims.get("scope", "")).split():
        return "Invalid OAuth scope"
    if not isinstance(claims.get("exp"), int) or claims["exp"] < time.time():
        return "Invalid JWT: Token must be a short-lived token and in a reasonable timeframe."
    return dict(claims)


async def _token(request: web.Request) -> web.Response:
    fake: VertexFake = request.app[_FAKE_KEY]
    form = await fake.state.record(request)
    if not isinstance(form, dict) or form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
        return json_response({"error": "unsupported_grant_type", "error_description": "Invalid grant_type"}, 400)
    claims = _verified_claims(str(form.get("assertion", "")), fake, _AUDIENCE)
    if isinstance(claims, str):
        return json_response({"error": "invalid_grant", "error_description": claims}, 400)
    return json_response(_issue_token(fake))


async def _model_route(request: web.Request) -> web.StreamResponse:
    fake: VertexFake = request.app[_FAKE_KEY]
    body = await fake.state.record(request)
    if (refused := _refused(request, fake)) is not None:
        return refused
    if request.match_info["target"].endswith(":predict"):
        return _predict(fake, request.match_info["target"].removesuffix(":predict"), body)
    return await answer_model_call(request, fake.state, fake.models, body)


_INSTANCE_FIELDS = {"content", "task_type", "title"}
_PARAMETER_FIELDS = {"outputDimensionality", "autoTruncate"}


def _predict(fake: VertexFake, model: str, body: Any) -> web.Response:
    """A text embedding model's ``:predict``."""
    if model not in fake.embedding_models:
        return google_error(404, f"Publisher Model `{model}` was not found or your project does not have access to it.")
    instances = body.get("instances") if isinstance(body, dict) else None
    parameters = (body.get("parameters") or {}) if isinstance(body, dict) else {}
    if not isinstance(instances, list) or not 0 < len(instances) <= 250 or set(body) - {"instances", "parameters"} \
            or not isinstance(parameters, dict) or set(parameters) - _PARAMETER_FIELDS \
            or not all(isinstance(i, dict) and isinstance(i.get("content"), str) and not set(i) - _INSTANCE_FIELDS
                       for i in instances):
        return google_error(400, "Invalid JSON payload: instances[] of {content} (1 to 250) and parameters "
                                 "{outputDimensionality, autoTruncate} only.")
    step = fake.state.next_step()
    if "status" in step:
        return google_error(int(step["status"]), "scripted failure")
    dimensions = int(parameters.get("outputDimensionality") or 768)
    predictions = [{"embeddings": {"values": unit_vector(i["content"], dimensions),
                                   "statistics": {"token_count": count_tokens(i["content"]), "truncated": False}}}
                   for i in instances]
    return json_response({"predictions": predictions,
                          "metadata": {"billableCharacterCount": sum(len(i["content"]) for i in instances)}})


def _refused(request: web.Request, fake: VertexFake) -> web.Response | None:
    """Google's answer to a missing or expired token, or a foreign project or location."""
    auth = request.headers.get("Authorization", "")
    token = auth[7:] if auth.startswith("Bearer ") else None
    if token is None or fake.expiries.get(token, 0) < time.time():
        return google_error(401, "Request had invalid authentication credentials. Expected OAuth 2 access token, "
                                 "login cookie or other valid authentication credential.")
    if request.match_info["project"] != fake.project:
        return google_error(403, f"Permission denied on resource project {request.match_info['project']}.")
    if request.match_info["location"] != fake.location:
        return google_error(400, f"Location {request.match_info['location']} is not supported.")
    return None


async def _anthropic_route(request: web.Request) -> web.StreamResponse:
    """Claude on Vertex: the Messages API body at ``:rawPredict`` / ``:streamRawPredict``."""
    fake: VertexFake = request.app[_FAKE_KEY]
    body = await fake.state.record(request)
    if (refused := _refused(request, fake)) is not None:
        return refused
    model, _, method = request.match_info["target"].partition(":")
    if not isinstance(body, dict) or body.get("anthropic_version") != "vertex-2023-10-16" or "model" in body:
        return json_response({"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "anthropic_version: vertex-2023-10-16 is required and model must not be in the body"}}, 400)
    step = fake.state.next_step()
    if "status" in step:
        return google_error(int(step["status"]), "scripted failure")
    answered = {**body, "model": model}
    if method == "rawPredict":
        return json_response(anthropic_message(answered, message_id=f"msg_vrtx_{len(fake.state.calls)}"))
    if method != "streamRawPredict":
        return google_error(404, f"method {method} not found")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in anthropic_stream_events(answered, message_id=f"msg_vrtx_{len(fake.state.calls)}"):
        await response.write(event)
    await response.write_eof()
    return response


_METADATA_FLAVOR = {"Metadata-Flavor": "Google"}


def _issue_token(fake: VertexFake) -> dict[str, Any]:
    token = f"ya29.fake-{len(fake.expiries) + 1}"
    fake.expiries[token] = time.time() + fake.token_lifetime
    fake.state.issued_tokens.append(token)
    return {"access_token": token, "expires_in": fake.token_lifetime, "token_type": "Bearer"}


async def _metadata(request: web.Request) -> web.Response:
    """The GCE metadata server's few routes google-auth reads."""
    fake: VertexFake = request.app[_FAKE_KEY]
    await fake.state.record(request)
    if request.headers.get("Metadata-Flavor") != "Google":
        return web.Response(status=403, text="Missing Metadata-Flavor:Google header.", headers=_METADATA_FLAVOR)
    path = request.match_info["path"]
    if path == "":
        return web.Response(text="computeMetadata/\n", headers=_METADATA_FLAVOR)
    if path == "computeMetadata/v1/project/project-id":
        return web.Response(text=fake.project, headers=_METADATA_FLAVOR)
    if path == "computeMetadata/v1/universe/universe-domain":
        return web.Response(text="googleapis.com", headers=_METADATA_FLAVOR)
    if path == "computeMetadata/v1/instance/service-accounts/default/":
        return json_response({"aliases": ["default"], "email": fake.client_email, "scopes": [_SCOPE]},
                             headers=_METADATA_FLAVOR)
    if path == "computeMetadata/v1/instance/service-accounts/default/token":
        return json_response(_issue_token(fake), headers=_METADATA_FLAVOR)
    return web.Response(status=404, text="not found", headers=_METADATA_FLAVOR)


_FAKE_KEY = web.AppKey("vertex_fake", VertexFake)


def make_app(fake: VertexFake) -> web.Application:
    """The fake Vertex endpoint and token endpoint serving ``fake``'s rules."""
    app = web.Application()
    app[_FAKE_KEY] = fake
    app[STATE_KEY] = fake.state
    app.router.add_post("/token", _token)
    app.router.add_get("/{path:(computeMetadata/.*)?}", _metadata)
    app.router.add_post(
        "/v1/projects/{project}/locations/{location}/publishers/google/models/{target}", _model_route)
    app.router.add_post(
        "/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{target}", _anthropic_route)
    return app
