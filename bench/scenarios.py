"""The scenarios S1-S6: each drives the same load at a direct call to the fake provider,
at the bare relay and at the gateway, and turns what it saw into report rows.

Every scenario is bounded in time and in request count. ``quick`` shrinks durations
and sizes to a smoke run of seconds; the full sizes are the issue's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.driver import Call, Result, closed_loop, open_loop, percentile
from bench.stack import ProcWatch, Profile, Stack, Window

__all__ = ["PROFILES", "SCENARIOS", "Row", "RunContext", "ScenarioReport", "profiles_for"]

MB = 1024 * 1024
TARGETS = ("direct", "bare", "gateway")


def profiles_for(quick: bool) -> dict[str, Profile]:
    """The fake upstreams a run may need, by name."""
    return {
        "fast": Profile("fast"),
        "slow": Profile("slow", latency_ms=50),
        "stream": Profile("stream", chunks=50, chunk_delay_ms=20),
        # S4: long-lived streams that mostly wait, as real LLM streams do.
        "trickle": Profile("trickle", chunks=10, chunk_delay_ms=100) if quick
        else Profile("trickle", chunks=20, chunk_delay_ms=250),
    }


#: Which profiles each scenario needs (the run starts only those).
PROFILES: dict[str, tuple[str, ...]] = {
    "S1": ("fast",), "S2": ("slow",), "S3": ("stream",), "S4": ("trickle",),
    "S5": ("fast", "stream"), "S6": ("slow",),
}


@dataclass
class Row:
    """One line of the report's table."""

    scenario: str
    metric: str
    values: Mapping[str, float | None]  # by target
    unit: str
    compare: str = ""  # gateway against direct (and bare)
    bar: str = ""
    passed: bool | None = None


@dataclass
class ScenarioReport:
    id: str
    title: str
    rows: list[Row] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None


@dataclass
class RunContext:
    stack: Stack
    quick: bool
    targets: tuple[str, ...] = TARGETS
    duration: float | None = None  # overrides each scenario's measured duration
    rounds: int = 1  # S1-S3, S6: interleaved rounds, best kept per target
    soak: float | None = None  # overrides S5's duration

    def seconds(self, full: float, quick: float) -> float:
        if self.duration is not None:
            return self.duration
        return quick if self.quick else full

    def call(self, target: str, profile: Profile, body: dict[str, Any]) -> Call:
        stack = self.stack
        if target == "direct":
            return Call.chat(f"{stack.fakes[profile.name]}/v1/chat/completions", body)
        if target == "bare":
            return Call.chat(f"{stack.bares[profile.name]}/v1/chat/completions", body)
        return Call.chat(f"{stack.gateway_url}/v1/chat/completions", body, stack.api_key)

    def pid(self, target: str, profile: Profile) -> int | None:
        if target == "gateway" and self.stack.gateway is not None:
            return self.stack.gateway.pid
        if target == "bare" and profile.name in self.stack.bare_procs:
            return self.stack.bare_procs[profile.name].pid
        return None

    def active(self) -> list[str]:
        return [t for t in self.targets if t != "bare" or self.stack.bares]


def whole_body(profile: Profile) -> dict[str, Any]:
    return {
        "model": profile.model,
        "messages": [{"role": "user", "content": "Say hello to the benchmark"}],
        "max_tokens": 16,
    }


def stream_body(profile: Profile, words: int) -> dict[str, Any]:
    return {
        **whole_body(profile),
        "max_tokens": words,
        "stream": True,
        "stream_options": {"include_usage": True},
        "mock_completion_words": words,
    }


@dataclass
class Measured:
    """One target's pass: what the driver saw and what its process used."""

    result: Result
    window: Window | None = None
    db: tuple[int, int] | None = None  # gateway: (writes, bytes) to PostgreSQL in the pass

    def json(self) -> dict[str, Any]:
        out = self.result.summary()
        if self.window is not None:
            w = self.window
            out["process"] = {
                "cpu_s": round(w.cpu, 3),
                "cpu_pct": round(100 * w.cpu / w.wall, 1) if w.wall else None,
                "rss_start_mb": round(w.start_rss / MB, 1),
                "rss_peak_mb": round(w.peak_rss / MB, 1),
                "rss_end_mb": round(w.end_rss / MB, 1),
            }
            if self.result.ok:
                out["process"]["cpu_us_per_request"] = round(1e6 * w.cpu / self.result.ok, 1)
        if self.db is not None:
            out["database"] = {"writes": self.db[0], "bytes": self.db[1]}
        return out


