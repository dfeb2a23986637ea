"""Every Prometheus metric of the gateway, defined once, in one per-gateway registry.

:class:`GatewayMetrics` owns a private :class:`~prometheus_client.CollectorRegistry`, so
two gateways in one process (the tests run several) never share a series. It is filled
three ways:

* per finished chat call, from the :class:`~gateway.core.usage.CallRecord` handed to
  :meth:`GatewayMetrics.observe_call` (a ``GatewayState.call_listeners`` entry);
* per HTTP request, by the edge middleware (:meth:`GatewayMetrics.request_done`);
* at scrape time, by reading the actors' own state on the event loop (mailbox depths,
  restarts, circuit states, the billing backlog): nothing is counted per request for
  these, so they cost the hot path nothing.

Hooks for the other actors (call them; each is a counter increment or a registration):

* limiter: :meth:`GatewayMetrics.rate_limited` ``(scope)`` for each rejected request,
  :meth:`GatewayMetrics.watch_limiter` ``(degraded)`` with a ``() -> bool`` reader;
* breakers: :meth:`GatewayMetrics.watch_circuits` with a ``() -> {deployment: state}``
  reader (state ``closed``/``half-open``/``open`` or 0/1/2);
* billing: :meth:`GatewayMetrics.watch_billing` with a ``() -> int`` reader of pending
  events, :meth:`GatewayMetrics.unpriced` ``(model)`` for a call no price was known for;
* response cache: :meth:`GatewayMetrics.watch_cache` with a reader of its stats
  (counters and sizes), :meth:`GatewayMetrics.cache_similarity` as its similarity
  listener. A call answered from the cache is no upstream call: it counts in the cache's
  metrics and ``gateway_cache_hit_tokens_total``, never in the ``gateway_upstream_*``
  series or ``gateway_tokens_total``.
  Set ``CallRecord.cost_usd`` (if you add it) before this module's listener runs, and the
  cost metric uses it; otherwise the provider-reported cost is counted.

Labels are bounded: routes are the router's templates, statuses are HTTP codes, model
names pass through :class:`BoundedLabel` (the first ``MAX_MODEL_LABELS`` distinct names,
then ``other``) because a wildcard route lets clients choose them, and no label ever
holds a key, a key id, a prompt or other free text.

A scrape renders the exposition in a worker thread (:meth:`GatewayMetrics.render`):
rendering a few thousand lines takes tens of milliseconds that requests must not wait
for. Actor state is read on the loop first, so the thread never touches it.

Every update (the hooks above, the listener, the middleware's) runs on the event loop
thread: the series updated per request hold lock-free values (:class:`_LoopValue`) that
rely on that single writer; the scrape's thread only reads them.

Why one module of ~550 lines: every metric is defined once, here, so a name, its labels and
its help text have one home; splitting by area would scatter the one registry.
"""

from __future__ import annotations

import asyncio
import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.process_collector import ProcessCollector

from gateway import __version__
from gateway.core.usage import CallRecord

__all__ = [
    "AUTH_FAILURE_REASONS",
    "CIRCUIT_STATES",
    "CONTENT_TYPE",
    "MAX_MODEL_LABELS",
    "OPERATION_BUCKETS",
    "OVERHEAD_BUCKETS",
    "REQUEST_BUCKETS",
    "SIMILARITY_BUCKETS",
    "TOKEN_BUCKETS",
    "TTFT_BUCKETS",
    "BoundedLabel",
    "GatewayMetrics",
    "InFlight",
]

