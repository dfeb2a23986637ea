"""The benchmark's smoke run: ``python -m bench --quick --scenarios S1`` works end to end.

It starts real processes (fake provider, gateway, bare relay) for a few seconds, so it is
marked ``bench`` (deselect with ``-m "not bench"``). It checks that the run completes and
reports, never how fast anything was: performance is judged by the benchmark itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.bench, pytest.mark.timeout(240)]


def test_quick_s1_runs_end_to_end_and_writes_both_reports(tmp_path: Path, pg_admin_dsn: str) -> None:
    env = {**os.environ, "BENCH_PG_ADMIN_DSN": pg_admin_dsn}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--scenarios", "S1", "--duration", "1", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=220, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    (s1,) = report["scenarios"]
    assert s1["id"] == "S1" and s1["skipped"] is None
    for target in ("direct", "bare", "gateway"):
        assert s1["raw"][target]["ok"] > 0, s1["raw"][target]
        assert s1["raw"][target]["errors"] == {}, s1["raw"][target]
    # Every request was authenticated with a real key, and a cached key costs no hop.
    hops = report["hops"]["whole"]
    assert hops["failures"] == 0
    assert not [name for name in hops["per_request"] if name.startswith("auth ask")], hops
    markdown = (tmp_path / "latest.md").read_text()
    assert "| S1 | requests/s |" in markdown
    # All of it from one address under the default per-IP guard: no 429, and the report says so.
    assert "| S1 | 429 answers (one client address, default per-IP guard) |" in markdown


def test_the_guardrail_stream_measure_redacts_what_it_times() -> None:
    from bench.guardrail_stream import measure, stream_events

    # The measure refuses to report figures when the split card number got through.
    figures = measure(streams=3)
    assert set(figures) == {"first_chunk_us", "per_chunk_us", "stream_us"}
    assert 0 < figures["first_chunk_us"] < figures["stream_us"]
    assert b"4111 1111 " in b"".join(stream_events())  # the stream does carry a card to catch


def test_the_stream_relay_measure_checks_what_it_relays() -> None:
    from bench.stream_relay import measure

    # The measure refuses to report figures when usage, finish reason, id or bytes are wrong.
    for hide_usage in (False, True):
        for per_read, openai in ((1, False), (4, False), (1, True)):
            figures = measure(streams=3, rounds=1, per_read=per_read, hide_usage=hide_usage, openai=openai)
            assert figures["per_event_us"] > 0 and 0 < figures["writes_per_event"] <= 1


async def test_each_stack_in_turn_pins_the_server_apart_from_the_driver() -> None:
    """A Stack gives the driver its CPUs back at close: alternated passes (``bench.server_cpu``)
    each pin the server apart again, where the second once found one CPU and ran everything on it."""
    import shutil

    from bench.stack import Stack, StackOptions

    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2 or shutil.which("taskset") is None:
        pytest.skip("pinning needs two CPUs and taskset")
    try:
        for _ in range(2):
            stack = Stack(StackOptions(profiles=()))
            assert stack.pinned and stack.server_cpu != stack.load_cpu
            stack._pin_driver()
            assert os.sched_getaffinity(0) == {stack.load_cpu}
            await stack.close()
            assert os.sched_getaffinity(0) == cpus
    finally:
        os.sched_setaffinity(0, cpus)


def test_the_body_write_measure_times_both_ways_of_writing_an_event() -> None:
    from bench.body_write import main, measure

    figures = measure(streams=3, events=5, rounds=1)
    assert set(figures) == {"aiohttp", "direct"} and all(v > 0 for v in figures.values())
    with pytest.raises(SystemExit):
        main(["--events", "0"])


def test_the_provider_client_measure_times_both_clients_of_a_whole_call() -> None:
    from bench.provider_client import main, measure

    figures = measure(calls=20, concurrency=4, rounds=1)
    assert set(figures) == {"aiohttp", "ProviderHTTP"} and all(v > 0 for v in figures.values())
    with pytest.raises(SystemExit):
        main(["--calls", "0"])


async def test_server_cpu_alternates_variants_and_refuses_what_is_not_a_tree(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import argparse

    from bench.server_cpu import main, parse_variant

    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    quiet = parse_variant(f"quiet={REPO}:LOG_LEVEL=warning,BILLING_FSYNC_INTERVAL_SECONDS=0.02")
    assert quiet.repo == REPO and quiet.env == {"LOG_LEVEL": "warning", "BILLING_FSYNC_INTERVAL_SECONDS": "0.02"}
    for bad in ("no-equals", f"x={tmp_path}", f"x={REPO}:NOVALUE"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)
    figures = await main(["--seconds", "1", "--pairs", "1", "--no-budget",
                          "--variant", f"here={REPO}", "--variant", f"quiet={REPO}:LOG_LEVEL=warning"])
    assert list(figures) == ["here", "quiet"] and all(len(v) == 1 and v[0] > 0 for v in figures.values())


async def test_server_cpu_splits_a_stream_into_per_chunk_and_per_stream_and_measures_the_bare_relay(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.server_cpu import main, parse_variant

    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    assert parse_variant("relay=bare").bare
    figures = await main(["--stream", "--chunks", "2,6", "--seconds", "1", "--pairs", "1", "--no-budget",
                          "--variant", f"here={REPO}", "--variant", "relay=bare"])
    assert list(figures) == ["here@2", "here@6", "relay@2", "relay@6"]
    assert all(len(v) == 1 and v[0] > 0 for v in figures.values())
    out = capsys.readouterr().out
    assert "here: " in out and "relay: " in out and "µs per chunk" in out and "per stream whatever its length" in out
    for bad in (["--chunks", "2,2"], ["--chunks", "0"], ["--chunks", "x"], ["--chunks", "1,2,3"]):
        with pytest.raises(SystemExit):
            await main(["--stream", *bad, "--variant", f"here={REPO}"])
    with pytest.raises(SystemExit):
        await main(["--chunks", "2,6", "--variant", f"here={REPO}"])  # lengths are for streams


def test_the_keep_busy_spinner_idles_on_one_cpu_and_ends_with_its_block_or_its_deadline() -> None:
    import time

    from bench.server_cpu import spinner

    cpus = os.sched_getaffinity(0)
    if not hasattr(os, "SCHED_IDLE") or len(cpus) < 2:
        pytest.skip("the spinner needs Linux's SCHED_IDLE and two CPUs")
    cpu = max(cpus)
    with spinner(cpu, 60) as proc:
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(proc.pid) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert os.sched_getaffinity(proc.pid) == {cpu}
        assert proc.poll() is None
    assert proc.poll() is not None  # killed with the block, well before its 60 s
    with spinner(cpu, 0.2) as short:
        assert short.wait(timeout=60) == 0  # its own deadline ends it (a starved spinner looks late)


async def test_server_cpu_spreads_streams_as_s3_does_unless_in_phase_and_keeps_the_cpu_busy_on_request(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.scenarios import profiles_for
    from bench.server_cpu import main

    assert profiles_for(False)["stream"].stream_seconds == 1.0  # 50 chunks 20 ms apart: S3's spread
    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    with pytest.raises(SystemExit):
        await main(["--in-phase", "--variant", f"here={REPO}"])  # the phase is a stream's
    import shutil

    pinned = len(os.sched_getaffinity(0)) >= 2 and shutil.which("taskset") is not None
    busy = ["--keep-busy"] if hasattr(os, "SCHED_IDLE") and pinned else []
    for phase in (["--in-phase"], []):
        figures = await main(["--stream", "--chunks", "2", "--seconds", "1", "--pairs", "1", "--no-budget",
                              *phase, *busy, "--variant", f"here={REPO}"])
        assert list(figures) == ["here"] and figures["here"][0] > 0


async def test_opcodes_counts_a_few_streams_each_event_read_alone(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.opcodes import main

    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    with pytest.raises(SystemExit):
        await main(["--concurrency", "0"])
    (gateway,) = await main(["--stream", "--chunks", "3", "--concurrency", "1", "--seconds", "1", "--top", "3",
                             "--variant", f"gateway={REPO}"])
    # One client: a stream at a time (64 would have started 64 in the first moment).
    assert 0 < gateway.requests < 64
    # Each event is read on its own: the upstream connection's reads (aiohttp's
    # data_received; the relay takes each chunk there, it does not await readany) are at
    # least the stream's chunks.
    reads = sum(calls for (path, func, _), (_, calls) in gateway.functions.items()
                if (path, func) == ("aiohttp/client_proto.py", "data_received"))
    assert reads >= 3 * gateway.requests


async def test_opcodes_counts_each_variants_instructions_per_request(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.opcodes import main

    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    bare, gateway = await main(["--seconds", "1", "--top", "5"])
    assert (bare.name, gateway.name) == ("bare", "gateway")
    assert bare.requests > 0 and gateway.requests > 0
    # Each server's own code is in its counts and only there: the counts are of that process.
    assert bare.areas().get("bare relay", 0) > 0 and "gateway" not in bare.areas()
    assert gateway.areas().get("gateway", 0) > 0 and "bare relay" not in gateway.areas()
    assert gateway.functions[("aiohttp/web_request.py", "__init__", 179)][1] == gateway.requests
    out = capsys.readouterr().out
    assert "| bare | " in out and "| gateway | " in out and "instructions per request" in out


async def test_opcodes_counts_the_lines_of_the_files_asked_for(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.opcodes import main

    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    (gateway,) = await main(["--seconds", "1", "--top", "5", "--lines", "gateway/edge/dispatch.py",
                             "--variant", f"gateway={REPO}"])
    assert gateway.lines and {path for path, _, _ in gateway.lines} == {"gateway/edge/dispatch.py"}
    # Line by line is the same count cut finer: the lines of each function name add up to
    # what the functions of that name counted.
    by_function: dict[str, int] = {}
    for (path, func, _), (instructions, _calls) in gateway.functions.items():
        if path == "gateway/edge/dispatch.py":
            by_function[func] = by_function.get(func, 0) + instructions
    by_lines: dict[str, int] = {}
    for (_, func, _), instructions in gateway.lines.items():
        by_lines[func] = by_lines.get(func, 0) + instructions
    assert by_lines == {func: n for func, n in by_function.items() if n}
    assert "Lines by instructions per request in gateway" in capsys.readouterr().out


async def test_first_chunk_measures_each_target_at_each_concurrency(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.first_chunk import main

    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    firsts = await main(["--concurrency", "1,2", "--seconds", "0.5", "--rounds", "1", "--chunks", "2", "--no-budget"])
    assert set(firsts) == {(n, t) for n in (1, 2) for t in ("direct", "bare", "gateway")}
    assert all(values and all(0 < v < 5 for v in values) for values in firsts.values())
    out = capsys.readouterr().out
    assert "| 1 | gateway |" in out and "| 2 | bare |" in out and "p50 over the bare relay's" in out
    for bad in (["--concurrency", "0"], ["--concurrency", "x"], ["--rounds", "0"], ["--gateway-env", "NOVALUE"]):
        with pytest.raises(SystemExit):
            await main(bad)


async def test_threads_reads_each_servers_threads_per_request(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("needs Linux's schedstat")
    from bench.threads import main

    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    results = await main(["--profile", "fast", "--concurrency", "2", "--seconds", "1", "--no-budget"])
    for target in ("bare", "gateway"):
        (rows,) = results[target]
        main_thread = rows[0]
        assert main_thread.name == "main (event loop)" and main_thread.run_us > 0 and main_thread.slices > 0
    # The gateway has helper threads (the log writer at least) that the bare relay has not.
    assert len(results["gateway"][0]) > len(results["bare"][0])
    out = capsys.readouterr().out
    assert "round 1, gateway:" in out and "| main (event loop) |" in out
    for bad in (["--concurrency", "0"], ["--profile", "stream"], ["--gateway-env", "NOVALUE"]):
        with pytest.raises(SystemExit):
            await main(bad)


async def test_native_samples_each_variant_below_python(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.native import main, perf_usable

    why = perf_usable()
    if why is not None:
        pytest.skip(why)
    monkeypatch.setenv("BENCH_PG_ADMIN_DSN", pg_admin_dsn)
    with pytest.raises(SystemExit):
        await main(["--chunks", "0"])
    bare, gateway = await main(["--seconds", "1", "--top", "3"])
    assert (bare.name, gateway.name) == ("bare", "gateway")
    assert bare.requests > 0 and gateway.requests > 0 and bare.cpu_seconds > 0 and gateway.cpu_seconds > 0
    for samples in (bare, gateway):
        # The samples are the server's own: the interpreter is most of them, its event loop's
        # thread the largest, and the shares are of one whole (each table sums to one).
        assert "python" in max(samples.by_dso, key=lambda dso: samples.by_dso[dso])
        assert max(samples.by_thread, key=lambda t: samples.by_thread[t]) == "main (event loop)"
        assert sum(samples.by_dso.values()) == pytest.approx(1.0, abs=0.02)
        assert sum(samples.by_thread.values()) == pytest.approx(1.0, abs=0.02)
    # Only the gateway runs the gateway's C dependencies (orjson encodes its ledger and log lines).
    assert not any("orjson" in dso for dso in bare.by_dso)
    out = capsys.readouterr().out
    assert "| bare | " in out and "| gateway | " in out and "| main (event loop) |" in out