#: One pass at one target: it calls its argument when its warm-up ends, so the server's
#: CPU is read over the requests it counts. Before, the warm-up's CPU was in the figure
#: and its requests were not: S1's CPU per request read about 13 % high and S3's per
#: chunk about 30 %, alike for every server (the ratios held). S3's streams in flight when
#: the warm-up ends are still not counted, while the window runs to the last counted
#: stream's end: its figure stays about 10 % high (one stream's length over the pass's).
Run = Callable[[Callable[[], None]], Awaitable[Result]]


def _nothing() -> None:
    return None


async def measure(ctx: RunContext, target: str, profile: Profile, run: Run) -> Measured:
    pid = ctx.pid(target, profile)
    counter = ctx.stack.db_counter if target == "gateway" else None
    before = counter.snapshot() if counter is not None else None
    if pid is None:
        return Measured(await run(_nothing))
    watch = ProcWatch(pid)
    async with watch.window() as window:
        result = await run(lambda: watch.restart(window))
    db = None
    if counter is not None and before is not None:
        after = counter.snapshot()
        db = (after[0] - before[0], after[1] - before[1])
    return Measured(result, window, db)


async def rounds_of(
    ctx: RunContext, profile: Profile, targets: list[str], run_for: Callable[[str], Run],
) -> dict[str, list[Measured]]:
    """Every pass of ``ctx.rounds`` interleaved rounds (each round runs each target once)."""
    passes: dict[str, list[Measured]] = {}
    for _ in range(ctx.rounds):
        for target in targets:
            passes.setdefault(target, []).append(await measure(ctx, target, profile, run_for(target)))
    return passes


def best_by(passes: dict[str, list[Measured]], score: Callable[[Result], float]) -> dict[str, Measured]:
    """Each target's best pass (lowest ``score``)."""
    return {target: min(runs, key=lambda m: score(m.result)) for target, runs in passes.items()}


async def best_of(
    ctx: RunContext, profile: Profile, targets: list[str],
    run_for: Callable[[str], Run],
    score: Callable[[Result], float],
) -> dict[str, Measured]:
    """Each target's best pass (lowest ``score``) of ``ctx.rounds`` interleaved rounds.

    On a shared machine, noise only ever slows a pass down: the best of a few
    interleaved rounds is the fairest figure for every target alike.
    """
    return best_by(await rounds_of(ctx, profile, targets, run_for), score)


def _p(result: Result, q: float, values: str = "latencies") -> float:
    data = getattr(result, values)
    return percentile(sorted(data), q) if data else float("inf")


def _ms(result: Result, q: float, values: str = "latencies") -> float | None:
    data = getattr(result, values)
    return round(1000 * percentile(sorted(data), q), 2) if data else None


def _added(passes: dict[str, Measured], q: float, values: str = "latencies") -> tuple[float | None, str]:
    """Gateway minus direct at percentile ``q`` (ms), and the comparison text."""
    if "gateway" not in passes or "direct" not in passes:
        return None, ""
    g, d = _ms(passes["gateway"].result, q, values), _ms(passes["direct"].result, q, values)
    if g is None or d is None:
        return None, ""
    text = f"{g - d:+.2f} ms"
    if "bare" in passes:
        b = _ms(passes["bare"].result, q, values)
        if b is not None:
            text += f" (bare {b - d:+.2f})"
    return g - d, text


def _row_ms(sid: str, metric: str, passes: dict[str, Measured], q: float, values: str = "latencies",
            bar: float | None = None) -> Row:
    added, text = _added(passes, q, values)
    return Row(
        sid, metric, {t: _ms(m.result, q, values) for t, m in passes.items()}, "ms", text,
        f"added ≤ {bar:g} ms" if bar is not None else "",
        (added <= bar) if (bar is not None and added is not None) else None,
    )


