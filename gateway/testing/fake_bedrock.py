"""A fake AWS Bedrock runtime: Converse, ConverseStream and InvokeModel for embedding
models, checked as AWS checks them, in several regions.

``POST /model/{modelId}/converse``, ``/converse-stream`` and ``/invoke``: the endpoint of
the fake's default ``region``; the same under ``/{region}/model/...``: the endpoint of
that region (one of ``regions``), as ``bedrock-runtime.{region}.amazonaws.com`` is. Every
request must carry a SigV4 signature (``AWS4-HMAC-SHA256``, service ``bedrock``) scoped to
the endpoint's region, that the fake verifies by recomputing it with botocore's signer
over the headers named in ``SignedHeaders``, the raw path, the body and ``X-Amz-Date``
(more than 5 minutes off is refused), for a known access key; failures answer AWS's 403s
(``UnrecognizedClientException``, ``InvalidSignatureException``, "Credential should be
scoped to a valid region") with ``x-amzn-ErrorType``.

The Claude models also answer InvokeModel with Anthropic's Messages body
(``anthropic_version: bedrock-2023-05-31``, no ``model``): ``/invoke`` a message,
``/invoke-with-response-stream`` an event stream of ``chunk`` events whose payload is
``{"bytes": base64 of one Messages stream event}``, the last carrying
``amazon-bedrock-invocationMetrics`` (input and output token counts), as Bedrock sends.

``GET /container-credentials`` is the ECS / EKS container credentials endpoint (for
``AWS_CONTAINER_CREDENTIALS_FULL_URI``): it answers the fake's key pair with a fresh session
token (``container-token-N``) expiring ``container_lifetime`` seconds from now.

``PUT /latest/api/token`` and ``GET /latest/meta-data/iam/security-credentials/[role]`` are
the EC2 instance metadata service (IMDSv2, for ``AWS_EC2_METADATA_SERVICE_ENDPOINT``), as
an instance that requires session tokens answers: the PUT needs
``X-aws-ec2-metadata-token-ttl-seconds`` (1 to 21600) and answers a session token; a GET
without a live one is a 401; the listing names the instance role (``imds_role``; None: no
role attached, a 404) and the role's document holds the fake's key pair with a fresh
session token (``imds-token-N``) expiring ``container_lifetime`` seconds from now.

``POST /sts`` is STS's ``AssumeRoleWithWebIdentity`` (for ``AWS_ENDPOINT_URL_STS``, with
``AWS_ROLE_ARN`` and ``AWS_WEB_IDENTITY_TOKEN_FILE``): the form's ``WebIdentityToken``
must be the fake's ``web_identity_token`` (STS verifies the OIDC token), and the answer is
STS's XML with the fake's key pair and a fresh session token (``web-identity-token-N``).

InvokeModel bodies are the model's own: Amazon Titan Text Embeddings V2
(``amazon.titan-embed-text-v2:0``: ``inputText``, ``dimensions`` 256 / 512 / 1024,
``normalize``, ``embeddingTypes``; answers ``embedding``, ``inputTextTokenCount``,
``embeddingsByType``) and Cohere Embed (``cohere.embed-english-v3``: ``texts`` (at most
96), ``input_type``, ``truncate``, ``embedding_types``; answers ``embeddings``). Both set
``X-Amzn-Bedrock-Input-Token-Count`` as InvokeModel does; unknown fields are a
``ValidationException``. Streams are
``application/vnd.amazon.eventstream`` binary frames (prelude, string headers
``:event-type`` / ``:message-type`` / ``:content-type``, JSON payload, both CRC32s),
encoded here by :func:`encode_frame`.

Answers: text "This is a mock answer to: <last user text>"; with tools and a last user
turn that is not a tool result, a ``toolUse`` of the first tool; after a tool result,
text quoting it. Script steps (``VendorState.script``): ``{"status": 429}`` (a
``ThrottlingException``), ``{"stream_exception": "throttlingException"}`` (an exception
frame after the first two events), ``{"corrupt_crc": true}`` (the third frame's CRC broken).
"""