#: What ``/metrics`` answers with: the classic text format every Prometheus reads.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Buckets. The GenAI ones are the OpenTelemetry GenAI conventions' advice, so dashboards
# built for those conventions read ours.
#: Time to first token: 1 ms .. 10 s (gen_ai.server.time_to_first_token).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
#: A whole upstream operation, 10 ms .. 82 s in doublings (gen_ai.client.operation.duration).
OPERATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
#: Time per output token of a stream (gen_ai.server.time_per_output_token).
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
#: Tokens per call in powers of 4, 1 .. 4^13 (gen_ai.client.token.usage).
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))
#: Any HTTP request: health checks take a millisecond, long generations minutes. The
#: 10.24 s bound sits next to the 10 s p99 alert threshold.
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, *OPERATION_BUCKETS, 163.84, 327.68)
#: What the gateway itself adds to a call: 0.1 ms .. 1 s.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Cosine similarity of semantic cache searches: fine steps where thresholds are set (0.9+).
SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995, 1.0)

#: Distinct model names kept as label values before the rest count as ``other``.
MAX_MODEL_LABELS = 100
#: Distinct values kept for labels whose values come from other modules' code.
MAX_SMALL_LABELS = 32
OVERFLOW_LABEL = "other"

#: ``reason`` values of ``gateway_auth_failures_total`` (see actors/auth.py).
AUTH_FAILURE_REASONS = ("missing", "malformed", "unknown", "revoked", "expired", "unavailable")
#: ``gateway_circuit_state`` values (contract §9).
CIRCUIT_STATES: Mapping[str, int] = {"closed": 0, "half-open": 1, "half_open": 1, "open": 2}
CALL_OUTCOMES = ("ok", "provider_error", "upstream_error", "cancelled", "cut", "blocked")
#: ``result`` values of ``gateway_cache_requests_total``, and the cache counter each reads.
CACHE_RESULTS: Mapping[str, str] = {"hit": "hits", "miss": "misses", "bypass": "bypasses"}


class BoundedLabel:
    """Maps free values to at most ``limit`` label values; later newcomers get ``other``.

    First come, first kept: stable for the life of the process, so a series never
    changes its name, and a client cycling through model names cannot grow the
    exposition beyond the bound.
    """

    __slots__ = ("_known", "_limit")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._known: dict[str, str] = {}

    def __call__(self, value: str | None) -> str:
        if value is None:
            return "none"
        label = self._known.get(value)
        if label is None:
            label = value if len(self._known) < self._limit else OVERFLOW_LABEL
            if label is value:
                self._known[value] = label
        return label


_C = TypeVar("_C")


class _LoopValue:
    """One sample's value that only the event loop writes: a float without a lock.

    It stands in for prometheus_client's ``MutexValue`` inside the children the hot path
    updates (same ``inc``/``set``/``get`` interface, so the library's ``collect`` reads it
    as before). Every update of those children runs on the loop thread, so the lock
    guarded nothing, and it was most of the cost: a counter ``inc`` through the library
    takes ~0.24 µs, a histogram ``observe`` ~0.57 µs (a lock per sum and bucket, checks,
    a linear bucket search); here ~0.04 µs and ~0.1 µs. The scrape's worker thread only
    reads, one float at a time, as it did through the lock. The per-request paths add to
    ``value`` directly, as :class:`_LoopHistogram` does: the same float arithmetic as
    ``inc``, without the call, which was half an update's instructions (7 of 14).
    """

    __slots__ = ("_exemplar", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def get(self) -> float:
        return self.value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self._exemplar


def _loop_value(child: Any) -> _LoopValue:
    """A counter or gauge child's value, made loop-owned (once: a child met again keeps it)."""
    value = child._value
    if not isinstance(value, _LoopValue):
        value = child._value = _LoopValue()
    return value


class _LoopHistogram:
    """A histogram child observed on the loop: its sum and buckets are :class:`_LoopValue`.

    ``observe`` finds the bucket by bisection and adds directly, as the library's would
    (the first bound >= the amount; NaN lands in the sum and no bucket).
    """

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Any) -> None:
        self._bounds: list[float] = child._upper_bounds
        if not isinstance(child._sum, _LoopValue):
            child._sum = _LoopValue()
            child._buckets = [_LoopValue() for _ in self._bounds]
        self._sum: _LoopValue = child._sum
        self._buckets: list[_LoopValue] = child._buckets

    def observe(self, amount: float) -> None:
        self._sum.value += amount
        # The last bound is +Inf: every number but NaN has a bound >= it, and NaN none
        # (a test of NaN, not of the bound found: 35 -> 29 instructions an observe).
        if amount == amount:
            self._buckets[bisect_left(self._bounds, amount)].value += 1