def _row_429(sid: str, passes: dict[str, Measured]) -> Row:
    """429 answers per target: all load comes from one address (127.0.0.1) with valid
    keys under the default per-IP guard, so the gateway must refuse none."""
    refused = {t: float(m.result.errors.get("http 429", 0)) for t, m in passes.items()}
    g = refused.get("gateway")
    return Row(sid, "429 answers (one client address, default per-IP guard)", refused, "answers", "", "0",
               None if g is None else g == 0)


def _errors_note(report: ScenarioReport, passes: dict[str, Measured]) -> None:
    for target, m in passes.items():
        if m.result.errors:
            report.notes.append(f"{target}: errors {dict(m.result.errors)}")
        if m.result.shed:
            report.notes.append(f"{target}: {m.result.shed} requests not sent (driver in-flight bound)")


# ----------------------------------------------------------------------------- S1
async def s1(ctx: RunContext) -> ScenarioReport:
    report = ScenarioReport("S1", "throughput: non-streaming, fast upstream, 32 concurrent")
    profile = profiles_for(ctx.quick)["fast"]
    duration, warmup = ctx.seconds(15, 2), (0.5 if ctx.quick else 2.0)

    def run_for(target: str) -> Run:
        call = ctx.call(target, profile, whole_body(profile))
        return lambda measuring: closed_loop(lambda _i: call, concurrency=32, duration=duration, warmup=warmup,
                                             on_measure=measuring)

    passes = await best_of(ctx, profile, ctx.active(), run_for, lambda r: -r.rps)
    report.raw = {t: m.json() for t, m in passes.items()}
    rps = {t: round(m.result.rps, 1) for t, m in passes.items()}
    g = rps.get("gateway")
    compare = ""
    if g is not None:
        parts = [f"{g / rps[t]:.2f}× {t}" for t in ("direct", "bare") if rps.get(t)]
        compare = ", ".join(parts)
    starved = {t for t, m in passes.items() if _starved(m)}
    verdict = None if g is None or (g < 2000 and "gateway" in starved) else g >= 2000
    if g is not None and g < 2000 and "gateway" in starved:
        compare += " (gateway CPU-starved: inconclusive)"
    report.rows.append(Row("S1", "requests/s", dict(rps), "req/s", compare, "≥ 2000 (≈ 0.75× bare)", verdict))
    report.rows.append(_row_429("S1", passes))
    report.rows.append(_row_ms("S1", "latency p50", passes, 50))
    report.rows.append(_row_ms("S1", "latency p99", passes, 99))
    cpu = {t: (m.json()["process"].get("cpu_us_per_request") if m.window else None) for t, m in passes.items()}
    report.rows.append(_ratio_row("S1", "server CPU per request", cpu, "µs", S1_CPU_RATIO_BAR, stretch=S1_CPU_RATIO_STRETCH))
    # What one full core would serve at that cost: steadier than requests/s on a busy machine.
    capacity = {t: (round(1e6 / v) if v else None) for t, v in cpu.items() if t != "direct"}
    report.rows.append(Row("S1", "requests per CPU-second", capacity, "req/s", _ratio(capacity, "gateway", "bare"),
                           "(estimate: 1 s / CPU per request)"))
    cpu_pct = {t: (m.json()["process"]["cpu_pct"] if m.window else None) for t, m in passes.items()}
    report.rows.append(Row("S1", "server CPU", cpu_pct, "% of a core"))
    rss = {t: (round(m.window.peak_rss / MB, 1) if m.window else None) for t, m in passes.items()}
    report.rows.append(Row("S1", "server peak RSS", rss, "MB"))
    gw = passes.get("gateway")
    if gw is not None and gw.db is not None and gw.result.ok:
        per = gw.db[0] / gw.result.ok
        report.rows.append(Row(
            "S1", "database writes per request", {"gateway": round(per, 4)}, "",
            f"{gw.db[0]} writes, {gw.db[1]} bytes in {gw.result.ok} requests", "cached key: no round trip",
            per < 0.05,
        ))
    for target in sorted(starved):
        m = passes[target]
        if m.window is not None:
            report.notes.append(
                f"{target} got only {100 * m.window.cpu / m.window.wall:.0f} % of its CPU while the driver was "
                "not saturated: other processes held that CPU, so its throughput here is not representative"
            )
    if ctx.rounds > 1:
        report.notes.append(f"best of {ctx.rounds} interleaved rounds per target")
    report.notes.append(
        "driver CPU: " + ", ".join(f"{t} {m.result.summary()['driver_cpu_pct']}%" for t, m in passes.items())
        + " (near 100% means the driver, not the server, set the pace)"
    )
    _errors_note(report, passes)
    return report