from __future__ import annotations

import base64
import calendar
import itertools
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from gateway.core.tokens import count_tokens
from gateway.testing.fake_llm import anthropic_message, anthropic_stream_events
from gateway.testing.fake_vendor import STATE_KEY, VendorState, json_response, unit_vector

__all__ = ["BedrockFake", "encode_frame", "make_app"]

_MAX_SKEW_SECONDS = 300


@dataclass(slots=True)
class BedrockFake:
    """What the fake accepts."""

    access_key: str = "AKIAFAKEFAKEFAKE0001"
    secret_key: str = "fake/secret/key/for/sigv4/tests/0000000001"
    #: The region of the endpoint at the root (``/model/...``).
    region: str = "eu-west-1"
    #: The regions served under ``/{region}/model/...``.
    regions: tuple[str, ...] = ("eu-west-1", "us-east-1", "ap-southeast-2")
    models: tuple[str, ...] = ("anthropic.claude-3-5-haiku-20241022-v1:0", "amazon.nova-lite-v1:0")
    embedding_models: tuple[str, ...] = ("amazon.titan-embed-text-v2:0", "cohere.embed-english-v3")
    state: VendorState = field(default_factory=VendorState)
    #: Lifetime of the temporary credentials ``/container-credentials`` hands out.
    container_lifetime: int = 3600
    #: The instance role the metadata service lists (None: the instance has none).
    imds_role: str | None = "gateway-instance-role"
    #: The metadata service's session tokens it handed out (IMDSv2), and so accepts.
    imds_sessions: list[str] = field(default_factory=list)
    #: The OIDC token STS accepts for ``AssumeRoleWithWebIdentity``.
    web_identity_token: str = "eyJraWQiOiJmYWtlIn0.fake-oidc-token.sig"
    #: What each verified request was signed with (date, signed header names, token, region).
    signatures: list[dict[str, Any]] = field(default_factory=list)