#: A route's in-flight gauge value (:meth:`GatewayMetrics.in_flight`): ``inc``, ``dec``.
InFlight = _LoopValue


class _Children(dict[Any, _C]):
    """Label children cached by their label values: ``children[route, status]``, or
    ``children[route]`` for one label; values that are not strings (a status code) are
    turned into text by ``.labels()``, as always.

    ``.labels()`` costs ~4.5 µs (lock, validation); a hit here is a plain dict subscript
    (~0.03 µs), and ``__missing__`` binds the child on the first use of its values. The
    cache is as bounded as the labels themselves. ``bind`` turns a new child into what the
    cache holds: its :class:`_LoopValue` (counters, gauges) or a :class:`_LoopHistogram`.
    """

    __slots__ = ("_bind", "_metric")

    def __init__(self, metric: Any, bind: Callable[[Any], _C]) -> None:
        super().__init__()
        self._metric = metric
        self._bind = bind

    def __missing__(self, values: Any) -> _C:
        child = self._metric.labels(*values) if isinstance(values, tuple) else self._metric.labels(values)
        self[values] = bound = self._bind(child)
        return bound


#: Names of calls (requested model, provider, served model, outcome) whose series
#: :meth:`GatewayMetrics.observe_call` remembers.
MAX_CALL_SERIES = 4096


class _CallSeries:
    """The labels of one kind of finished call and the values it updates, bound as first
    used (a series appears in the exposition only once a call has counted in it)."""

    __slots__ = ("cost", "duration", "provider", "requested", "served", "tokens", "upstream")

    def __init__(self, requested: str, provider: str, served: str, upstream: _LoopValue) -> None:
        self.requested, self.provider, self.served = requested, provider, served
        self.upstream = upstream
        self.duration: _LoopHistogram | None = None
        self.tokens: tuple[_LoopValue, _LoopValue] | None = None
        self.cost: _LoopValue | None = None


class _ActorView(Protocol):
    """What the scrape reads of an actor handle (``actors.runtime.ActorRef``)."""

    name: str

    @property
    def mailbox_depth(self) -> int: ...

    @property
    def restarts(self) -> int: ...

    @property
    def alive(self) -> bool: ...


@dataclass
class _Readers:
    """Functions the scrape calls on the loop to read other components' live state."""

    actors: Callable[[], Iterable[_ActorView]] | None = None
    key_invalidation: Callable[[], bool] | None = None
    circuits: Callable[[], Mapping[str, str | int]] | None = None
    billing_pending: Callable[[], int] | None = None
    limiter_degraded: Callable[[], bool] | None = None
    cache: Callable[[], Mapping[str, Any]] | None = None
    extra: list[Callable[[], Iterable[Metric]]] = field(default_factory=list)


class _Scrape:
    """One scrape's collectors: the registry plus the families read on the loop."""

    __slots__ = ("_families", "_registry")

    def __init__(self, registry: CollectorRegistry, families: list[Metric]) -> None:
        self._registry = registry
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
        yield from self._families