def _starved(m: Measured) -> bool:
    """Did the server get well under a CPU while the driver was not the bottleneck?"""
    w = m.window
    return bool(w is not None and w.wall and w.cpu / w.wall < 0.7 and m.result.driver_cpu / m.result.duration < 0.9)


#: Issue 23's targets: the gateway's CPU against the bare relay's, in the same run.
S1_CPU_RATIO_BAR, S1_CPU_RATIO_STRETCH = 2.0, 1.5
S3_CPU_RATIO_BAR = 1.5
#: S2: the gateway's added p99 may exceed the bare relay's added p99 by this much (ms).
S2_P99_OVER_BARE_MS = 1.0


def _ratio_row(sid: str, metric: str, values: dict[str, float | None], unit: str, bar: float, *,
               stretch: float | None = None) -> Row:
    """A per-unit CPU row with its verdict: gateway at most ``bar`` times bare (None without both)."""
    g, b = values.get("gateway"), values.get("bare")
    ratio = g / b if g and b else None
    text = f"{ratio:.2f}× bare" if ratio is not None else ""
    if ratio is not None and stretch is not None:
        text += f" (stretch {stretch:g}×: {'met' if ratio <= stretch else 'not met'})"
    return Row(sid, metric, values, unit, text, f"≤ {bar:g}× bare", None if ratio is None else ratio <= bar)


def _ratio(values: dict[str, float | None], a: str, b: str) -> str:
    va, vb = values.get(a), values.get(b)
    return f"{va / vb:.2f}× {b}" if va and vb else ""


# ----------------------------------------------------------------------------- S2
async def s2(ctx: RunContext) -> ScenarioReport:
    report = ScenarioReport("S2", "added latency: 200 req/s open loop, 50 ms upstream")
    profile = profiles_for(ctx.quick)["slow"]
    duration, warmup = ctx.seconds(20, 3), (0.5 if ctx.quick else 2.0)
    every = await rounds_of(ctx, profile, ctx.active(), _open_run(ctx, profile, rate=200, duration=duration,
                                                                   warmup=warmup))
    passes = best_by(every, _open_score)
    report.raw = {t: m.json() for t, m in passes.items()}
    report.rows.append(_row_ms("S2", "latency p50", passes, 50, bar=2.0))
    report.rows.append(_row_ms("S2", "latency p99", passes, 99, bar=5.0))
    report.rows.append(_p99_over_bare(passes))
    if ctx.rounds > 1:
        report.notes.append(_p99_rounds(every))
    _errors_note(report, passes)
    return report


def _p99_rounds(every: dict[str, list[Measured]]) -> str:
    """Every round's p99 per target, and the gateway's over the bare relay's round by round:
    how far one run's noise moves the figure the bar reads (each target's best round)."""
    p99 = {t: [_ms(m.result, 99) for m in runs] for t, runs in every.items()}
    text = "p99 each round (ms): " + "; ".join(
        f"{t} " + ", ".join(f"{v:.2f}" for v in values if v is not None) for t, values in p99.items())
    pairs = [(g - b) for g, b in zip(p99.get("gateway", []), p99.get("bare", []), strict=False)
             if g is not None and b is not None]
    if pairs:
        text += "; gateway over bare relay in the same round: " + ", ".join(f"{d:+.2f}" for d in pairs)
    return text