def encode_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message: prelude (lengths + CRC), string headers, payload, CRC."""
    encoded = b"".join(
        bytes([len(name)]) + name.encode() + b"\x07" + struct.pack(">H", len(value.encode())) + value.encode()
        for name, value in headers.items())
    prelude = struct.pack(">II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def _event(event_type: str, payload: dict[str, Any]) -> bytes:
    return encode_frame({":event-type": event_type, ":content-type": "application/json", ":message-type": "event"},
                        orjson.dumps(payload))


def _aws_error(status: int, name: str, message: str) -> web.Response:
    return json_response({"message": message}, status,
                         {"x-amzn-ErrorType": f"{name}:http://internal.amazon.com/coral/com.amazon.bedrock/",
                          "x-amzn-RequestId": "fake-error"})


def _verify_signature(request: web.Request, body: bytes, fake: BedrockFake, endpoint_region: str) -> web.Response | None:
    """None when the SigV4 signature recomputes, scoped to the endpoint's region; else AWS's 403."""
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return _aws_error(403, "MissingAuthenticationTokenException", "Missing Authentication Token")
    fields = dict(item.strip().split("=", 1) for item in auth[len("AWS4-HMAC-SHA256 "):].split(","))
    access_key, date, region, service, _ = fields["Credential"].split("/")
    if access_key != fake.access_key:
        return _aws_error(403, "UnrecognizedClientException", "The security token included in the request is invalid.")
    stamp = request.headers.get("X-Amz-Date", "")
    try:
        signed_at = calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        return _aws_error(400, "IncompleteSignatureException", "X-Amz-Date is missing or malformed")
    if abs(time.time() - signed_at) > _MAX_SKEW_SECONDS:
        return _aws_error(403, "InvalidSignatureException", "Signature expired")
    if region != endpoint_region:
        return _aws_error(403, "InvalidSignatureException",
                          f"Credential should be scoped to a valid region. Expected {endpoint_region}, got {region}.")
    if service != "bedrock" or date != stamp[:8]:
        return _aws_error(403, "InvalidSignatureException", "Credential should be scoped to correct service: 'bedrock'.")
    names = fields["SignedHeaders"].split(";")
    headers = {name: request.headers[name] for name in names if name != "host" and name in request.headers}
    url = f"{request.scheme}://{request.headers.get('Host', request.host)}{request.raw_path}"
    recomputed = AWSRequest(method=request.method, url=url, data=body, headers=headers)
    recomputed.context["timestamp"] = stamp
    token = request.headers.get("X-Amz-Security-Token")
    signer = SigV4Auth(Credentials(fake.access_key, fake.secret_key, token), "bedrock", region)
    expected = signer.signature(signer.string_to_sign(recomputed, signer.canonical_request(recomputed)), recomputed)
    if expected != fields["Signature"]:
        return _aws_error(403, "InvalidSignatureException",
                          "The request signature we calculated does not match the signature you provided.")
    fake.signatures.append({"date": stamp, "signed_headers": names, "token": token, "region": region})
    return None


def _answer_blocks(body: dict[str, Any]) -> list[dict[str, Any]]:
    last = body["messages"][-1]
    results = [b["toolResult"] for b in last["content"] if "toolResult" in b]
    if results:
        return [{"text": "Tool said: " + orjson.dumps(results[0]["content"]).decode()}]
    last_text = next((b["text"] for b in reversed(last["content"]) if "text" in b), "")
    tools = (body.get("toolConfig") or {}).get("tools") or []
    if tools and last["role"] == "user":
        return [{"toolUse": {"toolUseId": "tooluse_fake1", "name": tools[0]["toolSpec"]["name"],
                             "input": {"query": last_text}}}]
    return [{"text": f"This is a mock answer to: {last_text}"}]


def _validate(body: Any) -> str | None:
    if not isinstance(body, dict):
        return "Malformed input request"
    unknown = set(body) - {"messages", "system", "inferenceConfig", "toolConfig", "guardrailConfig",
                           "additionalModelRequestFields", "additionalModelResponseFieldPaths"}
    if unknown:
        return f"extraneous key [{sorted(unknown)[0]}] is not permitted"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or messages[0].get("role") != "user":
        return "A conversation must start with a user message."
    for a, b in itertools.pairwise(messages):
        if a.get("role") == b.get("role"):
            return "A conversation must alternate between user and assistant roles."
    return None


async def _model_route(request: web.Request) -> web.StreamResponse:
    fake: BedrockFake = request.app[_FAKE_KEY]
    raw = await request.read()
    body = await fake.state.record(request)
    region = request.match_info.get("region", fake.region)
    if region not in fake.regions:
        return _aws_error(404, "UnknownOperationException", f"no endpoint in region {region}")
    if (denied := _verify_signature(request, raw, fake, region)) is not None:
        return denied
    model = request.match_info["model"]
    if request.match_info["operation"].startswith("invoke") and model in fake.models:
        return await _invoke_claude(request, fake, model, body)
    if request.match_info["operation"] == "invoke":
        return _invoke(fake, model, body)
    if model not in fake.models:
        return _aws_error(404, "ResourceNotFoundException", "Model not found")
    if (problem := _validate(body)) is not None:
        return _aws_error(400, "ValidationException", problem)
    step = fake.state.next_step()
    if step.get("status") == 429:
        return _aws_error(429, "ThrottlingException", "Too many requests, please wait before trying again.")
    blocks = _answer_blocks(body)
    prompt = sum(count_tokens(b.get("text", "")) for m in body["messages"] for b in m["content"])
    prompt += sum(count_tokens(s.get("text", "")) for s in body.get("system") or [])
    output = sum(count_tokens(b["text"]) if "text" in b else 6 for b in blocks)
    stop = "tool_use" if "toolUse" in blocks[0] else "end_turn"
    usage = {"inputTokens": prompt, "outputTokens": output, "totalTokens": prompt + output}
    if request.match_info["operation"] == "converse":
        return json_response({"output": {"message": {"role": "assistant", "content": blocks}}, "stopReason": stop,
                              "usage": usage, "metrics": {"latencyMs": 12}},
                             headers={"x-amzn-RequestId": f"req-{len(fake.state.calls)}"})
    frames = [_event("messageStart", {"role": "assistant"})]
    if "text" in blocks[0]:
        for i, word in enumerate(blocks[0]["text"].split(" ")):
            frames.append(_event("contentBlockDelta", {"contentBlockIndex": 0,
                                                       "delta": {"text": word if i == 0 else f" {word}"}}))
    else:
        tool = blocks[0]["toolUse"]
        frames.append(_event("contentBlockStart", {"contentBlockIndex": 0, "start": {
            "toolUse": {"toolUseId": tool["toolUseId"], "name": tool["name"]}}}))
        arguments = orjson.dumps(tool["input"]).decode()
        for piece in (arguments[: len(arguments) // 2], arguments[len(arguments) // 2:]):
            frames.append(_event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"toolUse": {"input": piece}}}))
    frames += [_event("contentBlockStop", {"contentBlockIndex": 0}), _event("messageStop", {"stopReason": stop}),
               _event("metadata", {"usage": usage, "metrics": {"latencyMs": 12}})]
    if step.get("stream_exception"):
        frames = [*frames[:2], encode_frame({":exception-type": step["stream_exception"], ":content-type": "application/json", ":message-type": "exception"}, b'{"message":"Too many requests"}')]
    if step.get("corrupt_crc"):
        broken = bytearray(frames[2])
        broken[-1] ^= 0xFF
        frames[2] = bytes(broken)
    response = web.StreamResponse(headers={"Content-Type": "application/vnd.amazon.eventstream",
                                           "x-amzn-RequestId": f"req-{len(fake.state.calls)}"})
    await response.prepare(request)
    for frame in frames:
        # Split frames across writes, as TCP may: the parser must reassemble them.
        await response.write(frame[:7])
        await response.write(frame[7:])
    await response.write_eof()
    return response


async def _invoke_claude(request: web.Request, fake: BedrockFake, model: str, body: Any) -> web.StreamResponse:
    """InvokeModel / InvokeModelWithResponseStream of a Claude model: the Messages API body."""
    if not isinstance(body, dict) or body.get("anthropic_version") != "bedrock-2023-05-31" or "model" in body:
        return _aws_error(400, "ValidationException", "anthropic_version bedrock-2023-05-31 is required; "
                                                      "extraneous key [model] is not permitted")
    answered = {**body, "model": model}
    message_id = f"msg_bdrk_{len(fake.state.calls)}"
    request_id = {"x-amzn-RequestId": f"req-{len(fake.state.calls)}"}
    if request.match_info["operation"] == "invoke":
        message = anthropic_message(answered, message_id=message_id)
        return json_response(message, headers={
            **request_id, "X-Amzn-Bedrock-Input-Token-Count": str(message["usage"]["input_tokens"]),
            "X-Amzn-Bedrock-Output-Token-Count": str(message["usage"]["output_tokens"])})
    events = [orjson.loads(line[6:]) for event in anthropic_stream_events(answered, message_id=message_id)
              for line in event.split(b"\n") if line.startswith(b"data: ")]
    tokens_in = events[0]["message"]["usage"]["input_tokens"]
    tokens_out = next(e["usage"]["output_tokens"] for e in events if e["type"] == "message_delta")
    events[-1]["amazon-bedrock-invocationMetrics"] = {"inputTokenCount": tokens_in, "outputTokenCount": tokens_out,
                                                      "invocationLatency": 120, "firstByteLatency": 40}
    response = web.StreamResponse(headers={"Content-Type": "application/vnd.amazon.eventstream", **request_id})
    await response.prepare(request)
    for event in events:
        payload = orjson.dumps({"bytes": base64.b64encode(orjson.dumps(event)).decode()})
        frame = encode_frame({":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"},
                             payload)
        await response.write(frame[:5])
        await response.write(frame[5:])
    await response.write_eof()
    return response


_TITAN_FIELDS = {"inputText", "dimensions", "normalize", "embeddingTypes"}
_COHERE_FIELDS = {"texts", "images", "input_type", "truncate", "embedding_types"}
_COHERE_INPUT_TYPES = {"search_document", "search_query", "classification", "clustering", "image"}


def _invoke(fake: BedrockFake, model: str, body: Any) -> web.Response:
    """InvokeModel for the embedding models, with their own bodies."""
    if model not in fake.embedding_models:
        return _aws_error(404, "ResourceNotFoundException", "Model not found")
    if not isinstance(body, dict):
        return _aws_error(400, "ValidationException", "Malformed input request, please reformat your input and try again.")
    step = fake.state.next_step()
    if step.get("status") == 429:
        return _aws_error(429, "ThrottlingException", "Too many requests, please wait before trying again.")
    if model.startswith("amazon.titan-embed"):
        unknown = set(body) - _TITAN_FIELDS
        text, dimensions = body.get("inputText"), body.get("dimensions", 1024)
        if unknown or not isinstance(text, str) or not text or dimensions not in (256, 512, 1024):
            return _aws_error(400, "ValidationException", "Malformed input request: "
                              + (f"extraneous key [{sorted(unknown)[0]}] is not permitted" if unknown else
                                 "#/inputText or #/dimensions is invalid"))
        tokens = count_tokens(text)
        vector = unit_vector(text, dimensions)
        return json_response({"embedding": vector, "inputTextTokenCount": tokens,
                              "embeddingsByType": {"float": vector}},
                             headers={"X-Amzn-Bedrock-Input-Token-Count": str(tokens),
                                      "x-amzn-RequestId": f"req-{len(fake.state.calls)}"})
    unknown = set(body) - _COHERE_FIELDS
    texts = body.get("texts")
    if unknown or body.get("input_type") not in _COHERE_INPUT_TYPES or not isinstance(texts, list) \
            or not 0 < len(texts) <= 96 or not all(isinstance(t, str) for t in texts):
        return _aws_error(400, "ValidationException", "Malformed input request: texts (1 to 96 strings) and "
                                                      "input_type are required; no other keys")
    tokens = sum(count_tokens(t) for t in texts)
    return json_response({"embeddings": [unit_vector(t, 1024) for t in texts], "id": f"emb-{len(fake.state.calls)}",
                          "response_type": "embeddings_floats", "texts": texts},
                         headers={"X-Amzn-Bedrock-Input-Token-Count": str(tokens),
                                  "x-amzn-RequestId": f"req-{len(fake.state.calls)}"})


async def _container_credentials(request: web.Request) -> web.Response:
    fake: BedrockFake = request.app[_FAKE_KEY]
    await fake.state.record(request)
    token = f"container-token-{len(fake.state.issued_tokens) + 1}"
    fake.state.issued_tokens.append(token)
    expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + fake.container_lifetime))
    return json_response({"AccessKeyId": fake.access_key, "SecretAccessKey": fake.secret_key, "Token": token,
                          "Expiration": expiry, "RoleArn": "arn:aws:iam::123456789012:role/gateway"})


async def _imds_session(request: web.Request) -> web.Response:
    """IMDSv2's ``PUT /latest/api/token``: a session token for the TTL asked for."""
    fake: BedrockFake = request.app[_FAKE_KEY]
    await fake.state.record(request)
    ttl = request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
    if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
        return web.Response(status=400, text="Bad Request")
    session = f"imds-session-{len(fake.imds_sessions) + 1}"
    fake.imds_sessions.append(session)
    return web.Response(text=session, headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})