class GatewayMetrics:
    """The gateway's metrics and the registry they live in (one per gateway)."""

    def __init__(self, *, process_metrics: bool = True) -> None:
        # No ``*_created`` series: Prometheus stores each as one more series, doubling
        # the counters' share of every scrape for a value nobody queries. The switch is
        # process-wide in prometheus_client; the gateway is the process's only user.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        if process_metrics:
            ProcessCollector(registry=r)
            GCCollector(registry=r)
        self.model_label = BoundedLabel(MAX_MODEL_LABELS)
        self._small = BoundedLabel(MAX_SMALL_LABELS)
        self._readers = _Readers()

        # -- build ------------------------------------------------------------------------
        # Prometheus' info-metric idiom: a constant 1 whose labels say which build runs, so
        # a query or dashboard can join any series on it (e.g. during a rolling upgrade).
        Gauge(
            "gateway_build_info", "Always 1; the labels are the running gateway's version and Python.",
            ["version", "python"], registry=r,
        ).labels(__version__, platform.python_version()).set(1)

        # -- HTTP edge (both planes) -----------------------------------------------------
        self.requests = Counter(
            "gateway_requests_total", "HTTP requests answered, by route template and status code.",
            ["route", "status"], registry=r,
        )
        self.request_duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from a request's arrival to its answer's end (streams: the last byte).",
            ["route"], buckets=REQUEST_BUCKETS, registry=r,
        )
        self.requests_in_flight = Gauge(
            "gateway_requests_in_flight", "Requests being handled right now, by route.", ["route"], registry=r,
        )
        self.auth_failures = Counter(
            "gateway_auth_failures_total", "Requests refused with 401, by why the key was refused.",
            ["reason"], registry=r,
        )
        self.rate_limited_requests = Counter(
            "gateway_rate_limited_total", "Requests refused with 429, by the limit's scope.", ["scope"], registry=r,
        )
        # -- chat calls -----------------------------------------------------------------
        self.upstream_requests = Counter(
            "gateway_upstream_requests_total", "Chat calls by the provider and model that served them, and outcome.",
            ["provider", "model", "outcome"], registry=r,
        )
        self.upstream_duration = Histogram(
            "gateway_upstream_duration_seconds",
            "Time spent waiting on the provider per call (streams: until the stream ended).",
            ["provider", "model"], buckets=OPERATION_BUCKETS, registry=r,
        )
        self.time_to_first_token = Histogram(
            "gateway_time_to_first_token_seconds",
            "Streams: time from the call's start to the provider's first chunk.",
            ["provider", "model"], buckets=TTFT_BUCKETS, registry=r,
        )
        self.time_per_output_token = Histogram(
            "gateway_time_per_output_token_seconds",
            "Streams: time per output token after the first chunk.",
            ["provider", "model"], buckets=TPOT_BUCKETS, registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens_total", "Tokens used, by requested model and type (input|output).",
            ["model", "type"], registry=r,
        )
        # By type only: per model it would be 34 more lines per model name for a
        # distribution the per-model counters above mostly answer.
        self.token_usage = Histogram(
            "gateway_token_usage", "Tokens per call, by type (input|output).",
            ["type"], buckets=TOKEN_BUCKETS, registry=r,
        )
        self.cost = Counter(
            "gateway_cost_usd_total", "Spend in USD, by requested model.", ["model"], registry=r,
        )
        self.unpriced_calls = Counter(
            "gateway_unpriced_calls_total", "Calls recorded at zero cost because no price was known.",
            ["model"], registry=r,
        )
        self.guardrail_decisions = Counter(
            "gateway_guardrail_decisions_total",
            "What guardrail policies did (blocked, redacted, logged, failed_open), by policy and direction.",
            ["policy", "action", "direction"], registry=r,
        )
        self.upstream_retries = Counter(
            "gateway_upstream_retries_total", "Upstream attempts repeated, by provider and reason (status or error).",
            ["provider", "reason"], registry=r,
        )
        self.upstream_auth_failures = Counter(
            "gateway_upstream_auth_failures_total",
            "Provider answers of 401/403: the gateway's own credential for that provider was refused.",
            ["provider"], registry=r,
        )
        self.failovers = Counter(
            "gateway_upstream_failovers_total",
            "Times a call moved on to another deployment or fallback group, by requested model.",
            ["model"], registry=r,
        )
        # -- response cache (hits, misses and sizes are read from the cache at scrape time) ---
        self.cache_hit_tokens = Counter(
            "gateway_cache_hit_tokens_total",
            "Tokens of answers served from the response cache (no provider was called), by type.",
            ["type"], registry=r,
        )
        self.cache_similarity_seen = Histogram(
            "gateway_cache_similarity",
            "Best cosine similarity of each semantic cache search that had a candidate, "
            "by whether it matched (hit) or fell below the threshold (miss).",
            ["result"], buckets=SIMILARITY_BUCKETS, registry=r,
        )
        self.overhead = Histogram(
            "gateway_overhead_seconds",
            "Time a chat call spent in the gateway rather than waiting on providers "
            "(streams: before the upstream request was sent).",
            ["stream"], buckets=OVERHEAD_BUCKETS, registry=r,
        )
        self.config_reloads = Counter(
            "gateway_config_reloads_total", "Config reload attempts (SIGHUP or the admin API), by result.",
            ["result"], registry=r,
        )
        self.config_reload_failures = Counter(
            "gateway_config_reload_failures_total",
            "Config reloads refused (the file did not validate; nothing changed).", registry=r,
        )
        self.config_last_reload_success = Gauge(
            "gateway_config_last_reload_success",
            "1 if the last config reload (or the start-up load) was applied, 0 if it was refused.", registry=r,
        )
        self.config_last_reload_success.set(1)
        self.config_loaded_at = Gauge(
            "gateway_config_loaded_timestamp_seconds", "Unix time the active config was loaded.", registry=r,
        )
        # The children the hot path updates (every request, call, refusal or cache search,
        # all on the event loop) hold loop-owned values, reached through caches: a bound
        # update costs ~0.04 µs (counter, gauge) or ~0.1 µs (histogram), against ~0.24 and
        # ~0.57 µs through the library and ~4.5 µs through .labels(). Label sets known in
        # advance are bound here.
        self._overhead = {
            True: _LoopHistogram(self.overhead.labels("true")), False: _LoopHistogram(self.overhead.labels("false")),
        }
        self._auth_failures = {
            reason: _loop_value(self.auth_failures.labels(reason)) for reason in AUTH_FAILURE_REASONS
        }
        self._requests = _Children(self.requests, _loop_value)
        self._durations = _Children(self.request_duration, _LoopHistogram)
        self._in_flight = _Children(self.requests_in_flight, _loop_value)
        self._upstream = _Children(self.upstream_requests, _loop_value)
        self._upstream_duration = _Children(self.upstream_duration, _LoopHistogram)
        self._ttft = _Children(self.time_to_first_token, _LoopHistogram)
        self._tpot = _Children(self.time_per_output_token, _LoopHistogram)
        self._tokens = _Children(self.tokens, _loop_value)
        self._token_usage = {t: _LoopHistogram(self.token_usage.labels(t)) for t in ("input", "output")}
        self._token_input, self._token_output = self._token_usage["input"], self._token_usage["output"]
        #: A finished call's series by its names (:meth:`observe_call`).
        self._calls: dict[tuple[Any, ...], _CallSeries] = {}
        self._cache_hit_tokens = {t: _loop_value(self.cache_hit_tokens.labels(t)) for t in ("input", "output")}
        self._similarity = {
            True: _LoopHistogram(self.cache_similarity_seen.labels("hit")),
            False: _LoopHistogram(self.cache_similarity_seen.labels("miss")),
        }
        self._cost = _Children(self.cost, _loop_value)
        self._retries = _Children(self.upstream_retries, _loop_value)
        self._rate_limited = _Children(self.rate_limited_requests, _loop_value)
        self._failovers = _Children(self.failovers, _loop_value)
        self._rendering: asyncio.Future[bytes] | None = None

    # -- per request (edge middleware) ---------------------------------------------------
    def in_flight(self, route: str) -> InFlight:
        """The in-flight gauge value of ``route`` (inc on arrival, dec on answer)."""
        return self._in_flight[route]

    def request_done(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        self._requests[route, status].value += 1
        self._durations[route].observe(seconds)

    def auth_failed(self, reason: str) -> None:
        """Count one 401; unknown reasons count as ``unknown``."""
        child = self._auth_failures.get(reason) or self._auth_failures["unknown"]
        child.inc()

    def watch_health_checks(self, healthy: Callable[[], Mapping[str, bool]]) -> None:
        """Read ``{provider: healthy}`` of the actively probed providers at each scrape
        for ``gateway_provider_healthy`` (1 healthy, 0 unhealthy)."""

        def families() -> list[Metric]:
            family = GaugeMetricFamily(
                "gateway_provider_healthy",
                "Active health check of a provider (1 healthy, 0 its probes fail); only providers with health_check.",
                labels=["provider"],
            )
            for provider, ok in healthy().items():
                family.add_metric([provider], 1.0 if ok else 0.0)
            return [family]

        self.watch(families)

    def config_reloaded(self, ok: bool, loaded_at: float) -> None:
        """Count one reload attempt; ``loaded_at`` is the active config's load time."""
        self.config_reloads.labels("applied" if ok else "refused").inc()
        if not ok:
            self.config_reload_failures.inc()
        self.config_last_reload_success.set(1 if ok else 0)
        self.config_loaded_at.set(loaded_at)

    # -- hooks for other actors ----------------------------------------------------------
    def rate_limited(self, scope: str) -> None:
        """Count one request refused by a limit (``scope``: ip, key, tokens, concurrency...)."""
        self._rate_limited[self._small(scope)].inc()

    def unpriced(self, model: str) -> None:
        """Count one call recorded at zero cost because its model has no price."""
        self.unpriced_calls.labels(self.model_label(model)).inc()

    def retried(self, provider: str, reason: str) -> None:
        """Count one repeated upstream attempt."""
        self._retries[provider, self._small(reason)].inc()

    def upstream_auth_failed(self, provider: str) -> None:
        """Count one provider answer refusing the gateway's credential."""
        self.upstream_auth_failures.labels(provider).inc()

    def watch_actors(self, refs: Callable[[], Iterable[_ActorView]]) -> None:
        """Read mailbox depth, restarts and liveness of these actor handles at each scrape."""
        self._readers.actors = refs

    def watch_key_invalidation(self, listening: Callable[[], bool]) -> None:
        """Read whether key changes are being listened for at each scrape."""
        self._readers.key_invalidation = listening

    def watch_circuits(self, states: Callable[[], Mapping[str, str | int]]) -> None:
        """Read ``{deployment: state}`` at each scrape for ``gateway_circuit_state``."""
        self._readers.circuits = states

    def watch_billing(self, pending: Callable[[], int]) -> None:
        """Read the number of usage events not yet in the ledger at each scrape."""
        self._readers.billing_pending = pending

    def watch_limiter(self, degraded: Callable[[], bool]) -> None:
        """Read whether the limiter runs on its local fallback store at each scrape."""
        self._readers.limiter_degraded = degraded

    def watch_cache(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Read the response cache's stats at each scrape: ``counters`` (``hits``,
        ``misses``, ``bypasses``, ``semantic_hits``, ``evictions``...), ``entries``, ``bytes``."""
        self._readers.cache = stats

    def cache_similarity(self, similarity: float, hit: bool) -> None:
        """A semantic cache search's best similarity (the cache's similarity listener)."""
        self._similarity[hit].observe(similarity)

    def watch_background_failures(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Read ``{task: failures}`` of the actors' background work at each scrape, for
        ``gateway_background_failures_total`` (key_listen, spend_refresh, lease_renew,
        lease_lost): each one means shared state (revocations, budgets, concurrency) may
        be stale, so alert on any increase."""

        def families() -> list[Metric]:
            family = CounterMetricFamily(
                "gateway_background_failures",
                "Failures of background work that keeps shared state fresh, by task.",
                labels=["task"],
            )
            for task, value in counts().items():
                family.add_metric([task], value)
            return [family]

        self.watch(families)

    def watch(self, families: Callable[[], Iterable[Metric]]) -> None:
        """Add a reader of more metric families, called on the loop at each scrape."""
        self._readers.extra.append(families)

    # -- per chat call (a call listener) -------------------------------------------------
    def observe_call(self, record: CallRecord) -> None:
        """Fold one finished chat call into the metrics (register as a call listener).

        Runs right after the call ends, so ``now`` is the call's end for the timings.
        """
        for policy, action, direction in record.guardrails:
            self.guardrail_decisions.labels(policy, action, direction).inc()
        if record.cache == "hit":
            self._observe_hit(record)
            return
        now = time.monotonic()
        names = (record.requested_model, record.provider, record.served_model, record.outcome)
        series = self._calls.get(names)
        if series is None:
            series = self._call_series(record, names)
        series.upstream.value += 1
        if record.upstream_started_at is not None:
            waited = now - record.upstream_started_at if record.stream else record.upstream_time
            duration = series.duration
            if duration is None:
                duration = series.duration = self._upstream_duration[series.provider, series.served]
            duration.observe(waited)
            if record.received_at is not None:
                if record.stream:
                    overhead = record.upstream_started_at - record.received_at
                else:
                    overhead = (now - record.received_at) - record.upstream_time
                self._overhead[record.stream].observe(max(0.0, overhead))
        if record.ttft is not None:
            self._ttft[series.provider, series.served].observe(record.ttft)
            output = record.usage.completion_tokens
            if output > 1 and record.latency > record.ttft:
                self._tpot[series.provider, series.served].observe((record.latency - record.ttft) / (output - 1))
        usage = record.usage
        if usage.prompt_tokens or usage.completion_tokens:
            tokens = series.tokens
            if tokens is None:
                tokens = series.tokens = (
                    self._tokens[series.requested, "input"], self._tokens[series.requested, "output"])
            tokens[0].value += usage.prompt_tokens
            tokens[1].value += usage.completion_tokens
            self._token_input.observe(usage.prompt_tokens)
            self._token_output.observe(usage.completion_tokens)
        cost = cost_of(record)
        if cost:
            spend = series.cost
            if spend is None:
                spend = series.cost = self._cost[series.requested]
            spend.value += cost
        elif record.cost_source == "unpriced":  # settled by gateway.billing.pricing before listeners
            self.unpriced(record.requested_model)
        if record.failovers:
            self._failovers[series.requested].inc(record.failovers)

    def _call_series(self, record: CallRecord, names: tuple[Any, ...]) -> _CallSeries:
        """The labels of a call's series (and, as they are first used, their values), by
        its requested model, provider, served model and outcome; remembered for
        :data:`MAX_CALL_SERIES` such names (clients choose model names: beyond, each call
        works them out again, as every call used to)."""
        outcome = record.outcome if record.outcome in CALL_OUTCOMES else OVERFLOW_LABEL
        requested = self.model_label(record.requested_model)
        provider = record.provider or "none"
        served = self.model_label(record.served_model or record.requested_model)
        series = _CallSeries(requested, provider, served, self._upstream[provider, served, outcome])
        if len(self._calls) < MAX_CALL_SERIES:
            self._calls[names] = series
        return series

    def _observe_hit(self, record: CallRecord) -> None:
        """A call answered from the response cache: no provider, no spend, no upstream time.

        Its tokens were served, not used: they count apart from ``gateway_tokens_total``,
        which (with the cost) measures what providers were asked for.
        """
        usage = record.usage
        if usage.prompt_tokens or usage.completion_tokens:
            self._cache_hit_tokens["input"].inc(usage.prompt_tokens)
            self._cache_hit_tokens["output"].inc(usage.completion_tokens)

    # -- scrape --------------------------------------------------------------------------
    async def render(self) -> bytes:
        """The exposition text: live state read here, on the loop; text made in a thread.

        Scrapes arriving while one renders share its result instead of starting another.
        """
        rendering = self._rendering
        if rendering is None:
            scrape = _Scrape(self.registry, self._read_live_state())
            rendering = asyncio.get_running_loop().run_in_executor(None, generate_latest, scrape)
            self._rendering = rendering
            rendering.add_done_callback(self._rendered)
        return await asyncio.shield(rendering)

    def _rendered(self, rendering: asyncio.Future[bytes]) -> None:
        if self._rendering is rendering:
            self._rendering = None

    def render_now(self) -> bytes:
        """The exposition text, made on the calling thread (tests, tools)."""
        return generate_latest(_Scrape(self.registry, self._read_live_state()))

    def _read_live_state(self) -> list[Metric]:
        r = self._readers
        mailbox = GaugeMetricFamily(
            "gateway_actor_mailbox_size", "Messages waiting in each actor's mailbox.", labels=["actor"]
        )
        restarts = CounterMetricFamily(
            "gateway_actor_restarts", "Times each actor's loop crashed and was restarted.", labels=["actor"]
        )
        up = GaugeMetricFamily("gateway_actor_up", "1 while the actor's loop serves its mailbox.", labels=["actor"])
        if r.actors is not None:
            for ref in r.actors():
                mailbox.add_metric([ref.name], ref.mailbox_depth)
                restarts.add_metric([ref.name], ref.restarts)
                up.add_metric([ref.name], 1.0 if ref.alive else 0.0)
        circuits = GaugeMetricFamily(
            "gateway_circuit_state", "Circuit breaker state per deployment: 0 closed, 1 half-open, 2 open.",
            labels=["deployment"],
        )
        if r.circuits is not None:
            for deployment, state in r.circuits().items():
                value = state if isinstance(state, int) else CIRCUIT_STATES.get(str(state).lower(), 2)
                circuits.add_metric([deployment], value)
        billing = GaugeMetricFamily(
            "gateway_billing_pending_events", "Usage events recorded but not yet written to the ledger.",
            value=r.billing_pending() if r.billing_pending is not None else 0,
        )
        families: list[Metric] = [mailbox, restarts, up, circuits, billing]
        if r.limiter_degraded is not None:
            families.append(GaugeMetricFamily(
                "gateway_limiter_degraded", "1 while rate limits run on the local fallback store.",
                value=1.0 if r.limiter_degraded() else 0.0,
            ))
        if r.key_invalidation is not None:
            families.append(GaugeMetricFamily(
                "gateway_key_invalidation_listening", "1 while key changes from other replicas are heard.",
                value=1.0 if r.key_invalidation() else 0.0,
            ))
        if r.cache is not None:
            families.extend(_cache_families(r.cache()))
        for read in r.extra:
            families.extend(read())
        return families