def _p99_over_bare(passes: dict[str, Measured]) -> Row:
    """S2's second bar: the gateway adds at most 1 ms of p99 more than the bare relay does."""
    values = {t: _ms(m.result, 99) for t, m in passes.items()}
    g, b, d = values.get("gateway"), values.get("bare"), values.get("direct")
    if g is None or b is None or d is None:
        return Row("S2", "added p99 over the bare relay's", {}, "ms", "needs direct, bare and gateway")
    over = (g - d) - (b - d)
    return Row("S2", "added p99 over the bare relay's", {"gateway": round(over, 2)}, "ms",
               f"gateway +{g - d:.2f} ms, bare +{b - d:.2f} ms", f"≤ {S2_P99_OVER_BARE_MS:g} ms",
               over <= S2_P99_OVER_BARE_MS)


async def _open_passes(
    ctx: RunContext, profile: Profile, *, rate: float, duration: float, warmup: float,
    targets: list[str] | None = None, during: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Measured]:
    run_for = _open_run(ctx, profile, rate=rate, duration=duration, warmup=warmup, during=during)
    return await best_of(ctx, profile, targets or ctx.active(), run_for, _open_score)


def _open_run(
    ctx: RunContext, profile: Profile, *, rate: float, duration: float, warmup: float,
    during: Callable[[], Awaitable[None]] | None = None,
) -> Callable[[str], Run]:
    """An open-loop pass of whole calls at ``rate``, per target."""

    def run_for(target: str) -> Run:
        call = ctx.call(target, profile, whole_body(profile))
        return lambda measuring: open_loop(lambda _i: call, rate=rate, duration=duration, warmup=warmup,
                                           during=during, on_measure=measuring)

    return run_for


def _open_score(result: Result) -> float:
    """An open-loop pass's score, lower is better: its p50 plus its p99."""
    return _p(result, 50) + _p(result, 99)


# ----------------------------------------------------------------------------- S3
async def s3(ctx: RunContext) -> ScenarioReport:
    report = ScenarioReport("S3", "streaming: 64 concurrent streams × 50 chunks at 20 ms")
    profile = profiles_for(ctx.quick)["stream"]
    # Streams start spread over one stream's length, then stay in phase: no waves of 64.
    stream_seconds = profile.stream_seconds
    duration, warmup = ctx.seconds(10, 2), stream_seconds + (0.0 if ctx.quick else 1.0)

    def run_for(target: str) -> Run:
        call = ctx.call(target, profile, stream_body(profile, 50))
        return lambda measuring: closed_loop(lambda _i: call, concurrency=64, duration=duration, warmup=warmup,
                                             stagger=stream_seconds, on_measure=measuring)

    every = await rounds_of(ctx, profile, ctx.active(), run_for)
    passes = best_by(every, lambda r: _p(r, 50, "ttfcs"))
    report.raw = {t: m.json() for t, m in passes.items()}
    report.rows.append(_row_ms("S3", "time to first chunk p50", passes, 50, "ttfcs", bar=1.5))
    report.rows.append(_row_ms("S3", "time to first chunk p99", passes, 99, "ttfcs"))
    report.rows.append(_row_ms("S3", "stream total p50", passes, 50))
    report.rows.append(_row_ms("S3", "stream total p99", passes, 99))
    expected = max(passes["direct"].result.events, default=0) if "direct" in passes else 0
    if not expected:
        expected = max((max(m.result.events, default=0) for m in passes.values()), default=0)
    lost: dict[str, float | None] = {}
    for target, m in passes.items():
        lost[target] = expected * m.result.count - sum(m.result.events)
    streams = {t: float(m.result.count) for t, m in passes.items()}
    # Server CPU per relayed chunk (every event the client received): a stream's cost. Each
    # target's lowest of its rounds, as S1's CPU comes from its best round (noise only ever
    # adds CPU); the best round by first chunk above need not be the one with the least.
    rounds = {t: [c for m in runs if (c := _cpu_per_chunk(m)) is not None] for t, runs in every.items() if t != "direct"}
    per_chunk = {t: (min(values) if values else None) for t, values in rounds.items()}
    report.rows.append(_ratio_row("S3", "server CPU per chunk", per_chunk, "µs", S3_CPU_RATIO_BAR))
    if ctx.rounds > 1:
        report.notes.append("server CPU per chunk, each round (the lowest is the row's): " + "; ".join(
            f"{t} " + ", ".join(f"{v:g}" for v in values) + " µs" for t, values in rounds.items()))
    report.rows.append(Row("S3", "streams", streams, ""))
    report.rows.append(Row("S3", "chunks lost", lost, "", f"{expected} events per stream", "= 0",
                           lost.get("gateway") == 0 if "gateway" in lost else None))
    _errors_note(report, passes)
    return report