async def _imds_credentials(request: web.Request) -> web.Response:
    """``GET /latest/meta-data/iam/security-credentials/`` (the role's name) and
    ``.../{role}`` (its temporary credentials), with a session token required."""
    fake: BedrockFake = request.app[_FAKE_KEY]
    await fake.state.record(request)
    if request.headers.get("X-aws-ec2-metadata-token") not in fake.imds_sessions:
        return web.Response(status=401, text="Unauthorized")
    role = request.match_info.get("role", "")
    if fake.imds_role is None or role not in ("", fake.imds_role):
        return web.Response(status=404, text="Not Found")
    if not role:
        return web.Response(text=fake.imds_role)
    token = f"imds-token-{len(fake.state.issued_tokens) + 1}"
    fake.state.issued_tokens.append(token)
    now = time.time()
    return json_response({
        "Code": "Success", "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "Type": "AWS-HMAC", "AccessKeyId": fake.access_key, "SecretAccessKey": fake.secret_key, "Token": token,
        "Expiration": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + fake.container_lifetime)),
    })


async def _sts(request: web.Request) -> web.Response:
    fake: BedrockFake = request.app[_FAKE_KEY]
    form = await fake.state.record(request)
    if not isinstance(form, dict) or form.get("Action") != "AssumeRoleWithWebIdentity":
        return web.Response(status=400, content_type="text/xml", text="<ErrorResponse><Error><Code>InvalidAction"
                            "</Code></Error></ErrorResponse>")
    if form.get("WebIdentityToken") != fake.web_identity_token or not form.get("RoleArn"):
        return web.Response(status=400, content_type="text/xml", text=(
            '<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender</Type>'
            "<Code>InvalidIdentityToken</Code><Message>Couldn't retrieve verification key from your identity "
            "provider</Message></Error><RequestId>fake</RequestId></ErrorResponse>"))
    token = f"web-identity-token-{len(fake.state.issued_tokens) + 1}"
    fake.state.issued_tokens.append(token)
    expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + fake.container_lifetime))
    role = str(form["RoleArn"]).rpartition("/")[2]
    return web.Response(content_type="text/xml", text=(
        '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
        "<AssumeRoleWithWebIdentityResult><SubjectFromWebIdentityToken>system:serviceaccount:ai:gateway"
        "</SubjectFromWebIdentityToken><AssumedRoleUser><AssumedRoleId>AROAFAKE:session</AssumedRoleId>"
        f"<Arn>arn:aws:sts::123456789012:assumed-role/{role}/session</Arn></AssumedRoleUser><Credentials>"
        f"<SessionToken>{token}</SessionToken><SecretAccessKey>{fake.secret_key}</SecretAccessKey>"
        f"<Expiration>{expiry}</Expiration><AccessKeyId>{fake.access_key}</AccessKeyId></Credentials>"
        "<Audience>sts.amazonaws.com</Audience></AssumeRoleWithWebIdentityResult>"
        "<ResponseMetadata><RequestId>fake-sts</RequestId></ResponseMetadata></AssumeRoleWithWebIdentityResponse>"))


_FAKE_KEY = web.AppKey("bedrock_fake", BedrockFake)


def make_app(fake: BedrockFake) -> web.Application:
    """The fake runtime endpoint serving ``fake``'s rules."""
    app = web.Application()
    app[_FAKE_KEY] = fake
    app[STATE_KEY] = fake.state
    app.router.add_get("/container-credentials", _container_credentials)
    app.router.add_post("/sts", _sts)
    app.router.add_put("/latest/api/token", _imds_session)
    app.router.add_get("/latest/meta-data/iam/security-credentials/", _imds_credentials)
    app.router.add_get("/latest/meta-data/iam/security-credentials/{role}", _imds_credentials)
    operations = "{operation:converse|converse-stream|invoke|invoke-with-response-stream}"
    app.router.add_post(f"/model/{{model}}/{operations}", _model_route)
    app.router.add_post(f"/{{region}}/model/{{model}}/{operations}", _model_route)
    return app
