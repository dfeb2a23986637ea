"""A fake Azure OpenAI resource and Microsoft Entra token endpoint, on one aiohttp app.

It checks what Azure checks: the URL form (``/openai/deployments/{name}/...`` needs an
``api-version`` query parameter the fake knows, else 404 "Resource not found";
``/openai/v1/...`` needs the deployment as the body's ``model``), the deployment exists,
and the credential (the ``api-key`` header, or ``Authorization: Bearer`` with a token
this app's token endpoint issued). ``POST /{tenant}/oauth2/v2.0/token`` runs the
client-credentials grant against the configured client id, secret and Azure's scope.
Answers are the OpenAI shapes of :mod:`gateway.testing.fake_llm` with Azure's
``prompt_filter_results`` (a first stream chunk with no choices, as Azure sends).

Script steps (``VendorState.script``): ``{"status": N, "headers": {...}}`` answers an
Azure-shaped error; ``{"content_filter": true}`` answers Azure's content-filter 400.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from gateway.testing.fake_llm import completion, embeddings, encode_event, stream_chunks
from gateway.testing.fake_vendor import STATE_KEY, VendorState, json_response

__all__ = ["AzureFake", "make_app"]

_SCOPE = "https://cognitiveservices.azure.com/.default"
_FILTER_OK = {name: {"filtered": False, "severity": "safe"} for name in ("hate", "self_harm", "sexual", "violence")}


@dataclass(slots=True)
class AzureFake:
    """What the fake resource accepts."""

    api_key: str | None = "azure-key-1"
    deployments: tuple[str, ...] = ("gpt-4o-prod", "embed-prod")
    api_versions: tuple[str, ...] = ("2024-10-21", "2025-04-01-preview")
    tenant_id: str = "tenant-1"
    client_id: str = "client-1"
    client_secret: str = "secret-1"
    token_lifetime: int = 3599
    state: VendorState = field(default_factory=VendorState)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return json_response({"error": {"code": code, "message": message}}, status, headers)


def _authorized(request: web.Request, fake: AzureFake) -> bool:
    if fake.api_key is not None and request.headers.get("api-key") == fake.api_key:
        return True
    auth = request.headers.get("Authorization", "")
    return auth.startswith("Bearer ") and auth[7:] in fake.state.issued_tokens


async def _token(request: web.Request) -> web.Response:
    fake: AzureFake = request.app[_FAKE_KEY]
    form = await fake.state.record(request)
    if request.match_info["tenant"] != fake.tenant_id:
        return json_response({"error": "invalid_request", "error_description": "AADSTS90002: Tenant not found."}, 400)
    if not isinstance(form, dict) or form.get("grant_type") != "client_credentials":
        return json_response({"error": "unsupported_grant_type", "error_description": "AADSTS70003"}, 400)
    if form.get("client_id") != fake.client_id or form.get("client_secret") != fake.client_secret:
        return json_response({"error": "invalid_client",
                              "error_description": "AADSTS7000215: Invalid client secret provided."}, 401)
    if form.get("scope") != _SCOPE:
        return json_response({"error": "invalid_scope", "error_description": "AADSTS70011"}, 400)
    token = f"entra-token-{len(fake.state.issued_tokens) + 1}"
    fake.state.issued_tokens.append(token)
    return json_response({"token_type": "Bearer", "expires_in": fake.token_lifetime,
                          "ext_expires_in": fake.token_lifetime, "access_token": token})


async def _operation(request: web.Request, fake: AzureFake, deployment: str, operation: str) -> web.StreamResponse:
    if not _authorized(request, fake):
        return _error(401, "401", "Access denied due to invalid subscription key or wrong API endpoint. Make sure "
                                  "to provide a valid key for an active subscription and use a correct regional "
                                  "API endpoint for your resource.")
    if deployment not in fake.deployments:
        return _error(404, "DeploymentNotFound", "The API deployment for this resource does not exist.")
    body = fake.state.calls[-1].body
    if not isinstance(body, dict):
        return _error(400, "BadRequest", "request body must be a JSON object")
    step = fake.state.next_step()
    if step.get("content_filter"):
        filtered = {**_FILTER_OK, "violence": {"filtered": True, "severity": "medium"}}
        return json_response({"error": {
            "message": "The response was filtered due to the prompt triggering Azure OpenAI's content management "
                       "policy. Please modify your prompt and retry.",
            "type": None, "param": "prompt", "code": "content_filter", "status": 400,
            "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": filtered},
        }}, 400)
    if "status" in step:
        return _error(int(step["status"]), str(step["status"]), step.get("message", "scripted failure"),
                      step.get("headers"))
    body = {**body, "model": deployment}
    if operation == "embeddings":
        return json_response(embeddings(body))
    prompt_filter = [{"prompt_index": 0, "content_filter_results": _FILTER_OK}]
    created = int(time.time())
    if body.get("stream") is not True:
        answer = completion(body, response_id=f"chatcmpl-az{len(fake.state.calls)}", created=created)
        answer["prompt_filter_results"] = prompt_filter
        answer["choices"][0]["content_filter_results"] = _FILTER_OK
        return json_response(answer)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(encode_event({"id": "", "object": "", "created": 0, "model": "", "choices": [],
                                       "prompt_filter_results": prompt_filter}))
    for chunk in stream_chunks(body, response_id=f"chatcmpl-az{len(fake.state.calls)}", created=created):
        await response.write(encode_event(chunk))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _deployment_route(request: web.Request) -> web.StreamResponse:
    fake: AzureFake = request.app[_FAKE_KEY]
    await fake.state.record(request)
    if request.query.get("api-version") not in fake.api_versions:
        return _error(404, "404", "Resource not found")
    return await _operation(request, fake, request.match_info["deployment"], request.match_info["operation"])


async def _v1_route(request: web.Request) -> web.StreamResponse:
    fake: AzureFake = request.app[_FAKE_KEY]
    body = await fake.state.record(request)
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        return _error(400, "BadRequest", "Missing required parameter: 'model'.")
    return await _operation(request, fake, model, request.match_info["operation"])


_FAKE_KEY = web.AppKey("azure_fake", AzureFake)


def make_app(fake: AzureFake) -> web.Application:
    """The fake resource (and token endpoint) serving ``fake``'s rules."""
    app = web.Application()
    app[_FAKE_KEY] = fake
    app[STATE_KEY] = fake.state
    operation = "{operation:chat/completions|embeddings}"
    app.router.add_post(f"/openai/deployments/{{deployment}}/{operation}", _deployment_route)
    app.router.add_post(f"/openai/v1/{operation}", _v1_route)
    app.router.add_post("/{tenant}/oauth2/v2.0/token", _token)
    return app