def _cpu_per_chunk(m: Measured) -> float | None:
    """A stream pass's server CPU per event the clients received (µs), if it was measured."""
    events = sum(m.result.events)
    return round(1e6 * m.window.cpu / events, 1) if m.window and events else None


# ----------------------------------------------------------------------------- S4
async def s4(ctx: RunContext) -> ScenarioReport:
    n = 200 if ctx.quick else 1000
    profile = profiles_for(ctx.quick)["trickle"]
    seconds = profile.stream_seconds
    report = ScenarioReport("S4", f"{n} concurrent slow streams ({profile.chunks} chunks × {profile.chunk_delay_ms} ms)")
    passes: dict[str, Measured] = {}
    for target in ctx.active():
        call = ctx.call(target, profile, stream_body(profile, profile.chunks or 10))
        passes[target] = await measure(
            ctx, target, profile,
            lambda measuring, call=call: closed_loop(  # type: ignore[misc]
                lambda _i: call, concurrency=n, duration=seconds * 4 + 30, max_requests=n, on_measure=measuring
            ),
        )
    report.raw = {t: m.json() for t, m in passes.items()}
    done = {t: float(m.result.ok) for t, m in passes.items()}
    report.rows.append(Row("S4", "streams complete", done, f"of {n}", "", f"all {n}",
                           done.get("gateway") == n if "gateway" in done else None))
    report.rows.append(_row_429("S4", passes))
    rss = {t: (round(m.window.peak_rss / MB, 1) if m.window else None) for t, m in passes.items()}
    base = {t: (round(m.window.start_rss / MB, 1) if m.window else None) for t, m in passes.items()}
    g = rss.get("gateway")
    report.rows.append(Row("S4", "server RSS before", base, "MB"))
    report.rows.append(Row("S4", "server peak RSS", rss, "MB", _ratio(rss, "gateway", "bare"), "≤ 150 MB",
                           None if g is None else g <= 150))
    report.rows.append(_row_ms("S4", "stream total p99", passes, 99))
    _errors_note(report, passes)
    return report