def _cache_families(stats: Mapping[str, Any]) -> list[Metric]:
    """The response cache's counters and sizes as metric families (one scrape's worth)."""
    counters = stats.get("counters") or {}
    requests = CounterMetricFamily(
        "gateway_cache_requests",
        "Chat calls the response cache applied to, by what it did: hit (answered from it), "
        "miss (looked up, then the provider answered), bypass (not allowed to read it).",
        labels=["result"],
    )
    for result, counter in CACHE_RESULTS.items():
        requests.add_metric([result], counters.get(counter, 0))
    return [
        requests,
        CounterMetricFamily(
            "gateway_cache_semantic_hits", "Cache hits found by meaning (semantic groups); part of result=hit.",
            value=counters.get("semantic_hits", 0),
        ),
        CounterMetricFamily(
            "gateway_cache_evictions", "Cached answers dropped to stay within the cache's byte bound.",
            value=counters.get("evictions", 0),
        ),
        GaugeMetricFamily("gateway_cache_entries", "Answers held in this replica's memory.",
                          value=stats.get("entries", 0)),
        GaugeMetricFamily("gateway_cache_bytes", "Bytes of answers held in this replica's memory.",
                          value=stats.get("bytes", 0)),
        GaugeMetricFamily("gateway_cache_max_bytes", "The memory bound of the cache (cache.max_bytes).",
                          value=stats.get("max_bytes", 0)),
    ]


def cost_of(record: CallRecord) -> float:
    """USD of a call: billing's figure when it set one, else the provider's, else 0."""
    cost = record.cost_usd
    if cost is None:
        cost = record.usage.cost_usd
    return float(cost) if cost else 0.0
