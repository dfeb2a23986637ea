"""Sending one chat (or embeddings) call: which deployment, how often, and when to move on.

The relay (:mod:`gateway.edge.chat`) asks for a reply; this module decides where it comes
from. The route's targets are ordered by the group's strategy; each is tried under its
circuit breaker with the retry policy of :mod:`gateway.relay.retry`, then the next, then
the group's ``fallbacks`` (model names, resolved like a client's, one level deep).

* A closed circuit costs no hop: the breaker's published snapshot says so. An open one
  is skipped; when its reset timeout is over, one caller asks the breaker for the
  single half-open probe.
* A non-streaming call moves to the next deployment after its retries. A stream is
  retried and may fail over only while nothing has reached the client: this module
  reads the first event itself and returns before the relay writes a byte.
* A timeout or a connection dropped after sending is sent again (anywhere) only where
  the provider's ``retry_on_timeout`` allows; a connection that never opened always is.
* A 429 cools its deployment for its Retry-After and moves on at once; only the last
  candidate waits it out.
* A deployment at its own ``rpm`` / ``tpm``, or whose provider reported nothing left
  (``x-ratelimit-remaining-*``), is passed over before it can answer 429
  (:mod:`gateway.relay.headroom`); when every one is, 429 ``rate_limit_exceeded``.
* A provider whose active health probes fail (``health_check:``, actors/prober.py) is
  passed over like an open circuit, before any call of a user reaches it.
* Nothing attempted because every circuit is open or cooling: 503 ``circuit_open`` with
  the shortest wait as Retry-After.

Every attempt's outcome goes to the breaker as a tell (never awaited): failures,
successes with latency (time to first event for streams), 429s, and cancellations as
neutral. A failed attempt that is sent again to the same deployment is marked
``will_retry``: the breaker counts a call once toward ``fail_max``, by its last attempt
on the deployment, so one unlucky call cannot open a circuit. A stream is watched to its
end, so a stream cut mid-way counts as a failure.

A call may carry the request as its client sent it (:class:`NativeCall`): a target whose
provider speaks that protocol natively (``speaks_messages``, ``speaks_responses``) gets it, with only the model
name changed, and its reply comes back in that wire; every other target gets the chat body.

What a client learns of a failure is the contract's message and its request id; the
detail (aiohttp's text, with upstream hosts and addresses) goes to the log and the span.
A provider's own 401/403 means the gateway's credential for it is wrong, not the
client's key: it moves on to the next deployment (without opening the circuit), is logged at ERROR and counted
(``gateway_upstream_auth_failures_total``), and ends as 502 ``upstream_auth_failed``.

Embeddings (:func:`embed`) go the same way as a whole chat call, over the targets whose
provider serves embeddings (others are passed over, not counted as failures).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from actors.breaker import DEFAULT_COOLDOWN_SECONDS, Admission, BreakerHandle, Outcome
from gateway.core.errors import (
    CircuitOpen,
    GatewayError,
    ModelNotFound,
    RateLimited,
    UpstreamAuthFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.core.usage import CallRecord
from gateway.edge import telemetry
from gateway.http.state import GatewayState
from gateway.protocols.anthropic_stream import is_message_stop
from gateway.protocols.responses_stream import is_response_end
from gateway.protocols.sse import event_data
from gateway.providers.base import (
    Provider,
    ProviderError,
    UpstreamCredentialRejected,
    UpstreamProtocolError,
    UpstreamReply,
    UpstreamTimeoutError,
    error_detail,
    watched,
)
from gateway.relay.retry import RETRYABLE_STATUSES, is_failure_status, may_resend
from gateway.relay.routing import Route, Target, timeouts_for

__all__ = ["NativeCall", "dispatch", "embed", "timeouts_for"]

log = logging.getLogger("gateway.upstream")

#: A provider answering these refused the gateway's credential, not the client's key.
_CREDENTIAL_REFUSED = frozenset({401, 403})

#: Read on every attempt: looked up once (an enum member read through its class: ~60 ns).
_PASS = Admission.PASS
_SUCCESS = Outcome.SUCCESS

#: Added to a probe's timeouts for its lease, so a slow probe is not taken for a lost one.
_PROBE_LEASE_MARGIN = 5.0


@dataclass(frozen=True, slots=True)
class NativeCall:
    """A request as its client sent it (Anthropic Messages, or OpenAI Responses), for
    deployments that speak its protocol."""

    body: dict[str, Any]
    #: Client headers the native API reads (``anthropic-version``, ``anthropic-beta``).
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Why the request has no chat translation (e.g. a document block): only targets
    #: speaking it natively may take it; with none, this is the answer.
    chat_error: GatewayError | None = None
    #: The protocol of ``body``: "anthropic" or "responses".
    protocol: str = "anthropic"

    def spoken_by(self, provider: Provider) -> bool:
        """Whether ``provider`` takes this request natively."""
        return provider.speaks_responses if self.protocol == "responses" else provider.speaks_messages

    def for_model(self, model: str) -> dict[str, Any]:
        return self.body if self.body.get("model") == model else {**self.body, "model": model}


def dispatch(
    state: GatewayState,
    route: Route,
    body: dict[str, Any],
    record: CallRecord,
    *,
    stream: bool,
    headers: Mapping[str, str] | None = None,
    native: NativeCall | None = None,
) -> Coroutine[Any, Any, tuple[Target, UpstreamReply]]:
    """The first good reply among the route's targets, then its fallbacks' (awaited).

    Returns the provider's reply (possibly its own error answer, relayed as is).
    Raises CircuitOpen (nothing healthy), UpstreamTimeout or UpstreamUnavailable.
    ``record`` gets provider, deployment, retries, failovers and fallback_model, and
    the time spent waiting on providers. ``headers`` default to the call's trace context.
    A plain function handing back :meth:`_Call.run`'s coroutine: one coroutine less per call.
    """
    call = _Call(state, body, record, stream, record.trace_headers if headers is None else headers, native=native)
    return call.run(_chain(state, route))


def embed(
    state: GatewayState,
    route: Route,
    body: dict[str, Any],
    record: CallRecord,
    *,
    headers: Mapping[str, str] | None = None,
) -> Coroutine[Any, Any, tuple[Target, UpstreamReply]]:
    """An embeddings call (awaited), dispatched like a whole chat call (breakers, retries, failover,
    fallbacks) over the targets whose provider serves embeddings.

    Raises as :func:`dispatch` does, and ModelNotFound when no target serves embeddings.
    """
    call = _Call(
        state, body, record, False, record.trace_headers if headers is None else headers, embeddings=True
    )
    return call.run(_chain(state, route))


def _chain(state: GatewayState, route: Route) -> list[tuple[str | None, Route]]:
    """The routes a call goes through: its own, then its group's fallbacks'."""
    chain: list[tuple[str | None, Route]] = [(None, route)]
    fallbacks = route.group.fallbacks
    if fallbacks:
        router = route.router or state.router  # the call's own config generation, even mid-reload
        for name in fallbacks:
            try:
                chain.append((name, router.resolve(name)))
            except GatewayError:
                continue  # config validation keeps this from happening
    return chain


class _Call:
    """One dispatch: what was tried, what failed last, how long the skipped ones wait."""

    # What a call records of its attempts starts at these class defaults: an instance
    # stores only what changes (most calls: one attempt, nothing failed), 21 instructions
    # a call less than setting each (no __slots__, which would forbid the defaults).
    #: Targets that could take this call (open circuits included).
    capable = 0
    attempted = 0
    last_error: ProviderError | None = None
    last_reply: UpstreamReply | None = None
    last_target: Target | None = None
    wait: float | None = None
    #: A target was skipped for its rpm/tpm (all skipped: 429, not 503).
    limited = False

    def __init__(
        self, state: GatewayState, body: dict[str, Any], record: CallRecord, stream: bool,
        headers: Mapping[str, str], *, embeddings: bool = False, native: NativeCall | None = None,
    ) -> None:
        self.state = state
        #: The client's own request, for targets speaking its protocol natively.
        self.native = native
        #: An embeddings call: only targets whose provider serves embeddings are tried.
        self.embeddings = embeddings
        self.breaker = state.breaker
        self.body = body
        self.record = record
        self.stream = stream
        self.headers = headers

    async def run(self, chain: list[tuple[str | None, Route]]) -> tuple[Target, UpstreamReply]:
        """The first good reply along ``chain``, the time waited on providers recorded
        (here, not in a coroutine of its own around this one: one await less per call)."""
        record = self.record
        record.upstream_started_at = started = time.monotonic()
        try:
            seen: set[tuple[str, str]] = set()
            for link, (fallback_model, route) in enumerate(chain):
                router = route.router or self.state.router
                limits = self.state.deployment_limits
                headroom = (
                    limits.snapshot([t.deployment for t in route.targets])
                    if limits is not None and route.group.strategy == "least-busy" else None
                )
                ordered = router.order(route, self.breaker.view, stream=self.stream, headroom=headroom)
                if self.embeddings:
                    # e.g. an Anthropic deployment in the group: passed over, not a failure.
                    providers = _providers_of(self.state, route)
                    ordered = [t for t in ordered if providers[t.provider].serves_embeddings]
                elif self.native is not None and self.native.chat_error is not None:
                    providers = self.state.providers
                    ordered = [t for t in ordered if self.native.spoken_by(providers[t.provider])]
                for index, target in enumerate(ordered):
                    key = (target.deployment_id, target.upstream_model)
                    if key in seen:
                        continue  # a fallback sharing a deployment: it already failed
                    seen.add(key)
                    self.capable += 1
                    more = index + 1 < len(ordered) or link + 1 < len(chain)
                    reply = await self._try(target, route, fallback_model, more=more)
                    if reply is not None:
                        return target, reply
            return self._give_up()
        finally:
            record.upstream_time = time.monotonic() - started

    def _skip(self, wait: float) -> None:
        self.wait = wait if self.wait is None else min(self.wait, wait)

    def _give_up(self) -> tuple[Target, UpstreamReply]:
        record = self.record
        if self.embeddings and self.capable == 0:
            raise ModelNotFound(f"no deployment of model {record.requested_model!r} serves embeddings")
        if self.native is not None and self.native.chat_error is not None and self.capable == 0:
            raise self.native.chat_error
        if self.attempted == 0 and self.limited:
            # Every deployment is at its own quota: the client's retry after this succeeds.
            raise RateLimited(
                f"every deployment of model {record.requested_model!r} is at its rate limit",
                retry_after=max(1.0, self.wait or 1.0),
            )
        if self.attempted == 0:
            raise CircuitOpen(
                f"no healthy deployment for model {record.requested_model!r}", retry_after=self.wait or 1.0
            )
        if self.last_reply is not None and self.last_target is not None:
            return self.last_target, self.last_reply  # the provider's own error, relayed
        if isinstance(self.last_error, UpstreamTimeoutError):
            raise UpstreamTimeout(f"upstream timed out ({record.retries} retries, {record.failovers} failovers)")
        if isinstance(self.last_error, UpstreamCredentialRejected):
            raise UpstreamAuthFailed(
                f"the gateway could not authenticate with the provider (request id {record.request_id})"
            )
        raise UpstreamUnavailable(f"upstream unavailable (request id {record.request_id})")

    async def _try(
        self, target: Target, route: Route, fallback_model: str | None, *, more: bool
    ) -> UpstreamReply | None:
        """Attempts on one target; the reply to return, or None to move on."""
        state, breaker, record = self.state, self.breaker, self.record
        deployment = target.deployment_id
        # Resolved when the route's router was built (once per config generation).
        provider, timeouts = target.client, target.timeouts
        if provider is None or timeouts is None:  # a router built without providers
            provider = _providers_of(state, route)[target.provider].for_deployment(target.deployment)
            timeouts = timeouts_for(route.group, provider)
        body = self.body
        if body.get("model") != target.upstream_model:
            body = {**body, "model": target.upstream_model}
        probes = state.probes
        if probes is not None and not probes.healthy(target.provider):
            self._skip(probes.retry_after(target.provider))  # its health probes fail: not a user's call
            return None
        attempt = 0
        while True:
            token = 0
            # A retry has waited out its own 429's cool-down: only the circuit matters then.
            admission, wait = breaker.admission(deployment, ignore_cooling=attempt > 0)
            if admission is not _PASS:
                if admission is Admission.WAIT:
                    self._skip(wait)
                    return None
                # Admission.PROBE:
                lease = timeouts.connect + (timeouts.idle if self.stream else timeouts.total)
                permission, token = await breaker.permit(deployment, lease + _PROBE_LEASE_MARGIN)
                if not permission.granted:
                    self._skip(permission.retry_after)
                    return None
            limits = state.deployment_limits
            if limits is not None:
                # Nothing of its own to count (no rpm/tpm): take()'s answer, without its coroutine.
                room = (
                    limits.reported_wait(deployment)
                    if target.deployment.rpm is None and target.deployment.tpm is None
                    else await limits.take(target.deployment)
                )
                if room is not None:  # at its rpm/tpm, or its provider said none is left: next one
                    if token:
                        breaker.report(deployment, Outcome.NEUTRAL, token=token)  # give the probe back
                    self.limited = True
                    self._skip(room)
                    return None
            if attempt == 0:
                if self.attempted:
                    record.failovers += 1
                    telemetry.failed_over(state, *_left_behind(self.last_target, self.last_error, self.last_reply))
                self.attempted += 1
                record.provider, record.deployment = target.provider, deployment
                record.price = target.deployment.price
                record.fallback_model = fallback_model
            started = time.monotonic()
            try:
                if self.embeddings:
                    reply = await provider.embeddings(body, headers=self.headers, timeouts=timeouts)
                elif self.native is not None and self.native.spoken_by(provider):
                    send = provider.responses if self.native.protocol == "responses" else provider.messages
                    reply = await send(
                        self.native.for_model(target.upstream_model), stream=self.stream,
                        headers={**self.headers, **self.native.headers}, timeouts=timeouts,
                    )
                else:
                    reply = await provider.chat(body, stream=self.stream, headers=self.headers, timeouts=timeouts)
                first = await _first_event(reply) if self.stream and reply.ok and reply.events is not None else None
            except ProviderError as exc:
                resend = may_resend(exc, provider.config)
                retry = resend and attempt < state.retry_policy.retries_for(provider.config)
                breaker.report(deployment, Outcome.FAILURE, token=token, will_retry=retry and not token)
                self.last_error, self.last_reply, self.last_target = exc, None, target
                detail = error_detail(exc)
                log.warning("request %s: %s on %s failed: %s", record.request_id, type(exc).__name__, deployment, detail)
                telemetry.upstream_failed(deployment, type(exc).__name__, detail)
                if not resend:
                    # It may have run upstream: sending it anywhere again could bill twice.
                    if isinstance(exc, UpstreamTimeoutError):
                        raise UpstreamTimeout("upstream timed out (not retried: retry_on_timeout is off)") from None
                    raise UpstreamUnavailable(
                        f"upstream failed after the request was sent (request id {record.request_id})"
                    ) from None
                if not retry:
                    return None
                delay = state.retry_policy.delay(attempt, None)
                reason = type(exc).__name__
            except BaseException:  # cancelled (client gone): says nothing of the deployment
                breaker.report(deployment, Outcome.NEUTRAL, token=token)
                raise
            else:
                elapsed = time.monotonic() - started
                status = reply.status
                if limits is not None:
                    limits.observe(deployment, reply.headers)
                if status in _CREDENTIAL_REFUSED:
                    await self._credential_refused(target, reply, token)
                    return None  # another deployment's credential may work; retrying here won't
                if status not in RETRYABLE_STATUSES and not is_failure_status(status):
                    if first is not None:
                        breaker.report(deployment, _SUCCESS, token=token, ttft=elapsed)
                        _watch(reply, first, deployment, breaker)
                    else:
                        breaker.report(deployment, _SUCCESS, token=token, latency=elapsed)
                    return reply
                retry_after = reply.retry_after
                if status == 429 and retry_after is None:
                    retry_after = DEFAULT_COOLDOWN_SECONDS
                retry = (
                    status in RETRYABLE_STATUSES
                    and not (status == 429 and more)  # cooled: another deployment beats waiting
                    and attempt < state.retry_policy.retries_for(provider.config)
                    and (retry_after is None or retry_after <= state.retry_policy.max_retry_after)
                )
                if status == 429:
                    breaker.report(deployment, Outcome.RATE_LIMITED, token=token, retry_after=retry_after)
                else:
                    # A call counts once toward the breaker: a failed attempt sent again
                    # here waits for the call's last one (a probe decides at once).
                    breaker.report(deployment, Outcome.FAILURE, token=token, will_retry=retry and not token)
                await reply.release()
                self.last_error, self.last_reply, self.last_target = None, reply, target
                if not retry:
                    return None
                delay = state.retry_policy.delay(attempt, retry_after)
                reason = str(status)
            attempt += 1
            record.retries += 1
            telemetry.retried(state, target.provider, attempt, reason)
            await asyncio.sleep(delay)


    async def _credential_refused(self, target: Target, reply: UpstreamReply, token: int) -> None:
        """The provider refused our credential: loud for the operator, a failure to move on from."""
        deployment = target.deployment_id
        await reply.release()
        # Neutral, not a failure: the operator's fix (a rotated key file) takes effect
        # within a second, and an open circuit would keep the deployment out long after.
        self.breaker.report(deployment, Outcome.NEUTRAL, token=token)
        log.error(
            "provider %s refused the gateway's credential (HTTP %d) for request %s: check the credentials of providers.%s",
            target.provider, reply.status, self.record.request_id, target.provider,
        )
        telemetry.upstream_auth_failed(self.state, target.provider, deployment, reply.status)
        self.last_error = UpstreamCredentialRejected(f"provider answered {reply.status}")
        self.last_reply, self.last_target = None, target


def _providers_of(state: GatewayState, route: Route) -> Mapping[str, Provider]:
    """The providers of the config generation that resolved ``route`` (see gateway/edge/reload.py)."""
    if route.router is not None and route.router.providers:
        return route.router.providers
    return state.providers


def _left_behind(
    target: Target | None, error: ProviderError | None, reply: UpstreamReply | None
) -> tuple[str, str]:
    """The deployment a call is leaving and why (error name or status), for the span."""
    why = type(error).__name__ if error is not None else str(reply.status) if reply is not None else "skipped"
    return (target.deployment_id if target is not None else "none"), why


async def _first_event(reply: UpstreamReply) -> bytes:
    """Read a stream's first event before anything is relayed (so failover stays possible)."""
    assert reply.events is not None
    try:
        first = await anext(reply.events)
    except StopAsyncIteration:
        await reply.release()
        raise UpstreamProtocolError("upstream ended the stream before its first event") from None
    except BaseException:
        await reply.release()
        raise
    data = event_data(first)
    if data is not None and data != b"[DONE]":
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError:
            # Still nothing relayed: fail here, so the call may be retried or fail over.
            await reply.release()
            raise UpstreamProtocolError("upstream's first stream event is not JSON") from None
    return first


def _is_done(event: bytes) -> bool:
    """The chat stream's end marker."""
    return event_data(event) == b"[DONE]"


def _watch(reply: UpstreamReply, first: bytes, deployment: str, breaker: BreakerHandle) -> None:
    """Relay ``first`` then the rest; a stream cut or broken mid-way is a failure.

    A relay that stops reading (client gone) leaves the stream unfinished: neutral. The
    events are told (:meth:`~gateway.providers.base.ReplyEvents.watch`) rather than
    wrapped: no generator between the provider's reader and the relay.
    """
    assert reply.events is not None
    # The wire's end, and bytes its end event always holds: an event without them is not
    # the end. Asked of every event, one rfind (0.06 µs on an S3 chunk) rules them out
    # without a call (event_data costs 0.18 µs, `in` 0.13-0.16 µs). Every event of a
    # Responses stream holds "response.": nothing to rule out there (b"" is always found).
    ends, marker = (
        (_is_done, b"[DONE]") if reply.wire == "chat"
        else (is_response_end, b"") if reply.wire == "responses"
        else (is_message_stop, b"message_stop")
    )
    events = watched(reply.events)
    events.watch(first, ends, marker, functools.partial(breaker.report, deployment, Outcome.FAILURE))
    reply.events = events