# ----------------------------------------------------------------------------- S5
async def s5(ctx: RunContext) -> ScenarioReport:
    profiles = profiles_for(ctx.quick)
    fast, stream = profiles["fast"], profiles["stream"]
    total = ctx.soak if ctx.soak is not None else (6.0 if ctx.quick else 180.0)
    warmup = max(1.0, total * 0.2)
    rate = 200.0
    report = ScenarioReport(
        "S5", f"soak: {total:g} s at {rate:g} req/s (1 in 10 a 1 s stream), RSS after {warmup:g} s warm-up"
    )
    if "gateway" not in ctx.targets or ctx.stack.gateway is None:
        report.skipped = "needs the gateway target"
        return report
    calls = [ctx.call("gateway", fast, whole_body(fast)), ctx.call("gateway", stream, stream_body(stream, 50))]
    watch = ProcWatch(ctx.stack.gateway.pid)
    samples: list[tuple[float, int]] = []
    started = time.perf_counter()

    async def sample() -> None:
        while True:
            samples.append((time.perf_counter() - started, watch.rss()))
            await asyncio.sleep(0.5 if ctx.quick else 2.0)

    result = await open_loop(
        lambda i: calls[1] if i % 10 == 9 else calls[0], rate=rate, duration=total - warmup, warmup=warmup,
        during=sample,
    )
    samples.append((time.perf_counter() - started, watch.rss()))
    after = [rss for t, rss in samples if t >= warmup]
    head = after[:3] or [samples[-1][1]]
    tail = after[-3:] or [samples[-1][1]]
    start_rss, end_rss = sum(head) / len(head), sum(tail) / len(tail)
    growth = 100 * (end_rss - start_rss) / start_rss if start_rss else 0.0
    report.raw = {
        "gateway": result.summary(),
        "rss_samples_mb": [(round(t, 1), round(r / MB, 1)) for t, r in samples],
    }
    report.rows.append(Row("S5", "gateway RSS after warm-up → end", {"gateway": round(start_rss / MB, 1)}, "MB",
                           f"→ {end_rss / MB:.1f} MB ({growth:+.1f} %)", "growth < 5 %", growth < 5))
    report.rows.append(Row("S5", "whole-call latency p99", {"gateway": _ms(result, 99, "whole_latencies")}, "ms"))
    if result.errors:
        report.notes.append(f"gateway: errors {dict(result.errors)}")
    if ctx.quick:
        report.notes.append("quick mode: a few seconds only, so growth here says little about leaks")
    return report


# ----------------------------------------------------------------------------- S6
async def s6(ctx: RunContext) -> ScenarioReport:
    report = ScenarioReport("S6", "p99 while /metrics is scraped every second (S2's load)")
    profile = profiles_for(ctx.quick)["slow"]
    url = f"{ctx.stack.management_url}/metrics"
    async with aiohttp.ClientSession() as session:
        try:
            async with session.get(url) as r:
                status = r.status
        except aiohttp.ClientError:
            status = 0
    if status == 404:
        report.skipped = "/metrics answers 404 on the management plane (not built yet)"
        return report
    if status != 200:
        report.skipped = f"/metrics answered {status}"
        return report
    duration, warmup = ctx.seconds(20, 3), (0.5 if ctx.quick else 2.0)
    scrapes: list[float] = []
    sizes: list[int] = []

    async def scrape() -> None:
        async with aiohttp.ClientSession() as s:
            while True:
                t0 = time.perf_counter()
                async with s.get(url) as r:
                    sizes.append(len(await r.read()))
                scrapes.append(time.perf_counter() - t0)
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))

    targets = [t for t in ctx.active() if t != "bare"]
    passes = await _open_passes(ctx, profile, rate=200, duration=duration, warmup=warmup, targets=targets)
    scraped = await _open_passes(ctx, profile, rate=200, duration=duration, warmup=warmup,
                                 targets=["gateway"], during=scrape)
    report.raw = {t: m.json() for t, m in passes.items()}
    report.raw["gateway_scraped"] = scraped["gateway"].json()
    report.raw["scrapes"] = {"count": len(scrapes), "bytes_last": sizes[-1] if sizes else 0,
                             "ms_max": round(1000 * max(scrapes), 2) if scrapes else None}
    without = _ms(passes["gateway"].result, 99)
    with_ = _ms(scraped["gateway"].result, 99)
    ratio = (with_ / without) if (with_ and without) else None
    report.rows.append(Row(
        "S6", "latency p99 without → with scraping",
        {"direct": _ms(passes["direct"].result, 99) if "direct" in passes else None, "gateway": without}, "ms",
        f"→ {with_} ms ({ratio:.2f}×)" if ratio else "", "≤ 1.5×", None if ratio is None else ratio <= 1.5,
    ))
    if scrapes:
        report.notes.append(
            f"{len(scrapes)} scrapes of {sizes[-1]} bytes, slowest {1000 * max(scrapes):.1f} ms"
        )
    _errors_note(report, {**passes, "gateway (scraped)": scraped["gateway"]})
    return report


SCENARIOS: dict[str, Callable[[RunContext], Awaitable[ScenarioReport]]] = {
    "S1": s1, "S2": s2, "S3": s3, "S4": s4, "S5": s5, "S6": s6,
}
